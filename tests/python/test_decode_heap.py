"""Decode steps and big CreateSequence calls keep their heap (HeapRetention::Retain, CPU backend, the real binary): a 64-sequence DecodeStep frees
its message strings and arena blocks after each answer and the next step allocates them again. With glibc's
128 KiB thresholds the heap's top went back to the system after every step (and strings above 128 KiB were mmaps of
their own), faulted in again by the next step (on the H200 hosts 0.08-0.6 ms of a one-client step). Measured here as
the server's minor page faults per packed step, over gRPC and the local socket, against a server whose retention is
off (--malloc_trim_threshold_bytes=0); the last step's answers are checked against the fp64 reference.

A CreateSequence with an 8k-token prefix of that layer is 32 MiB, parsed into two 16 MiB strings: those were mmaps of
their own even while retaining (4 MiB threshold), ~8,000 page faults per create on top of gRPC's receive chunks.
Creates now retain as big Attention requests do, and the retaining threshold (32 MiB) takes such strings from the
heap."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import sequences_pb2 as spb
from flashserve import tensors
from flashserve.local import LocalClient
from conftest import ServerProcess, _stop_and_check, zip_all
from sequences_truth import Truth
from test_allocators import _sanitized

pytestmark = pytest.mark.e2e
SHAPE = dict(heads_q=32, heads_kv=8, head_dim=128)  # the Llama-3-8B-like layer: q and O 512 KiB per step
SEQUENCES, WARMUP, STEPS = 64, 4, 12
INPUT_PAGES_PER_STEP = 192  # q, k and v of a step: 768 KiB of 4 KiB pages
KV_PAGES_PER_STEP = 64  # the pool's pages a step's new rows touch, one per sequence


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10, minflt (after the comm field)


@pytest.fixture(scope="module")
def heap_servers(flashserve_bin, tmp_path_factory):
    """{"retaining": the default server, "retention_off": --malloc_trim_threshold_bytes=0}, both with a local socket."""
    if _sanitized(flashserve_bin) or os.environ.get("LD_PRELOAD"):
        pytest.skip("another allocator (a sanitizer's, a preloaded one) refuses glibc's mallopt: nothing is retained")
    servers, tmp = {}, tempfile.mkdtemp(prefix="fsh", dir="/tmp")  # sun_path: at most 107 bytes
    for kind, extra in (("retaining", []), ("retention_off", ["--malloc_trim_threshold_bytes=0"])):
        path = os.path.join(tmp, f"{kind}.sock")
        flags = ["--kv_cache_bytes=67108864", "--kv_page_tokens=16", f"--local_socket={path}"] + extra
        servers[kind] = ServerProcess(flashserve_bin, tmp_path_factory.mktemp(kind), flags, name=kind).start()
        servers[kind].local_path = path
    yield servers
    for s in servers.values():
        _stop_and_check(s)
    shutil.rmtree(tmp, ignore_errors=True)


def _step_request(seqs, qs, kvs):
    """One packed step: q (512 KiB) and k, v (128 KiB each) one tensor each, parsed into strings above glibc's 128 KiB
    mmap threshold."""
    request = spb.DecodeStepRequest()
    for seq in seqs:
        request.items.add(sequence_id=seq.id, layer=0)
    for field, x in (("q", np.concatenate(qs)), ("k", np.concatenate([k for k, _ in kvs])),
                     ("v", np.concatenate([v for _, v in kvs]))):
        getattr(request.packed, field).CopyFrom(tensors.to_proto_rows(x, field))
    return request


def _faults_per_step(server, rng, transport) -> float:
    """Minor page faults of the server per DecodeStep, the median of `STEPS` steps after `WARMUP` (a step now and
    then grows a heap or the KV pool's page table: the mean over 12 steps put the two servers only 66-78 faults
    apart in 3 of ~40 runs on the build machine); the last step's answers are checked against the fp64 reference."""
    truth = Truth(rng, **SHAPE, dtype="float16")
    local = LocalClient(server.local_path, timeout=30) if transport == "local" else None
    try:
        with flashserve.SequenceClient(server.address, timeout=60, reprefill=False) as client:
            seqs = truth.create(client, [1] * SEQUENCES)
            stub = client.stub(client.endpoints[0])
            per_step = []
            for step in range(WARMUP + STEPS):
                before = _minor_faults(server.proc.pid)
                qs = [truth.query(1) for _ in seqs]
                kvs = [truth.rows(1) for _ in seqs]
                request = _step_request(seqs, qs, kvs)
                response = local.decode_step(request) if local else stub.DecodeStep(request, timeout=60)
                if step >= WARMUP:
                    per_step.append(_minor_faults(server.proc.pid) - before)
                for seq, (k, v) in zip(seqs, kvs):
                    truth.add(seq.key, 0, k, v)
            for seq, q, result in list(zip_all(seqs, qs, response.results))[::9]:
                out = np.frombuffer(result.out.data, np.float16).reshape(q.shape)
                truth.check(out, q, seq.key, 0)
            for seq in seqs:
                client.release(seq)
    finally:
        if local is not None:
            local.close()
    return statistics.median(per_step)


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_decode_steps_page_fault_less_while_retaining(heap_servers, rng, transport):
    retaining = _faults_per_step(heap_servers["retaining"], rng, transport)
    off = _faults_per_step(heap_servers["retention_off"], rng, transport)
    # A step's inline inputs are 768 KiB = 192 pages (q, k, v parsed into three strings); both servers also fault in
    # the KV pool's new pages (64 per step) and the CPU kernel's scratch. Seen on the 2-core build machine (medians):
    # gRPC 97-140 vs 220-417 per step, local socket 0-1 vs 144-204; with the Retain() calls removed 279-359 vs
    # 226-417 (gRPC) and 172-204 vs 172-204 (local). The server without retention varies from run to run (220-353 in
    # 8 runs of one binary): measured against it, "96 fewer" failed on an unchanged server (129 vs 220) and passed
    # with retention removed (279 vs 384), and a ratio sat at the edge either way. So the bound is the request's own:
    # retention keeps at least half of the inputs' pages, the KV pool's new pages aside (removed: 300-309 vs 160).
    bound = KV_PAGES_PER_STEP + INPUT_PAGES_PER_STEP / 2
    assert retaining < min(bound, off), (f"{transport}: {retaining:.0f} faults per step retaining vs {off:.0f} "
                                         f"without (bound {bound:.0f})")


