"""The CPU backend stops a computation nobody waits for: a request whose deadline passes (native gRPC or a KServe
REST `timeout`) answers DEADLINE_EXCEEDED and one its client cancels stops too, freeing the worker for the next
request at once; SIGTERM during a long computation exits within the grace period, logging the shutdown (not the
client) as the reason.

The large request is q = k = v fp32 [1, 240000, 1, 4] (11.5 MB): ~20 s of compute on a 2-core machine if it ran to
its end (work grows as seqlen_q x seqlen_k), so without the stop every check below fails by seconds."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import requests

import flashserve
from flashserve import attention_pb2 as pb
from flashserve import tensors
from conftest import attention_in_background
from test_kserve_rest import binary_request

pytestmark = pytest.mark.e2e

LARGE = (1, 240000, 1, 4)
SMALL = (1, 64, 2, 32)
DEADLINE_S = 1.0
PROMPT_S = 2.0  # the small request's budget after the large one gave up (it computes in microseconds)


def _qkv(shape, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(3))


def _small_answered_within(address) -> float:
    q, k, v = _qkv(SMALL, seed=1)
    started = time.monotonic()
    with flashserve.Client(address, timeout=60) as c:
        out = c.attention(q, k, v)
    took = time.monotonic() - started
    np.testing.assert_allclose(out, flashserve.reference.attention(q, k, v), atol=1e-5, rtol=0)
    return took


def _inflight(server) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("flashserve_inflight_requests "):
            return float(line.split()[1])
    return 0.0


def _wait_computing(server, running):
    """Returns once the server holds the request (in-flight gauge) and has had time to start computing it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and running() and _inflight(server) < 1:
        time.sleep(0.01)
    time.sleep(0.5)  # the edge copies its 11 MB first (tens of ms, more on a loaded machine)


def _logs_with(server, text: str) -> str:
    """The server's logs once they hold `text` (a failed call is logged as it is answered)."""
    deadline = time.monotonic() + 5
    while text not in server.logs(limit=50000) and time.monotonic() < deadline:
        time.sleep(0.05)
    logs = server.logs(limit=50000)
    assert text in logs, logs
    return logs


def test_deadline_stops_the_computation_and_frees_the_worker(start_server):
    server = start_server(name="cpu_cancel_deadline")
    q, k, v = _qkv(LARGE)
    started = time.monotonic()
    with flashserve.Client(server.address) as c:
        with pytest.raises(flashserve.DeadlineExceededError):
            c.attention(q, k, v, timeout=DEADLINE_S)
    assert time.monotonic() - started < DEADLINE_S + 1.0
    took = _small_answered_within(server.address)
    assert took < PROMPT_S, f"the next request waited {took:.1f} s: the large one kept computing\n{server.logs()}"
    # The server's side of it: the work stopped at the deadline, it was not computed and thrown away. The client's
    # gRPC library cancels the call at the same deadline, counted from before the server read its headers: under
    # load that cancel can be the first the server sees (CI: "cancelled by the client ... after 1968186 us" for a
    # 2 s deadline), so either reason names the stop.
    logs = _logs_with(server, "while computing; stopped after")
    assert "deadline passed while computing; stopped after" in logs or \
        "cancelled by the client while computing; stopped after" in logs, logs


def test_rest_timeout_stops_the_computation(start_server):
    server = start_server(name="cpu_cancel_rest")
    q, k, v = _qkv(LARGE)
    body, headers = binary_request(q, k, v, parameters={"timeout": int(DEADLINE_S * 1e6)})
    started = time.monotonic()
    response = requests.post(f"{server.http}/v2/models/attention/infer", data=body, headers=headers, timeout=60)
    answered = time.monotonic() - started
    assert response.status_code == 504, (response.status_code, response.text[:300])
    assert answered < DEADLINE_S + PROMPT_S, f"504 after {answered:.1f} s: the server computed past the timeout"
    assert _small_answered_within(server.address) < PROMPT_S


def test_client_cancel_stops_the_computation(start_server):
    server = start_server(name="cpu_cancel_client")
    q, k, v = _qkv(LARGE)
    request = pb.AttentionRequest(q=tensors.to_proto(q, "q"), k=tensors.to_proto(k, "k"),
                                  v=tensors.to_proto(v, "v"), request_id="abandoned")
    with flashserve.Client(server.address, timeout=60) as c:
        future = c.stub.Attention.future(request, timeout=60)
        _wait_computing(server, future.running)
        assert future.cancel(), "the large request finished early"
    took = _small_answered_within(server.address)
    assert took < PROMPT_S, f"the next request waited {took:.1f} s: the cancelled one kept computing"
    logs = _logs_with(server, "cancelled by the client while computing; stopped after")
    assert 'request_id="abandoned"' in logs, logs


def test_sigterm_during_a_long_computation_exits_within_the_grace(start_server):
    grace_s = 2
    server = start_server(f"--shutdown_grace_seconds={grace_s}", name="cpu_cancel_sigterm")
    q, k, v = _qkv(LARGE)
    thread, result = attention_in_background(server.address, q, k, v)
    _wait_computing(server, thread.is_alive)
    assert thread.is_alive(), f"the large request finished early: {result}"
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=120)
    exited_after = time.monotonic() - signalled
    thread.join(timeout=30)
    logs = server.logs()
    assert exited_after < grace_s + 1.5, f"exited {exited_after:.1f} s after SIGTERM (grace {grace_s} s)\n{logs}"
    assert code == 0, f"exit code {code}\n{logs}"
    assert "out" not in result, "a request cancelled by the shutdown was answered"
    assert "cancelled by the client" not in logs, logs
    assert "cancelled by the server's shutdown" in logs, logs
