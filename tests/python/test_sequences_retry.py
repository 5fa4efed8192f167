"""expected_length on the real server (CPU backend): an Append or DecodeStep sent again after its answer was lost
appends its rows once and answers as the first try would have; a length the client did not expect is ABORTED with
nothing appended; and the client, behind a connection that drops a step's answer, retries to the right answer."""

from __future__ import annotations

import os
import shutil
import tempfile

import grpc
import numpy as np
import pytest

import flashserve
from conftest import ServerProcess, _stop_and_check
from flashserve import local as local_socket
from flashserve import sequences_pb2 as spb
from flashserve import sequences_pb2_grpc as spb_grpc
from flashserve import tensors
from metrics_helpers import scrape
from sequences_truth import Truth
from tcp_proxy import AnswerCutter
from test_gpu_e2e import _gpu_present

pytestmark = pytest.mark.e2e
SHAPE = dict(num_layers=2, heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16")


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def retry_server(request, flashserve_bin, tmp_path_factory):
    """The same tests on both KV stores (the CUDA one defers its rows to the launch's stream)."""
    if request.param == "cuda" and not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): the CUDA KV store's run is skipped")
    path = os.path.join(tempfile.mkdtemp(prefix="fsr", dir="/tmp"), "fs.sock")
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("seq_retry"),
                      [f"--backend={request.param}", "--kv_cache_bytes=67108864", "--kv_page_tokens=16",
                       f"--local_socket={path}"], name=f"seq_retry_{request.param}").start()
    s.local_path = path
    yield s
    _stop_and_check(s)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@pytest.fixture
def stub(retry_server):
    with grpc.insecure_channel(retry_server.address) as channel:
        yield spb_grpc.SequencesStub(channel)


def _truth(rng):
    return Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])


def _create(stub, truth, key, rows):
    k, v = truth.rows(rows)
    request = spb.CreateSequenceRequest(num_layers=2, heads_q=8, heads_kv=2, head_dim=64,
                                        dtype=tensors.PROTO_DTYPE["bfloat16"])
    request.prefix.add(layer=0, k=tensors.to_proto_rows(k, "k"), v=tensors.to_proto_rows(v, "v"))
    truth.add(key, 0, k, v)
    return stub.CreateSequence(request, timeout=30).sequence_id


def _lengths(stub, sequence_id):
    return list(stub.GetSequenceInfo(spb.GetSequenceInfoRequest(sequence_id=sequence_id), timeout=30).layer_lengths)


def _metric(server, name, **labels):
    return scrape(f"http://127.0.0.1:{server.metrics_port}/metrics").value(name, **labels)


def _step_request(truth, ids, expected, packed):
    """One new row per sequence (layer 0), each naming the length it follows; returns (request, qs, kvs)."""
    qs = [truth.query() for _ in ids]
    kvs = [truth.rows(1) for _ in ids]
    request = spb.DecodeStepRequest()
    for sid, n, q, (k, v) in zip(ids, expected, qs, kvs):
        item = request.items.add(sequence_id=sid, layer=0, expected_length=n)
        if not packed:
            item.q.CopyFrom(tensors.to_proto_rows(q, "q"))
            item.k.CopyFrom(tensors.to_proto_rows(k, "k"))
            item.v.CopyFrom(tensors.to_proto_rows(v, "v"))
    if packed:
        request.packed.q.CopyFrom(tensors.to_proto_rows(np.concatenate(qs), "q"))
        request.packed.k.CopyFrom(tensors.to_proto_rows(np.concatenate([k for k, _ in kvs]), "k"))
        request.packed.v.CopyFrom(tensors.to_proto_rows(np.concatenate([v for _, v in kvs]), "v"))
    return request, qs, kvs


@pytest.mark.parametrize("transport", ["grpc", "grpc-packed", "local"])
def test_a_step_sent_twice_appends_once_and_answers_the_same(retry_server, stub, rng, transport):
    truth = _truth(rng)
    ids = [_create(stub, truth, i, 5 + 3 * i) for i in range(3)]
    request, qs, kvs = _step_request(truth, ids, [5, 8, 11], packed=transport == "grpc-packed")
    if transport == "local":
        with local_socket.LocalClient(retry_server.local_path, timeout=30) as client:
            first, again = client.decode_step(request), client.decode_step(request)
    else:
        first, again = stub.DecodeStep(request, timeout=30), stub.DecodeStep(request, timeout=30)
    for i, sid in enumerate(ids):
        truth.add(i, 0, *kvs[i])
        assert not first.results[i].already_appended and again.results[i].already_appended
        assert first.results[i].length == again.results[i].length == 6 + 3 * i
        for answer in (first, again):
            truth.check(tensors.from_proto(answer.results[i].out), qs[i], i, 0)
        assert _lengths(stub, sid) == [6 + 3 * i, 0]


