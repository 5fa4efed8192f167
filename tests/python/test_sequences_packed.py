"""DecodeStep with packed tensors (DecodeStepRequest.packed; CPU backend, the real binary): every item's q/k/v rows
back to back in one tensor each -- inline, or in a system region with O and LSE written back packed -- over gRPC and
the local socket, against the fp64 reference over many steps with uneven row counts; a refused packed step appends
nothing."""

from __future__ import annotations

import os
import shutil
import tempfile

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import sequences_pb2 as spb
from flashserve import tensors
from flashserve.local import DECODE_STEP, LocalClient
from conftest import ServerProcess, _stop_and_check
from sequences_truth import Truth
from test_sequences_shm import Region, _shm_tensor

pytestmark = pytest.mark.e2e
SHAPE = dict(heads_q=4, heads_kv=2, head_dim=64)

if spb is None or "packed" not in spb.DecodeStepRequest.DESCRIPTOR.fields_by_name:
    pytest.skip("the imported flashserve client predates DecodeStepRequest.packed (PYTHONPATH=client/python of this "
                "tree)", allow_module_level=True)


@pytest.fixture(scope="module")
def packed_server(flashserve_bin, tmp_path_factory):
    path = os.path.join(tempfile.mkdtemp(prefix="fsp", dir="/tmp"), "fs.sock")  # sun_path: at most 107 bytes
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("kv_packed"),
                      ["--kv_cache_bytes=33554432", "--kv_page_tokens=16", "--allow_client_shm",
                       f"--local_socket={path}"], name="kv_packed").start()
    s.local_path = path
    yield s
    _stop_and_check(s)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _packed_request(seqs, qs, kvs, region, return_lse, answer_packed=False, lse_in_region=True):
    """One packed step; with `region`, q/k/v are read from it and O (and LSE with lse_in_region) written into it;
    answer_packed: what travels in the answer comes as one tensor each (DecodeStepResponse.packed)."""
    q, k, v = (np.concatenate(x) for x in (qs, [kv[0] for kv in kvs], [kv[1] for kv in kvs]))
    request = spb.DecodeStepRequest(return_lse=return_lse)
    for seq in seqs:
        request.items.add(sequence_id=seq.id, layer=0)
    p = request.packed
    p.rows_q.extend(len(x) for x in qs)
    p.rows_kv.extend(len(kv[0]) for kv in kvs)
    p.answer_packed = answer_packed
    for field, x in (("q", q), ("k", k), ("v", v)):
        t = _shm_tensor(x, region.put(x)) if region is not None else tensors.to_proto_rows(x, field)
        getattr(p, field).CopyFrom(t)
    if region is not None:
        p.out_shm.CopyFrom(region.reserve(q.nbytes))
        if return_lse and lse_in_region:
            p.lse_shm.CopyFrom(region.reserve(4 * q.shape[0] * q.shape[1]))
    return request


def _outputs(response, request, qs, region, dtype):
    """Each item's (out, lse or None), from its result, from the packed answer, or from the packed places in the
    region."""
    ndt, heads = tensors.numpy_dtype(dtype), qs[0].shape[1]
    p, found, first_q, first_lse = request.packed, [], 0, 0
    out_packed = p.answer_packed and not p.HasField("out_shm")
    lse_packed = p.answer_packed and request.return_lse and not p.HasField("lse_shm")
    answer = response.packed
    assert response.HasField("packed") == (out_packed or lse_packed)
    assert answer.HasField("out") == out_packed and answer.HasField("lse") == lse_packed
    if out_packed:
        assert list(answer.out.shape) == [sum(len(q) for q in qs), heads, qs[0].shape[2]]
        assert answer.out.dtype == tensors.PROTO_DTYPE[dtype]
    if lse_packed:
        assert list(answer.lse.shape) == [heads * sum(len(q) for q in qs)] and answer.lse.dtype == tensors.PROTO_DTYPE["float32"]
    packed_out = np.frombuffer(answer.out.data, ndt).reshape(-1, heads, qs[0].shape[2])
    packed_lse = np.frombuffer(answer.lse.data, np.float32)
    for q, result in zip(qs, response.results):
        rows, lse = len(q), None
        assert result.HasField("out") != out_packed
        assert result.HasField("lse") == (request.return_lse and not lse_packed)  # no empty LSE when none asked
        if lse_packed:
            lse = packed_lse[first_lse:first_lse + heads * rows].reshape(heads, rows)
        if out_packed:
            out = packed_out[first_q:first_q + rows]
        elif not p.HasField("out_shm"):
            out = np.frombuffer(result.out.data, ndt).reshape(q.shape)
            if request.return_lse and not lse_packed:
                lse = np.frombuffer(result.lse.data, np.float32).reshape(heads, rows)
        else:
            assert result.out.data == b"" and list(result.out.shape) == list(q.shape)
            out = region.read(type(p.out_shm)(region=region.name, offset=p.out_shm.offset + first_q * q[0].nbytes,
                                              byte_size=q.nbytes), ndt, q.shape)
            if request.return_lse and not lse_packed:
                ref = type(p.lse_shm)(region=region.name, offset=p.lse_shm.offset + 4 * first_lse,
                                      byte_size=4 * heads * rows)
                lse = region.read(ref, np.float32, (heads, rows))
        found.append((out, lse))
        first_q, first_lse = first_q + rows, first_lse + heads * rows
    return found


