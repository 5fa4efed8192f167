"""flashserve.v1.Sequences end to end on the CPU backend (the real binary), against the fp64 reference: many decode
steps, eviction (TTL) and re-prefill, concurrent clients on disjoint and shared sequences, pool exhaustion, release,
restart, the bearer token. Bad inputs: test_sequences_e2e_bad_input.py; three servers: test_sequences_e2e_ring.py."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

import flashserve
import conftest
from conftest import ServerProcess, _stop_and_check, zip_all
from metrics_helpers import scrape
from sequences_truth import Truth

pytestmark = pytest.mark.e2e
KV_FLAGS = ("--kv_cache_bytes=67108864", "--kv_page_tokens=16")
LLAMA_LIKE = dict(heads_q=8, heads_kv=2, head_dim=128)  # GQA 4:1 like Llama-3, fewer heads for a CPU


@pytest.fixture(scope="module")
def kv_server(flashserve_bin, tmp_path_factory):
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("kv_server"), list(KV_FLAGS), name="kv").start()
    yield s
    _stop_and_check(s)


@pytest.fixture(scope="module")
def batching_server(flashserve_bin, tmp_path_factory):
    """DecodeStep calls arriving within 3 ms run as one launch."""
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("kv_batching"),
                      list(KV_FLAGS) + ["--batch_window_us=3000"], name="kv_batching").start()
    yield s
    _stop_and_check(s)


def _server(request, kind):
    return request.getfixturevalue("batching_server" if kind == "batching" else "kv_server")


def _shape(num_layers, dtype, heads_q=8, heads_kv=2, head_dim=128):
    return dict(num_layers=num_layers, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype)


def _create(client, truth, shape, prefix_rows, key=None, layers=None, **kw):
    prefix = {layer: truth.rows(prefix_rows) for layer in (layers if layers is not None else [0])}
    seq = client.create(**shape, prefix=prefix, key=key, **kw)
    for layer, (k, v) in prefix.items():
        truth.add(seq.key, layer, k, v)
    return seq


def _steps(client, seqs, truth, n, layer=0, rows_q=1, causal=False, return_lse=False):
    """n DecodeSteps over seqs (one new row each), every answer checked against the fp64 reference."""
    for _ in range(n):
        qs = [truth.query(rows_q) for _ in seqs]
        kvs = [truth.rows(rows_q) for _ in seqs]
        answers = client.decode_step([(s, layer, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)], causal=causal,
                                     return_lse=return_lse)
        for seq, q, (k, v), answer in zip_all(seqs, qs, kvs, answers):
            truth.add(seq.key, layer, k, v)
            out, lse = answer if return_lse else (answer, None)
            truth.check(out, q, seq.key, layer, causal=causal, lse=lse)
            assert seq.lengths[layer] == truth.length(seq.key, layer)


@pytest.mark.parametrize("dtype,head_dim", [("float16", 128), ("bfloat16", 64), ("bfloat16", 128)])
def test_many_decode_steps_match_reference(kv_server, rng, dtype, head_dim):
    truth = Truth(rng, 8, 2, head_dim, dtype)
    with flashserve.SequenceClient(kv_server.address, timeout=60) as client:
        seqs = [_create(client, truth, _shape(2, dtype, head_dim=head_dim), 13 + 7 * i, layers=[0, 1])
                for i in range(4)]
        _steps(client, seqs, truth, 40, layer=0, return_lse=True)  # crosses pages of 16 tokens
        _steps(client, seqs, truth, 5, layer=1)
        assert client.stats["reprefills"] == 0
        for seq in seqs:
            seq.release()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_decode_step_batch_matches_reference(kv_server, rng, kind):
    """decode_step_batch on the server: the batch's q/k/v as one tensor each (numpy or torch), O and LSE as one."""
    if kind == "torch":
        torch = pytest.importorskip("torch", reason="torch is not installed: the torch form of the batch is skipped")
    truth = Truth(rng, 8, 2, 64, "bfloat16")
    with flashserve.SequenceClient(kv_server.address, timeout=60) as client:
        seqs = [_create(client, truth, _shape(1, "bfloat16", head_dim=64), 20 + 3 * i) for i in range(6)]
        for rows_q in (1, 4, 1):
            q = np.concatenate([truth.query(rows_q) for _ in seqs])
            k, v = (np.concatenate(x) for x in zip(*[truth.rows(rows_q) for _ in seqs]))
            args = (q, k, v) if kind == "numpy" else tuple(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
                                                            for x in (q, k, v))
            out, lse = client.decode_step_batch(seqs, 0, *args, causal=True, return_lse=True)
            assert tuple(out.shape) == q.shape and tuple(lse.shape) == (len(seqs), 8, rows_q)
            if kind == "torch":
                out, lse = out.view(torch.int16).numpy().view(q.dtype), lse.numpy()
            for i, seq in enumerate(seqs):
                block = slice(i * rows_q, (i + 1) * rows_q)
                truth.add(seq.key, 0, k[block], v[block])
                truth.check(out[block], q[block], seq.key, 0, causal=True, lse=lse[i])


