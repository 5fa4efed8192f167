"""The hot lane (--hot_lane_spin_us): small Attention requests processed on one warm thread instead of gRPC's.

On by default only with the CUDA backend (tests/python/test_gpu_e2e.py covers it there); these tests switch it on for
the CPU backend so CI runs the same edge path: correct answers under concurrency, refusals and errors answered from the
lane, a lane that went to sleep between requests, and a SIGTERM drain with requests on it.
"""

import signal
import threading
import time

import grpc
import numpy as np
import pytest

import flashserve
from metrics_helpers import scrape

pytestmark = pytest.mark.e2e


def _lane_server(start_server, spin_us, name, *extra):
    server = start_server(f"--hot_lane_spin_us={spin_us}", *extra, name=name)
    assert "hot lane: Attention requests under 4 MiB" in server.logs(), server.logs()
    return server


# 1 us: the lane goes to sleep between nearly every request (0 would mean no lane at all).
@pytest.mark.parametrize("spin_us", [1, 300], ids=["sleeps-between-requests", "spins-300us"])
def test_lane_serves_concurrent_mixed_requests(start_server, make_qkv, check_answer, concurrently, spin_us):
    server = _lane_server(start_server, spin_us, "lane")

    def worker(i):
        rng = np.random.default_rng(7000 + i)
        dtype = ["float32", "float16", "bfloat16"][i % 3]
        with flashserve.Client(server.address, timeout=120) as c:
            for j in range(4):
                shape = (1 + j % 2, 3 + 11 * i + j, 5 + 7 * j, 4, 2 if i % 2 else 4, 64)
                q, k, v = make_qkv(rng, *shape, dtype)
                out, lse = c.attention(q, k, v, causal=bool((i + j) % 2), return_lse=True)
                check_answer(out, lse, q, k, v, causal=bool((i + j) % 2))
                time.sleep(0.002 * (i % 3))  # let the lane run out of spin now and then

    concurrently(worker, 12)
    # Every request was small enough for the lane: each one counted once, as run on it or refused (busy).
    s = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    on_lane = s.value("flashserve_hot_lane_requests_total", result="lane")
    busy = s.value("flashserve_hot_lane_requests_total", result="busy")
    assert on_lane + busy == 12 * 4, (on_lane, busy)
    assert on_lane >= 1, "the lane never took a request"


def test_lane_answers_bad_input(start_server, rng, make_qkv):
    server = _lane_server(start_server, 500, "lane-errors")
    q, k, v = make_qkv(rng, 1, 16, 16, 4, 3, 64, "float32")  # 4 query heads over 3 KV heads: invalid
    with flashserve.Client(server.address, timeout=30) as c:
        with pytest.raises(flashserve.InvalidArgumentError):
            c.attention(q, k, v)
        channel = grpc.insecure_channel(server.address)
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/flashserve.v1.AttentionService/Attention")(b"\xff\xff\xff", timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        channel.close()
        q, k, v = make_qkv(rng, 1, 16, 16, 4, 4, 64, "float32")
        out = c.attention(q, k, v)  # the lane still serves after the errors
        assert out.shape == q.shape and np.isfinite(out).all()


def test_sigterm_drains_requests_on_the_lane(start_server, make_qkv, check_answer):
    server = _lane_server(start_server, 1000, "lane-drain", "--worker_threads=1", "--shutdown_grace_seconds=60")
    rng = np.random.default_rng(11)
    # 3.84 MB (under the lane's 4 MiB) and 6.4 GFLOP: tens of ms each on the one CPU worker.
    q, k, v = make_qkv(rng, 1, 5000, 5000, 1, 1, 64, "float32")
    results, errors = [], []

    def call():
        try:
            with flashserve.Client(server.address, timeout=120) as c:
                results.append(c.attention(q, k, v))
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    # SIGTERM once the server holds a request (in-flight gauge), while the others queue behind it.
    metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and scrape(metrics).value("flashserve_inflight_requests") < 1:
        time.sleep(0.005)
    assert scrape(metrics).value("flashserve_inflight_requests") >= 1, "no request in flight before SIGTERM"
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    code = server.proc.wait(timeout=60)
    assert code == 0, f"exit {code}\n{server.logs()}"
    # Requests admitted before SIGTERM are answered correctly; ones that arrived after it are refused.
    # A request that reaches the server just as gRPC itself shuts down (after the drain) may get CANCELLED instead:
    # the race test_faults' drain test tolerates for one call.
    cancelled = [e for e in errors if isinstance(e, flashserve.FlashserveError) and e.code.name == "CANCELLED"]
    assert len(cancelled) <= 1, errors
    for e in errors:
        assert isinstance(e, flashserve.UnavailableError) or e in cancelled, repr(e)
    assert results, f"the request in flight at SIGTERM was not answered: {errors}"
    for out in results:
        check_answer(out, None, q, k, v, causal=False)