def test_an_append_sent_twice_appends_once(retry_server, stub, rng):
    truth = _truth(rng)
    sid = _create(stub, truth, "a", 4)
    before = _metric(retry_server, "flashserve_kv_already_appended_total")
    k0, v0 = truth.rows(3)
    k1, v1 = truth.rows(2)
    request = spb.AppendRequest(sequence_id=sid)
    request.rows.add(layer=0, k=tensors.to_proto_rows(k0, "k"), v=tensors.to_proto_rows(v0, "v"), expected_length=4)
    request.rows.add(layer=1, k=tensors.to_proto_rows(k1, "k"), v=tensors.to_proto_rows(v1, "v"), expected_length=0)
    first, again = stub.Append(request, timeout=30), stub.Append(request, timeout=30)
    assert list(first.layer_lengths) == list(again.layer_lengths) == [7, 2]
    assert list(first.already_appended_layers) == [] and list(again.already_appended_layers) == [0, 1]
    assert _metric(retry_server, "flashserve_kv_already_appended_total") == before + 2
    truth.add("a", 0, k0, v0)
    q = truth.query()
    answer = stub.Attend(spb.AttendRequest(sequence_id=sid, layer=0, q=tensors.to_proto_rows(q, "q")), timeout=30)
    truth.check(tensors.from_proto(answer.out), q, "a", 0)


def test_an_unexpected_length_is_aborted_and_changes_nothing(retry_server, stub, rng):
    truth = _truth(rng)
    ids = [_create(stub, truth, i, 6) for i in range(2)]
    before = _metric(retry_server, "flashserve_kv_refusals_total", reason="length_mismatch")
    # Item 0 is right; item 1 names 5 where the layer holds 6 (and 5 + 1 is no earlier try either).
    request, _, _ = _step_request(truth, ids, [6, 4], packed=False)
    with pytest.raises(grpc.RpcError) as info:
        stub.DecodeStep(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "item 1: layer 0 holds 6 tokens but the call expected 4" in info.value.details()
    assert [_lengths(stub, sid) for sid in ids] == [[6, 0], [6, 0]]
    append = spb.AppendRequest(sequence_id=ids[0])
    k, v = truth.rows(2)
    append.rows.add(layer=0, k=tensors.to_proto_rows(k, "k"), v=tensors.to_proto_rows(v, "v"), expected_length=5)
    with pytest.raises(grpc.RpcError) as info:
        stub.Append(append, timeout=30)
    assert info.value.code() == grpc.StatusCode.ABORTED and "holds 6 tokens" in info.value.details()
    assert _metric(retry_server, "flashserve_kv_refusals_total", reason="length_mismatch") == before + 2


def test_bad_expected_lengths_are_invalid(retry_server, stub, rng):
    truth = _truth(rng)
    sid = _create(stub, truth, "x", 2)
    request, _, _ = _step_request(truth, [sid], [-1], packed=True)
    with pytest.raises(grpc.RpcError) as info:
        stub.DecodeStep(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "item 0: expected_length must be >= 0" in info.value.details()
    k, v = truth.rows(1)
    create = spb.CreateSequenceRequest(num_layers=1, heads_q=8, heads_kv=2, head_dim=64,
                                       dtype=tensors.PROTO_DTYPE["bfloat16"])
    create.prefix.add(layer=0, k=tensors.to_proto_rows(k, "k"), v=tensors.to_proto_rows(v, "v"), expected_length=0)
    with pytest.raises(grpc.RpcError) as info:
        stub.CreateSequence(create, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefix" in info.value.details()
    assert _lengths(stub, sid) == [2, 0]


def test_client_behind_a_dropped_answer_retries_to_the_right_answer(retry_server, rng):
    """The step ran and appended; its answer never reached the client (UNAVAILABLE). The client retries through its
    one endpoint; the server finds the rows there (expected_length) and answers without appending them twice."""
    truth = _truth(rng)
    proxy = AnswerCutter(port=int(retry_server.address.rsplit(":", 1)[1]))
    try:
        with flashserve.SequenceClient(proxy.address, timeout=30) as client:
            seqs = []
            for i in range(4):
                k, v = truth.rows(9 + i)
                seqs.append(client.create(**SHAPE, prefix={0: (k, v)}, key=f"s{i}"))
                truth.add(f"s{i}", 0, k, v)
            for step in range(3):
                qs = [truth.query(16) for _ in seqs]  # O of 4 x 16 rows x 8 heads x 64 x 2 B = 128 KiB
                kvs = [truth.rows(2) for _ in seqs]
                if step == 1:
                    proxy.cut_next_answer(at_headers=True)  # the step ran; its answer is lost from its first frame
                outs = client.decode_step([(s, 0, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)], causal=True)
                for i, (seq, q, out) in enumerate(zip(seqs, qs, outs)):
                    truth.add(f"s{i}", 0, *kvs[i])
                    truth.check(out, q, f"s{i}", 0, causal=True)
                    assert seq.info().layer_lengths[0] == truth.length(f"s{i}", 0)
            assert proxy.cut == 1
            assert client.stats["already_appended"] == 4 and client.stats["reprefills"] == 0
    finally:
        proxy.close()