def test_append_then_attend_causal_multi_row(kv_server, rng):
    truth = Truth(rng, 4, 4, 64, "float16")
    with flashserve.SequenceClient(kv_server.address, timeout=60) as client:
        with _create(client, truth, _shape(3, "float16", 4, 4, 64), 0, layers=[]) as seq:
            for step in range(12):
                layer = step % 3
                k, v = truth.rows(1 + step % 5)
                assert seq.append(layer, k, v)[layer] == truth.length(seq.key, layer) + len(k)
                truth.add(seq.key, layer, k, v)
                q = truth.query(min(len(k), 4))
                out, lse = seq.attend(layer, q, causal=True, return_lse=True)
                truth.check(out, q, seq.key, layer, causal=True, lse=lse)


def test_eviction_after_ttl_then_reprefill(start_server, rng):
    server = start_server(*KV_FLAGS, "--sequence_ttl_s=1", name="ttl")
    truth = Truth(rng, 8, 2, 128, "bfloat16")
    shape = _shape(1, "bfloat16")
    with flashserve.SequenceClient(server.address, timeout=60) as client, \
            flashserve.SequenceClient(server.address, timeout=60, reprefill=False) as plain:
        seqs = [_create(client, truth, shape, 20, key=f"k{i}") for i in range(3)]
        watched = plain.create(**shape)
        _steps(client, seqs, truth, 3)
        time.sleep(3.0)  # idle past the TTL (the sweep may run up to a TTL later)
        with pytest.raises(flashserve.NotFoundError):
            watched.attend(0, truth.query())
        _steps(client, seqs, truth, 5)
        assert all(s.reprefills == 1 for s in seqs) and client.stats["not_found"] >= 1
        assert client.pool_info().evictions >= 4


