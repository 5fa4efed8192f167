"""Truncate on the real server (CPU and, where a GPU is, CUDA KV stores): speculative decoding appends draft tokens
with a causal multi-row step, keeps the accepted ones and cuts the rest; every later answer matches the fp64 reference
over exactly the kept rows, also after the server lost the sequence and the client re-created it from its history.
Retries cut nothing more; refused calls cut nothing; pages past the cut go back to the pool."""

from __future__ import annotations

import grpc
import pytest

import flashserve
from conftest import ServerProcess, _stop_and_check
from flashserve import sequences_pb2 as spb
from flashserve import sequences_pb2_grpc as spb_grpc
from metrics_helpers import scrape
from sequences_truth import Truth
from test_gpu_e2e import _gpu_present

pytestmark = pytest.mark.e2e
SHAPE = dict(num_layers=2, heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16")
PAGE_TOKENS = 16


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def trunc_server(request, flashserve_bin, tmp_path_factory):
    """Both KV stores: the CUDA one defers its rows to the launch's stream and must not let them land on freed pages."""
    if request.param == "cuda" and not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): the CUDA KV store's run is skipped")
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("seq_truncate"),
                      [f"--backend={request.param}", "--kv_cache_bytes=67108864",
                       f"--kv_page_tokens={PAGE_TOKENS}"], name=f"seq_truncate_{request.param}").start()
    yield s
    _stop_and_check(s)


@pytest.fixture
def stub(trunc_server):
    with grpc.insecure_channel(trunc_server.address) as channel:
        yield spb_grpc.SequencesStub(channel)


def _truth(rng):
    return Truth(rng, SHAPE["heads_q"], SHAPE["heads_kv"], SHAPE["head_dim"], SHAPE["dtype"])


def _create(client, truth, rows, layers=(0, 1)):
    prefix = {layer: truth.rows(rows) for layer in layers}
    seq = client.create(**SHAPE, prefix=prefix)
    for layer, (k, v) in prefix.items():
        truth.add(seq.key, layer, k, v)
    return seq


def _verify_drafts(client, seqs, truth, drafts):
    """One speculative step per layer: `drafts` new rows per sequence appended, their causal queries checked."""
    for layer in range(SHAPE["num_layers"]):
        qs = [truth.query(drafts) for _ in seqs]
        kvs = [truth.rows(drafts) for _ in seqs]
        outs = client.decode_step([(s, layer, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)], causal=True)
        for seq, q, (k, v), out in zip(seqs, qs, kvs, outs):
            truth.add(seq.key, layer, k, v)
            truth.check(out, q, seq.key, layer, causal=True)


def _metric(server, name, **labels):
    return scrape(f"http://127.0.0.1:{server.metrics_port}/metrics").value(name, **labels)


def test_speculative_decoding_keeps_only_the_accepted_drafts(trunc_server, rng):
    truth = _truth(rng)
    before = _metric(trunc_server, "flashserve_kv_truncated_tokens_total")
    dropped = 0
    with flashserve.SequenceClient(trunc_server.address, timeout=60) as client:
        seqs = [_create(client, truth, 21 + 9 * i) for i in range(3)]
        for _ in range(6):
            drafts = int(rng.integers(2, 7))
            start = [s.lengths[0] for s in seqs]
            _verify_drafts(client, seqs, truth, drafts)
            accepted = [int(rng.integers(0, drafts + 1)) for _ in seqs]
            kept = [n + a for n, a in zip(start, accepted)]
            # One call for the batch (the third sequence keeps every draft: named anyway, cut nothing).
            assert client.truncate_many([(s, n, None) for s, n in zip(seqs, kept)]) == [[n, n] for n in kept]
            dropped += sum(2 * (drafts - a) for a in accepted)
            for seq, n in zip(seqs, kept):
                for layer in range(2):
                    truth.keep(seq.key, layer, n)
                assert list(seq.info().layer_lengths) == seq.lengths
        _verify_drafts(client, seqs, truth, 1)  # plain decode steps over the kept rows
        # To zero: every page goes back (and the layers then start over).
        held = sum(seqs[0].lengths)
        assert seqs[0].truncate(0) == [0, 0] and seqs[0].info().bytes == 0
        dropped += held
        for layer in range(2):
            truth.keep(seqs[0].key, layer, 0)
        _verify_drafts(client, seqs, truth, 3)
        assert client.stats["reprefills"] == 0
    assert _metric(trunc_server, "flashserve_kv_truncated_tokens_total") == before + dropped