@pytest.mark.parametrize("transport", ["grpc", "local"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_packed_steps_match_reference(packed_server, rng, transport, dtype):
    run_packed_steps(packed_server, rng, dtype, packed_server.local_path if transport == "local" else None)


def run_packed_steps(server, rng, dtype, local_path=None, shape=SHAPE, prefixes=(1, 17, 40, 5), steps=8):
    """Packed DecodeSteps (inline on even steps, through a system region on odd ones; uneven rows, some items
    attend only; from step 2 on every other pair of steps with the answer packed, and on step 7 the LSE in it while
    O goes into the region) over gRPC or, with local_path, the local socket; every O (and LSE on most steps) against
    the fp64 reference. Also used by test_sequences_gpu.py (CUDA backend)."""
    truth = Truth(rng, **shape, dtype=dtype)
    region = Region(server, f"packed-{'local' if local_path else 'grpc'}-{dtype}", 4 << 20)
    local = LocalClient(local_path, timeout=30) if local_path else None
    try:
        with flashserve.SequenceClient(server.address, timeout=60, reprefill=False) as client:
            seqs = truth.create(client, prefixes)
            stub = client.stub(client.endpoints[0])
            for step in range(steps):
                region.reset()
                rows_q = [1 + (step + i) % 3 for i in range(len(seqs))]
                rows_kv = [0 if (step + i) % 4 == 3 else r for i, r in enumerate(rows_q)]  # some attend only
                qs = [truth.query(r) for r in rows_q]
                kvs = [truth.rows(r) for r in rows_kv]
                request = _packed_request(seqs, qs, kvs, region if step % 2 else None, return_lse=step % 3 != 0,
                                          answer_packed=step % 4 >= 2, lse_in_region=step != 7)
                response = local.decode_step(request) if local else stub.DecodeStep(request, timeout=60)
                for seq, q, (k, v), result, (out, lse) in zip(seqs, qs, kvs, response.results,
                                                              _outputs(response, request, qs, region, dtype)):
                    truth.add(seq.key, 0, k, v)
                    assert result.length == truth.length(seq.key, 0)
                    assert not np.isnan(out.astype(np.float32)).any()
                    truth.check(out, q, seq.key, 0, lse=lse)
    finally:
        if local is not None:
            local.close()
        region.close()


def test_refused_packed_step_appends_nothing(packed_server, rng):
    truth = Truth(rng, **SHAPE, dtype="bfloat16")
    with flashserve.SequenceClient(packed_server.address, timeout=30, reprefill=False) as client:
        k, v = truth.rows(9)
        seq = client.create(num_layers=1, **SHAPE, dtype="bfloat16", prefix={0: (k, v)})
        truth.add(seq.key, 0, k, v)
        stub = client.stub(client.endpoints[0])
        q, kv = truth.query(2), truth.rows(2)
        request = _packed_request([seq], [q], [kv], None, return_lse=False)
        request.packed.rows_kv[0] = 1  # the counts no longer add up to k's rows
        with pytest.raises(grpc.RpcError) as info:
            stub.DecodeStep(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "packed.k has 2 rows" in info.value.details(), info.value.details()
        request.packed.rows_kv[0] = 2
        request.items[0].q.CopyFrom(request.packed.q)  # an item with tensors of its own
        with pytest.raises(grpc.RpcError) as info:
            stub.DecodeStep(request, timeout=30)
        assert "items carry only" in info.value.details(), info.value.details()
        request.items[0].ClearField("q")
        response = stub.DecodeStep(request, timeout=30)  # the same step, now valid: 9 + 2 rows, not more
        truth.add(seq.key, 0, *kv)
        assert response.results[0].length == 11 == truth.length(seq.key, 0)
        out = np.frombuffer(response.results[0].out.data, tensors.numpy_dtype("bfloat16")).reshape(q.shape)
        truth.check(out, q, seq.key, 0)


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_packed_answer_comes_first_and_is_read_in_place(packed_server, rng, transport):
    """The server writes a packed answer (answer_packed) before the results, so the client's parse
    (_step_answer.DecodeStepAnswer) gives O and LSE as views of the answer's bytes; they match the message's."""
    from flashserve._step_answer import DecodeStepAnswer

    truth = Truth(rng, **SHAPE, dtype="float16")
    local = LocalClient(packed_server.local_path, timeout=30) if transport == "local" else None
    try:
        with flashserve.SequenceClient(packed_server.address, timeout=30, reprefill=False) as client:
            seqs = truth.create(client, (3, 30, 1))
            qs, kvs = [truth.query(2) for _ in seqs], [truth.rows(2) for _ in seqs]
            request = _packed_request(seqs, qs, kvs, None, return_lse=True, answer_packed=True)
            wire = request.SerializeToString()
            raw = (local.call(DECODE_STEP, wire) if local is not None else
                   client._channel(packed_server.address)[0].unary_unary(
                       "/flashserve.v1.Sequences/DecodeStep", request_serializer=None,
                       response_deserializer=None)(wire, timeout=30))
            assert raw[0] == 5 << 3 | 2, "the packed answer first"
            answer = DecodeStepAnswer.parse(raw)
            assert isinstance(answer.out.data, memoryview) and isinstance(answer.lse.data, memoryview)
            whole = spb.DecodeStepResponse.FromString(raw)
            assert bytes(answer.out.data) == whole.packed.out.data and bytes(answer.lse.data) == whole.packed.lse.data
            assert [r.length for r in answer.response.results] == [r.length for r in whole.results]
            for seq, q, (k, v), (out, lse) in zip(seqs, qs, kvs, _outputs(whole, request, qs, None, "float16")):
                truth.add(seq.key, 0, k, v)
                truth.check(out, q, seq.key, 0, lse=lse)
    finally:
        if local is not None:
            local.close()