def check_a_nan_key_poisons_only_the_heads_that_read_it(address, rng, keys=12000):
    """One NaN in K (KV head 1, key 5/12 of the way; on CUDA one long sequence's key axis is split over blocks): q heads 4..7
    (the group of KV head 1) come back NaN in O and in the LSE; every other head answers as on the same sequence
    without the NaN, which matches the fp64 reference. On CUDA a split-KV merge used to drop the NaN split and answer
    finite, without that split's keys; and a NaN row's LSE came back -inf ("saw no key")."""
    heads_q, heads_kv, d = 32, 8, 128
    truth = Truth(rng, heads_q, heads_kv, d, "bfloat16")
    shape = _shape(1, "bfloat16", heads_q=heads_q, heads_kv=heads_kv, head_dim=d)
    with flashserve.SequenceClient(address, timeout=120, reprefill=False) as client:
        k, v = truth.rows(keys)
        bad_k = k.copy()
        bad_k[keys * 5 // 12, 1, 7] = np.nan
        clean = client.create(**shape, prefix={0: (k, v)})
        truth.add(clean.key, 0, k, v)
        bad = client.create(**shape, prefix={0: (bad_k, v)})
        q = truth.query()
        out, lse = clean.attend(0, q, return_lse=True)
        truth.check(out, q, clean.key, 0, lse=lse)
        bad_out, bad_lse = bad.attend(0, q, return_lse=True)
        out, bad_out = np.asarray(out, np.float32), np.asarray(bad_out, np.float32)
        read = [h for h in range(heads_q) if h // (heads_q // heads_kv) == 1]
        others = [h for h in range(heads_q) if h not in read]
        assert np.isnan(bad_out[:, read]).all(), bad_out[:, read]
        assert np.isnan(np.asarray(bad_lse)[read]).all(), np.asarray(bad_lse)[read]
        np.testing.assert_array_equal(bad_out[:, others], out[:, others])
        np.testing.assert_array_equal(np.asarray(bad_lse)[others], np.asarray(lse)[others])


def test_a_nan_key_poisons_only_the_heads_that_read_it(kv_server, rng):
    check_a_nan_key_poisons_only_the_heads_that_read_it(kv_server.address, rng, keys=3000)


def check_idle_sequences_leave_the_pool_without_a_call(server, rng):
    """Sequences idle past the TTL (1 s on `server`) leave the pool's gauges and GetKvPoolInfo by themselves:
    eviction ran only from calls, so an idle server went on showing them held (and FlashserveKvPoolNearlyFull could
    fire on a server whose sequences were all gone)."""
    truth = Truth(rng, 8, 2, 128, "bfloat16")
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with flashserve.SequenceClient(server.address, timeout=60, reprefill=False) as client:
        for _ in range(3):
            _create(client, truth, _shape(1, "bfloat16"), 100)
        held = scrape(url)
        assert held.value("flashserve_kv_sequences") == 3 and held.value("flashserve_kv_pages_used") > 0
        time.sleep(2.0)  # the TTL and then some sweeps (every TTL/8), with no call meanwhile
        idle = scrape(url)
        assert idle.value("flashserve_kv_sequences") == 0
        assert idle.value("flashserve_kv_pages_used") == 0
        assert idle.value("flashserve_kv_evictions_total") == 3
        assert client.pool_info().sequences == 0


def test_sequences_idle_past_the_ttl_leave_the_pool_without_a_call(start_server, rng):
    check_idle_sequences_leave_the_pool_without_a_call(start_server(*KV_FLAGS, "--sequence_ttl_s=1", name="sweep"), rng)


def test_release_frees_pages_and_then_not_found(kv_server, rng):
    truth = Truth(rng, 8, 2, 128, "float16")
    with flashserve.SequenceClient(kv_server.address, timeout=60, reprefill=False) as client:
        used_before = client.pool_info().used_bytes
        seq = _create(client, truth, _shape(2, "float16"), 100, layers=[0, 1])
        assert client.pool_info().used_bytes > used_before
        assert seq.info().bytes > 0
        old_id = seq.id
        assert seq.release() is True
        assert client.pool_info().used_bytes == used_before
        response = client.stub(seq.endpoint).Release(flashserve.sequences_pb2.ReleaseRequest(sequence_ids=[old_id]))
        assert response.released == 0 and list(response.not_found) == [old_id]
        with pytest.raises(flashserve.FlashserveError, match="released"):
            seq.attend(0, truth.query())


def test_a_step_that_lost_more_ids_than_the_server_names_recreates_only_those(kv_server, rng):
    """A DecodeStep of 150 sequences, 120 of them released behind the client's back: more missing ids than the
    server's NOT_FOUND metadata names (3.5 KiB: ~108). The client asks which it lost and re-creates those 120 only.
    Before, it took every id for lost: 150 re-prefills, and the 30 the server still held stayed there next to their
    copies until the TTL."""
    truth = Truth(rng, 2, 1, 16, "float16")
    with flashserve.SequenceClient(kv_server.address, timeout=60) as client:
        before = client.pool_info().sequences
        seqs = truth.create(client, [3] * 150)
        client.stub(kv_server.address).Release(
            flashserve.sequences_pb2.ReleaseRequest(sequence_ids=[s.id for s in seqs[:120]]))
        qs, kvs = [truth.query() for _ in seqs], [truth.rows(1) for _ in seqs]
        outs = client.decode_step([(s, 0, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)])
        for s, q, (k, v), out in zip_all(seqs, qs, kvs, outs):
            truth.add(s.key, 0, k, v)
            truth.check(out, q, s.key, 0)
        assert client.stats["reprefills"] == 120
        assert client.pool_info().sequences == before + 150
        for s in seqs:
            s.release()


def test_pool_exhaustion_is_resource_exhausted_and_changes_nothing(start_server, rng):
    # 4 MiB pool (two 2 MiB slabs), pages of 16 tokens x 2 heads x 64 x 2 bytes = 4 KiB for K or V of one layer:
    # a sequence of 200 rows holds 26 pages.
    server = start_server("--kv_cache_bytes=4194304", "--kv_page_tokens=16", name="small_pool")
    truth = Truth(rng, 4, 2, 64, "float16")
    shape = _shape(1, "float16", 4, 2, 64)
    with flashserve.SequenceClient(server.address, timeout=60, reprefill=False) as client:
        seqs = []
        with pytest.raises(flashserve.ResourceExhaustedError) as info:
            for i in range(400):
                seqs.append(_create(client, truth, shape, 200, key=f"s{i}"))
        assert "kv" in info.value.message.lower(), info.value.message
        assert 20 <= len(seqs) < 400
        victim = seqs[0]
        with pytest.raises(flashserve.ResourceExhaustedError):
            for _ in range(200):  # the pages the refused create left free run out too
                k, v = truth.rows(16)
                victim.append(0, k, v)
                truth.add(victim.key, 0, k, v)
        assert list(victim.info().layer_lengths) == [truth.length(victim.key, 0)]  # the refused append: nothing
        assert client.pool_info().used_bytes <= client.pool_info().capacity_bytes
        seqs.pop().release()
        _steps(client, seqs[:3], truth, 2)  # still right after the refusal
        _create(client, truth, shape, 100, key="after-release")


def test_max_sequences(start_server, rng):
    server = start_server(*KV_FLAGS, "--max_sequences=3", name="max_seq")
    with flashserve.SequenceClient(server.address, timeout=60) as client:
        seqs = [client.create(**_shape(1, "float16")) for _ in range(3)]
        with pytest.raises(flashserve.ResourceExhaustedError, match="max_sequences"):
            client.create(**_shape(1, "float16"))
        seqs[0].release()
        client.create(**_shape(1, "float16")).release()


@pytest.mark.parametrize("kind", ["unbatched", "batching"])
def test_concurrent_clients_on_disjoint_sequences(request, kind, rng, concurrently):
    server = _server(request, kind)
    merged = []

    def worker(i):
        truth = Truth(np.random.default_rng(1000 + i), 8, 2, 128, "bfloat16")
        with flashserve.SequenceClient(server.address, timeout=120) as client:
            seqs = [_create(client, truth, _shape(1, "bfloat16"), 10 + j) for j in range(3)]
            _steps(client, seqs, truth, 15)
            for seq in seqs:
                seq.release()
            merged.append(client.stats["max_batched_calls"])

    concurrently(worker, 6)
    if kind == "batching":
        assert max(merged) > 1, "no two DecodeStep calls ran in one launch"
    else:
        assert max(merged) == 1


@pytest.mark.parametrize("kind", ["unbatched", "batching"])
def test_concurrent_clients_on_shared_sequences(request, kind, rng, concurrently):
    """Four threads share four sequences: each thread appends to its own layer of every sequence (one DecodeStep
    per round), two more only attend to layer 0 while it grows. With batching, steps of different threads on the
    same sequences run in one launch."""
    server = _server(request, kind)
    truth = Truth(rng, 8, 2, 128, "float16")
    shape = _shape(4, "float16")
    with flashserve.SequenceClient(server.address, timeout=120) as shared:
        seqs = [_create(shared, truth, shape, 30, layers=[0, 1, 2, 3]) for _ in range(4)]

        def worker(i):
            if i < 4:
                _steps(shared, seqs, truth, 12, layer=i)
                return
            for _ in range(10):
                for seq in seqs:
                    q = truth.query()
                    out = seq.attend(0, q)  # layer 0 grows meanwhile: check only that it is finite and shaped
                    assert out.shape == q.shape and not np.isnan(out.astype(np.float64)).any()

        concurrently(worker, 6)
        for seq in seqs:
            assert seq.info().layer_lengths == [30 + 12] * 4
            q = truth.query()
            truth.check(seq.attend(0, q), q, seq.key, 0)  # the whole history, in the order each layer got it


def test_restart_loses_sequences_client_sees_unavailable_then_not_found(start_server, rng, monkeypatch):
    server = start_server(*KV_FLAGS, name="restart")
    truth = Truth(rng, 8, 2, 128, "bfloat16")
    shape = _shape(1, "bfloat16")
    with flashserve.SequenceClient(server.address, timeout=20) as client, \
            flashserve.SequenceClient(server.address, timeout=20, reprefill=False) as plain:
        seqs = [_create(client, truth, shape, 40) for _ in range(2)]
        watched = plain.create(**shape)
        _steps(client, seqs, truth, 3)
        assert server.stop() == 0
        with pytest.raises(flashserve.UnavailableError):
            watched.attend(0, truth.query())
        ports = [server.grpc_port, server.http_port] + ([server.metrics_port] if server.metrics_port else [])
        monkeypatch.setattr(conftest, "free_port", iter(ports).__next__)
        server.start(attempts=1)  # same ports, empty memory
        monkeypatch.undo()
        seen = []
        deadline = time.monotonic() + 10
        while not seen or (isinstance(seen[-1], flashserve.UnavailableError) and time.monotonic() < deadline):
            try:
                watched.attend(0, truth.query())
                seen.append("answer")
            except (flashserve.UnavailableError, flashserve.NotFoundError) as e:
                seen.append(e)  # UNAVAILABLE until the channel reconnects
        assert isinstance(seen[-1], flashserve.NotFoundError), seen
        _steps(client, seqs, truth, 3)
        assert all(s.reprefills == 1 for s in seqs)


def test_bearer_token(start_server, rng, tmp_path):
    (tmp_path / "token").write_text("s3cret-token-0123456789\n")
    server = start_server(*KV_FLAGS, f"--auth_token_file={tmp_path / 'token'}", name="auth")
    truth = Truth(rng, 8, 2, 128, "float16")
    with flashserve.SequenceClient(server.address, timeout=20) as anonymous:
        with pytest.raises(flashserve.FlashserveError) as info:
            anonymous.create(**_shape(1, "float16"))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with flashserve.SequenceClient(server.address, timeout=20, token="wrong") as wrong:
        with pytest.raises(flashserve.FlashserveError) as info:
            wrong.pool_info()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with flashserve.SequenceClient(server.address, timeout=20, token="s3cret-token-0123456789") as client:
        seq = _create(client, truth, _shape(1, "float16"), 5)
        _steps(client, [seq], truth, 3)
        with flashserve.SequenceClient(server.address, timeout=20, reprefill=False) as anonymous:
            seq.client = anonymous  # the same sequence, without the token: Truncate is gated too
            with pytest.raises(flashserve.FlashserveError) as info:
                seq.truncate(2)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            seq.client = client
        assert seq.truncate(2) == [2]