PREFIX_TOKENS, CREATES = 8192, 10  # 32 MiB per CreateSequence


def _faults_per_create(flashserve_bin, tmp_path, rng, extra) -> float:
    """Server minor page faults per CreateSequence of an 8k-token prefix (each released before the next, so the KV
    pool's pages are reused and only the request's own buffers can fault), after two creates; the last sequence's
    attention is checked against the fp64 reference."""
    flags = [f"--kv_cache_bytes={80 << 20}", "--kv_page_tokens=64", f"--max_sequence_tokens={PREFIX_TOKENS}"] + extra
    server = ServerProcess(flashserve_bin, tmp_path, flags, name="create_heap").start()
    try:
        truth = Truth(rng, **SHAPE, dtype="float16")
        with flashserve.SequenceClient(server.address, timeout=60, reprefill=False) as client:
            before = 0
            for n in range(2 + CREATES):
                if n == 2:
                    before = _minor_faults(server.proc.pid)
                (seq,) = truth.create(client, [PREFIX_TOKENS])
                if n < 1 + CREATES:
                    client.release(seq)
            after = _minor_faults(server.proc.pid)
            q = truth.query(1)
            truth.check(client.attend(seq, 0, q), q, seq.key, 0)
    finally:
        _stop_and_check(server)
    return (after - before) / CREATES


def test_big_creates_page_fault_less_while_retaining(flashserve_bin, tmp_path_factory, rng):
    if _sanitized(flashserve_bin) or os.environ.get("LD_PRELOAD"):
        pytest.skip("another allocator (a sanitizer's, a preloaded one) refuses glibc's mallopt: nothing is retained")
    retaining = _faults_per_create(flashserve_bin, tmp_path_factory.mktemp("retaining"), rng, [])
    off = _faults_per_create(flashserve_bin, tmp_path_factory.mktemp("retention_off"), rng,
                             ["--malloc_trim_threshold_bytes=0"])
    # Seen on the 2-core build machine: 1,670 vs 9,786 per create (before creates retained, with the 4 MiB threshold:
    # 11,754 vs 9,570). The two 16 MiB strings alone are 8,192 pages: retention must keep at least half of them.
    assert off - retaining > 4096, f"{retaining:.0f} faults per 32 MiB create retaining vs {off:.0f} without"



@pytest.mark.parametrize("poke", ["unparsable", "no_kv_cache"])
def test_decode_steps_that_cannot_run_keep_no_heap(flashserve_bin, start_server, poke):
    """A DecodeStep retained the heap for 10 s before it was parsed, on a server without a KV cache too: a 1-byte call
    every few seconds kept glibc's freed heap from going back (RSS 430 vs 94 MiB after the same Attention traffic,
    session 36). Now only a step that can run retains (the server logs when retention starts, at debug)."""
    if _sanitized(flashserve_bin) or os.environ.get("LD_PRELOAD"):
        pytest.skip("another allocator (a sanitizer's, a preloaded one) refuses glibc's mallopt: nothing is retained")
    server = start_server("--log_level=debug", name="noretain")  # no --kv_cache_bytes: the Sequences API is off
    with grpc.insecure_channel(server.address) as channel:
        step = channel.unary_unary("/flashserve.v1.Sequences/DecodeStep")
        body = b"\xff" if poke == "unparsable" else spb.DecodeStepRequest(
            items=[spb.DecodeItem(sequence_id="x" * 32, layer=0)]).SerializeToString()
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as refused:
                step(body, timeout=10)
        expected = grpc.StatusCode.INVALID_ARGUMENT if poke == "unparsable" else grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.code() == expected, refused.value
    assert "DecodeStep failed" in server.logs(limit=20000), "the server's debug log was not read"
    assert "heap: retaining" not in server.logs(limit=20000), "a step that could not run retained the heap"


def test_a_decode_step_that_runs_retains_the_heap(flashserve_bin, start_server, rng):
    """The other side: a step on a server with a KV cache starts retention (the log line the test above looks for)."""
    if _sanitized(flashserve_bin) or os.environ.get("LD_PRELOAD"):
        pytest.skip("another allocator (a sanitizer's, a preloaded one) refuses glibc's mallopt: nothing is retained")
    server = start_server("--log_level=debug", "--kv_cache_bytes=16777216", name="retain")
    truth = Truth(rng, 4, 2, 32, "float16")
    with flashserve.SequenceClient(server.address, timeout=30, reprefill=False) as client:
        k, v = truth.rows(4)
        seq = client.create(num_layers=1, heads_q=4, heads_kv=2, head_dim=32, dtype="float16", prefix={0: (k, v)})
        truth.add(seq.key, 0, k, v)
        q = truth.query()
        k, v = truth.rows(1)
        [out] = client.decode_step([(seq, 0, q, k, v)])
        truth.add(seq.key, 0, k, v)
        truth.check(out, q, seq.key, 0)
    assert "heap: retaining" in server.logs(limit=20000)
