"""Bad inputs to flashserve.v1.Sequences (the real binary, CPU backend), sent as raw messages so the server's own
validation answers: each gets its status code and a message naming the problem, changes nothing (the sequence's
lengths stay and its next answer is still right), and the server keeps serving."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import sequences_pb2 as spb
from flashserve import tensors
from conftest import ServerProcess, _stop_and_check
from sequences_truth import Truth

pytestmark = pytest.mark.e2e
INVALID = grpc.StatusCode.INVALID_ARGUMENT
SHAPE = dict(num_layers=2, heads_q=4, heads_kv=2, head_dim=64, dtype="float16")


@pytest.fixture(scope="module")
def kv_server(flashserve_bin, tmp_path_factory):
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("kv_bad"),
                      ["--kv_cache_bytes=33554432", "--kv_page_tokens=16", "--max_sequence_tokens=256"],
                      name="kv_bad").start()
    yield s
    _stop_and_check(s)


@pytest.fixture
def setup(kv_server, rng):
    truth = Truth(rng, 4, 2, 64, "float16")
    with flashserve.SequenceClient(kv_server.address, timeout=30, reprefill=False) as client:
        k, v = truth.rows(10)
        seq = client.create(**SHAPE, prefix={0: (k, v)}, max_tokens=32)
        truth.add(seq.key, 0, k, v)
        yield client, seq, truth
        _still_right(client, seq, truth)


def _still_right(client, seq, truth):
    """Nothing changed: the server's lengths are the client's, and an attend is still right."""
    assert list(seq.info().layer_lengths) == [truth.length(seq.key, 0), truth.length(seq.key, 1)]
    q = truth.query()
    truth.check(seq.attend(0, q), q, seq.key, 0)


def _fails(client, method, request, code, *words):
    with pytest.raises(grpc.RpcError) as info:
        getattr(client.stub(client.endpoints[0]), method)(request, timeout=30)
    assert info.value.code() == code, (info.value.code(), info.value.details())
    for word in words:
        assert word.lower() in info.value.details().lower(), info.value.details()
    return info.value


def _t(x):
    return tensors.to_proto_rows(x, "x")


def _rows(n, heads=2, d=64, dtype=np.float16):
    return np.random.default_rng(n).standard_normal((n, heads, d)).astype(dtype)


def test_unknown_ids(setup):
    client, seq, truth = setup
    ghost = "0" * 32
    _fails(client, "Attend", spb.AttendRequest(sequence_id=ghost, layer=0, q=_t(_rows(1, 4))),
           grpc.StatusCode.NOT_FOUND, ghost)
    _fails(client, "Append", spb.AppendRequest(sequence_id="not-hex", rows=[
        spb.LayerKV(layer=0, k=_t(_rows(1)), v=_t(_rows(1)))]), grpc.StatusCode.NOT_FOUND)
    _fails(client, "GetSequenceInfo", spb.GetSequenceInfoRequest(sequence_id=ghost), grpc.StatusCode.NOT_FOUND)
    step = spb.DecodeStepRequest(items=[
        spb.DecodeItem(sequence_id=seq.id, layer=0, q=_t(_rows(1, 4)), k=_t(_rows(1)), v=_t(_rows(1))),
        spb.DecodeItem(sequence_id=ghost, layer=0, q=_t(_rows(1, 4)), k=_t(_rows(1)), v=_t(_rows(1)))])
    error = _fails(client, "DecodeStep", step, grpc.StatusCode.NOT_FOUND, ghost)
    trailing = dict(error.trailing_metadata() or ())
    assert trailing.get("flashserve-missing-sequence-ids") == ghost  # and seq's row was not appended


MALFORMED_IDS = ["bad\nid", "x\x01y", "caf\u00e9" * 8, "A" * 32, "a" * 31, "a" * (1 << 20), " " + "a" * 31]


@pytest.mark.parametrize("bad", MALFORMED_IDS, ids=["newline", "control", "non_ascii", "upper", "short", "1MiB",
                                                    "space"])
def test_malformed_ids_are_not_found_and_never_echoed(setup, kv_server, bad):
    """An id of another shape than the 32 lowercase hex characters the server issues: NOT_FOUND on every method,
    no missing-ids metadata, the message bounded and without the id's bytes. (A newline there went into gRPC's
    trailing metadata and gRPC aborted the server.)"""
    client, seq, _ = setup
    stub = client.stub(client.endpoints[0])
    row = _t(_rows(1))
    requests = {
        "Attend": spb.AttendRequest(sequence_id=bad, layer=0, q=_t(_rows(1, 4))),
        "Append": spb.AppendRequest(sequence_id=bad, rows=[spb.LayerKV(layer=0, k=row, v=row)]),
        "GetSequenceInfo": spb.GetSequenceInfoRequest(sequence_id=bad),
        "DecodeStep": spb.DecodeStepRequest(items=[
            spb.DecodeItem(sequence_id=seq.id, layer=0, q=_t(_rows(1, 4)), k=row, v=row),
            spb.DecodeItem(sequence_id=bad, layer=0, q=_t(_rows(1, 4)), k=row, v=row)]),
    }
    for method, request in requests.items():
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, method)(request, timeout=30)
        error = info.value
        assert error.code() == grpc.StatusCode.NOT_FOUND, (method, error.code(), error.details())
        assert f"a malformed id ({len(bad.encode())} bytes)" in error.details(), (method, error.details())
        assert bad not in error.details() and len(error.details()) < 4200, method
        assert "flashserve-missing-sequence-ids" not in dict(error.trailing_metadata() or ()), method
    # Release lists the well-formed ids it did not find; a malformed one is not echoed there either.
    released = stub.Release(spb.ReleaseRequest(sequence_ids=[bad, "e" * 32]), timeout=30)
    assert released.released == 0 and list(released.not_found) == ["e" * 32]
    assert kv_server.proc.poll() is None, kv_server.logs()


@pytest.mark.parametrize("count", [108, 109, 300])
def test_a_step_missing_many_ids_is_not_found_with_every_default_client(setup, count):
    """A step of many unknown ids (a restarted server: all of them): the list of 33 bytes per id in the trailing
    metadata plus the message had outgrown a default client's 8 KiB of trailers, so the client saw RESOURCE_EXHAUSTED
    and never re-created anything. Up to 108 ids (3,563 bytes) the metadata names them all; past that it is left out (the client
    then re-creates every sequence of the call) and the message still counts them."""
    client, seq, _ = setup
    ghosts = [f"{i:032x}" for i in range(1, count + 1)]
    step = spb.DecodeStepRequest(items=[spb.DecodeItem(sequence_id=g, layer=0, q=_t(_rows(1, 4))) for g in ghosts])
    error = _fails(client, "DecodeStep", step, grpc.StatusCode.NOT_FOUND, f"{count} unknown or evicted")
    listed = dict(error.trailing_metadata() or ()).get("flashserve-missing-sequence-ids")
    assert listed == (",".join(ghosts) if count <= 108 else None), (listed or "")[:80]


def test_a_release_names_at_most_as_many_sequences_as_a_step(setup):
    """Release locks the cache for its whole list: past --max_batch_sequences (1024 here) it is refused whole (the
    sequence it names stays), up to it every unknown id is listed."""
    client, seq, _ = setup
    ghosts = [f"{i:032x}" for i in range(1, 1024)]
    _fails(client, "Release", spb.ReleaseRequest(sequence_ids=[seq.id] + ghosts + ["f" * 32]), INVALID,
           "at most 1024 sequences", "got 1025")
    released = client.stub(client.endpoints[0]).Release(spb.ReleaseRequest(sequence_ids=ghosts + ["f" * 32]),
                                                        timeout=30)
    assert released.released == 0 and list(released.not_found) == ghosts + ["f" * 32]


def test_a_label_cut_mid_character_still_reads_back(kv_server):
    """The label is kept to 128 bytes; cut inside a UTF-8 character, SequenceInfo (a proto3 string) would not parse
    on the client."""
    with flashserve.SequenceClient(kv_server.address, timeout=30, reprefill=False) as client:
        seq = client.create(**SHAPE, label="x" * 127 + "\u00e9tail")
        assert seq.info().label == "x" * 127
        seq.release()


@pytest.mark.parametrize("what", ["heads_kv", "head_dim", "k_v_differ"])
def test_append_with_wrong_shape(setup, what):
    client, seq, _ = setup
    k = {"heads_kv": _rows(2, heads=4), "head_dim": _rows(2, d=32), "k_v_differ": _rows(2)}[what]
    v = _rows(3) if what == "k_v_differ" else k
    _fails(client, "Append", spb.AppendRequest(sequence_id=seq.id, rows=[spb.LayerKV(layer=0, k=_t(k), v=_t(v))]),
           INVALID)


def test_attend_with_wrong_heads_q_or_rows_q(setup):
    client, seq, _ = setup
    _fails(client, "Attend", spb.AttendRequest(sequence_id=seq.id, layer=0, q=_t(_rows(1, heads=2))), INVALID)
    _fails(client, "Attend", spb.AttendRequest(sequence_id=seq.id, layer=0, q=_t(_rows(17, heads=4))), INVALID)
    _fails(client, "Attend", spb.AttendRequest(sequence_id=seq.id, layer=0, q=_t(_rows(1, heads=4)),
                                               softmax_scale=float("nan")), INVALID)


def test_dtype_switch_mid_sequence(setup):
    client, seq, _ = setup
    bf16 = tensors.bfloat16_dtype()
    k = _rows(1).astype(bf16)
    _fails(client, "Append", spb.AppendRequest(sequence_id=seq.id, rows=[spb.LayerKV(layer=0, k=_t(k), v=_t(k))]),
           INVALID, "dtype")
    _fails(client, "Attend", spb.AttendRequest(sequence_id=seq.id, layer=0, q=_t(_rows(1, 4).astype(bf16))),
           INVALID, "dtype")
    step = spb.DecodeStepRequest(items=[spb.DecodeItem(sequence_id=seq.id, layer=0, q=_t(_rows(1, 4)), k=_t(k),
                                                       v=_t(k))])
    _fails(client, "DecodeStep", step, INVALID, "dtype")


def test_append_past_the_token_limit(setup):
    client, seq, truth = setup
    # max_tokens=32 and 10 rows already: 23 more is one too many.
    k = _rows(23)
    _fails(client, "Append", spb.AppendRequest(sequence_id=seq.id, rows=[spb.LayerKV(layer=0, k=_t(k), v=_t(k))]),
           INVALID)
    k, v = truth.rows(22)
    assert seq.append(0, k, v)[0] == 32  # exactly up to the limit works
    truth.add(seq.key, 0, k, v)


def test_layer_out_of_range_and_duplicate_item(setup):
    client, seq, _ = setup
    _fails(client, "Attend", spb.AttendRequest(sequence_id=seq.id, layer=2, q=_t(_rows(1, 4))), INVALID, "layer")
    _fails(client, "Attend", spb.AttendRequest(sequence_id=seq.id, layer=-1, q=_t(_rows(1, 4))), INVALID, "layer")
    item = spb.DecodeItem(sequence_id=seq.id, layer=0, q=_t(_rows(1, 4)), k=_t(_rows(1)), v=_t(_rows(1)))
    _fails(client, "DecodeStep", spb.DecodeStepRequest(items=[item, item]), INVALID)


def test_decode_step_items_with_different_shapes(setup):
    client, seq, _ = setup
    other = client.create(num_layers=1, heads_q=8, heads_kv=2, head_dim=64, dtype="float16")
    step = spb.DecodeStepRequest(items=[
        spb.DecodeItem(sequence_id=seq.id, layer=0, q=_t(_rows(1, 4))),
        spb.DecodeItem(sequence_id=other.id, layer=0, q=_t(_rows(1, 8)))])
    _fails(client, "DecodeStep", step, INVALID)
    other.release()


@pytest.mark.parametrize("field,value", [("dtype", "float32"), ("heads_q", 3), ("num_layers", 0), ("head_dim", 0),
                                         ("max_tokens", 1 << 20), ("heads_kv", 0)])
def test_bad_create(setup, field, value):
    client, _, _ = setup
    request = spb.CreateSequenceRequest(num_layers=1, heads_q=4, heads_kv=2, head_dim=64,
                                        dtype=tensors.PROTO_DTYPE["float16"])
    setattr(request, field, tensors.PROTO_DTYPE[value] if field == "dtype" else value)
    _fails(client, "CreateSequence", request, INVALID)


def test_a_tensor_in_shared_memory_where_a_call_takes_none(setup):
    """CreateSequence's prefix and Append's rows carry their bytes in the message: a shm reference there was read
    as "0 data bytes do not match shape"; it says what is wrong now."""
    from flashserve._pb import attention_pb2 as pb
    client, seq, _ = setup
    in_region = pb.Tensor(dtype=tensors.PROTO_DTYPE["float16"], shape=[2, 2, 64],
                          shm=pb.SharedMemoryRef(region="r", offset=0, byte_size=2 * 2 * 64 * 2))
    create = spb.CreateSequenceRequest(num_layers=1, heads_q=4, heads_kv=2, head_dim=64,
                                       dtype=tensors.PROTO_DTYPE["float16"],
                                       prefix=[spb.LayerKV(layer=0, k=in_region, v=_t(_rows(2)))])
    _fails(client, "CreateSequence", create, INVALID, "k.shm: shared memory is not supported in this call")
    append = spb.AppendRequest(sequence_id=seq.id, rows=[spb.LayerKV(layer=0, k=_t(_rows(2)), v=in_region)])
    _fails(client, "Append", append, INVALID, "v.shm: shared memory is not supported in this call")


def test_prefix_with_two_entries_for_one_layer(setup):
    client, _, _ = setup
    layer_kv = spb.LayerKV(layer=0, k=_t(_rows(2)), v=_t(_rows(2)))
    request = spb.CreateSequenceRequest(num_layers=1, heads_q=4, heads_kv=2, head_dim=64,
                                        dtype=tensors.PROTO_DTYPE["float16"], prefix=[layer_kv, layer_kv])
    _fails(client, "CreateSequence", request, INVALID)


def test_server_without_kv_cache_says_failed_precondition(start_server):
    server = start_server("--kv_cache_bytes=0", name="no_kv")
    with flashserve.SequenceClient(server.address, timeout=30) as client:
        with pytest.raises(flashserve.FlashserveError) as info:
            client.create(**SHAPE)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "kv_cache_bytes" in info.value.message
