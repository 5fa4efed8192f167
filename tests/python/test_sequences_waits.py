"""Sequences calls that wait -- a Truncate for a running step's pin, a step in the batch window -- on the CPU backend
(the real binary): waiting calls must not stall the rest of the gRPC server, and a waiting step must not lose its
sequences to the TTL."""

from __future__ import annotations

import statistics
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import flashserve
from flashserve import tensors
from flashserve import sequences_pb2 as spb
from sequences_truth import Truth

pytestmark = pytest.mark.e2e
SHAPE = dict(num_layers=1, heads_q=4, heads_kv=2, head_dim=32, dtype="float16")


def test_calls_waiting_in_the_batch_window_keep_their_sequences(start_server, rng):
    """A sequence idle 0.3 s of its 1 s TTL, then an Attend and a DecodeStep that wait ~1 s in the batch window: both
    are answered from it. The sequence used to be evicted under them (NOT_FOUND: the client re-sends its prefix)."""
    server = start_server("--kv_cache_bytes=16777216", "--sequence_ttl_s=1", "--batch_window_us=1000000",
                          name="ttl_window")
    truth = Truth(rng, 4, 2, 32, "float16")
    with flashserve.SequenceClient(server.address, timeout=30, reprefill=False) as client:
        for _ in range(2):
            k, v = truth.rows(8)
            seq = client.create(**SHAPE, prefix={0: (k, v)})
            truth.add(seq.key, 0, k, v)
            time.sleep(0.3)
            q = truth.query()
            started = time.monotonic()
            truth.check(seq.attend(0, q), q, seq.key, 0)
            assert time.monotonic() - started > 0.5, "the Attend did not wait in the window: the test tests nothing"
            time.sleep(0.3)
            q = truth.query()
            k, v = truth.rows(1)
            [out] = client.decode_step([(seq, 0, q, k, v)])
            truth.add(seq.key, 0, k, v)
            truth.check(out, q, seq.key, 0)


def _health_latencies(address, seconds):
    """Sequential gRPC health checks on a connection of their own for `seconds`: each one's latency."""
    latencies = []
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=30)  # connected before timing
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            started = time.monotonic()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            latencies.append(time.monotonic() - started)
            time.sleep(0.01)
    return latencies


def test_truncates_waiting_for_a_step_do_not_stall_the_grpc_server(start_server, rng):
    """16 clients each send a no-op Truncate on a sequence whose long decode steps keep it pinned: every Truncate
    waits for a step to end. They used to wait on gRPC's callback threads (max(2, cores / 2) of them, shared by every
    method), so health checks and every other call stalled for as long as the steps ran; now they wait on the
    Sequences control threads, and health checks answer at once."""
    server = start_server("--kv_cache_bytes=134217728", "--kv_page_tokens=64", name="waits")
    tokens, heads_kv, d = 16384, 8, 128
    with flashserve.SequenceClient(server.address, timeout=60, reprefill=False) as client:
        kv = rng.standard_normal((tokens, heads_kv, d)).astype(np.float16)
        seq = client.create(num_layers=1, heads_q=32, heads_kv=heads_kv, head_dim=d, dtype="float16",
                            prefix={0: (kv, kv)})
        stub = client.stub(seq.endpoint)
        step = spb.DecodeStepRequest(items=[spb.DecodeItem(
            sequence_id=seq.id, layer=0,
            q=tensors.to_proto_rows(rng.standard_normal((16, 32, d)).astype(np.float16), "q"))])
        truncate = spb.TruncateRequest(items=[spb.TruncateItem(sequence_id=seq.id, length=tokens)])
        stop = threading.Event()
        steps, truncate_waits, errors = [], [], []

        def stepper():
            while not stop.is_set():
                started = time.monotonic()
                stub.DecodeStep(step, timeout=60)
                steps.append(time.monotonic() - started)

        def truncater():
            while not stop.is_set():
                started = time.monotonic()
                stub.Truncate(truncate, timeout=60)
                truncate_waits.append(time.monotonic() - started)

        def guarded(fn):
            def run():
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 -- reported below
                    errors.append(e)
            return run

        threads = [threading.Thread(target=guarded(stepper))]
        threads += [threading.Thread(target=guarded(truncater)) for _ in range(16)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            latencies = _health_latencies(server.address, 3.0)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        assert not errors, errors
        assert len(steps) >= 3 and statistics.median(steps) > 0.03, f"steps too short to pin: {steps}"
        assert statistics.median(truncate_waits) > 0.01, "the Truncates did not wait: the test tests nothing"
        assert statistics.median(latencies) < 0.02, f"health checks stalled: median {statistics.median(latencies)}"
        assert max(latencies) < 0.5 * max(steps) + 0.1, f"a health check waited for a step: {max(latencies)}"