def test_an_empty_list_of_layers_cuts_nothing(trunc_server, rng):
    """layers=[] (a speculative loop whose list of layers to cut came out empty) cuts nothing, on the client and on the
    server: the request's empty layers field means "every layer" to the server, which cut them all while the client's
    history kept them (its later answers went wrong, its next append ABORTED)."""
    truth = _truth(rng)
    with flashserve.SequenceClient(trunc_server.address, timeout=60) as client:
        seqs = [_create(client, truth, 9), _create(client, truth, 12)]
        assert seqs[0].truncate(2, layers=[]) == [9, 9]
        assert client.truncate_many([(seqs[0], 3, []), (seqs[1], 4, [1])]) == [[9, 9], [12, 4]]
        truth.keep(seqs[1].key, 1, 4)
        for seq in seqs:
            assert list(seq.info().layer_lengths) == seq.lengths
        _verify_drafts(client, seqs, truth, 2)  # answers over exactly what each layer holds
        assert client.stats["reprefills"] == 0


def test_a_lost_sequence_comes_back_without_the_cut_rows(trunc_server, stub, rng):
    """The client's history keeps only what the server kept: a re-created sequence holds the kept rows, not the
    rejected drafts (which would change every later answer)."""
    truth = _truth(rng)
    with flashserve.SequenceClient(trunc_server.address, timeout=60) as client:
        seq = _create(client, truth, 30)
        _verify_drafts(client, [seq], truth, 5)
        assert seq.truncate(32, layers=[0]) == [32, 35]  # layer 0 keeps 2 drafts, layer 1 all 5
        truth.keep(seq.key, 0, 32)
        assert seq.history_bytes == (32 + 35) * 2 * (2 * 64 * 2)  # rows x (K, V) x bytes per row
        stub.Release(spb.ReleaseRequest(sequence_ids=[seq.id]), timeout=30)  # as an eviction or a restart would
        _verify_drafts(client, [seq], truth, 1)
        assert seq.reprefills == 1 and seq.lengths == [33, 36]


def test_retries_cut_nothing_more_and_refused_calls_cut_nothing(trunc_server, stub, rng):
    truth = _truth(rng)
    refused = _metric(trunc_server, "flashserve_kv_refusals_total", reason="length_mismatch")
    not_found = _metric(trunc_server, "flashserve_kv_refusals_total", reason="not_found")
    with flashserve.SequenceClient(trunc_server.address, timeout=60, reprefill=False) as client:
        seq = _create(client, truth, 40, layers=(0,))  # layer 0: 3 pages of 16; layer 1 empty
        bytes_40 = seq.info().bytes

        def truncate(length, layers=()):
            request = spb.TruncateRequest()
            request.items.add(sequence_id=seq.id, length=length, layers=layers)
            response = stub.Truncate(request, timeout=30)
            assert len(response.results) == 1
            return response.results[0]

        first = truncate(20, [0])
        assert list(first.layer_lengths) == [20, 0] and first.dropped_tokens == 20
        assert seq.info().bytes == bytes_40 * 2 // 3  # the third page went back
        again = truncate(20, [0])  # its answer was lost: sent again
        assert list(again.layer_lengths) == [20, 0] and again.dropped_tokens == 0
        with pytest.raises(grpc.RpcError) as aborted:
            truncate(10)  # every layer: layer 1 holds 0 < 10
        assert aborted.value.code() == grpc.StatusCode.ABORTED
        assert "layer 1 holds 0 tokens, fewer than the 10" in aborted.value.details()
        for length, layers in ((-1, []), (5, [2]), (5, [0, 0])):
            with pytest.raises(grpc.RpcError) as bad:
                truncate(length, layers)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (length, layers)
        for unknown in ("0" * 32, "not-an-id"):
            request = spb.TruncateRequest()
            request.items.add(sequence_id=seq.id, length=20)
            request.items.add(sequence_id=unknown, length=0)
            with pytest.raises(grpc.RpcError) as missing:
                stub.Truncate(request, timeout=30)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            shown = dict(missing.value.trailing_metadata() or ()).get("flashserve-missing-sequence-ids", "")
            assert shown == ("0" * 32 if unknown == "0" * 32 else "")  # a malformed id is never echoed
        too_many = spb.TruncateRequest()
        for _ in range(1025):  # --max_batch_sequences 1024
            too_many.items.add(sequence_id=seq.id, length=20)
        with pytest.raises(grpc.RpcError) as bad:
            stub.Truncate(too_many, timeout=30)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1024" in bad.value.details()
        assert list(seq.info().layer_lengths) == [20, 0]
        assert _metric(trunc_server, "flashserve_kv_refusals_total", reason="length_mismatch") == refused + 1
        assert _metric(trunc_server, "flashserve_kv_refusals_total", reason="not_found") == not_found + 2
        # The client checks what it can before sending.
        with pytest.raises(flashserve.InvalidArgumentError):
            seq.truncate(-1)
        with pytest.raises(flashserve.InvalidArgumentError):
            seq.truncate(5, layers=[2])
        # The rows kept are intact: an attend over layer 0 sees exactly its first 20 rows.
        truth.keep(seq.key, 0, 20)
        q = truth.query(3)
        truth.check(seq.attend(0, q, causal=True), q, seq.key, 0, causal=True)


def test_without_a_kv_cache_truncate_is_failed_precondition(server):
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            spb_grpc.SequencesStub(channel).Truncate(spb.TruncateRequest(), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
