"""A backend that turns unhealthy (a sticky device fault) ends in a restart, on the CPU backend: the fault-injection
hook (--enable_fault_injection, request_id "flashserve-test:inject-device-fault") marks the backend unhealthy; the
server must then fail /v2/health/live as well as /v2/health/ready, turn gRPC health NOT_SERVING, answer new requests
UNAVAILABLE, and after --shutdown_grace_seconds exit by itself with code 3 (README "Server flags", exit codes), so that
its supervisor starts a fresh process instead of keeping a zombie. test_gpu_e2e.py does the same with a real CUDA
fault.

Skipped (saying why) while the CPU backend ignores the hook: then the injected request is simply computed."""

from __future__ import annotations

import subprocess
import time

import grpc
import numpy as np
import pytest

import flashserve

from conftest import free_port, http_get
from metrics_helpers import scrape

pytestmark = pytest.mark.e2e

FAULT_ID = "flashserve-test:inject-device-fault"
EXIT_BACKEND_UNHEALTHY = 3


def _qkv(seed: int):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, 37, 2, 64)).astype(np.float32) for _ in range(3))


def _kserve_server_live(address: str) -> bool:
    """KServe v2 gRPC ServerLive, without stubs: the request is empty and the answer is `bool live = 1`."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ServerLive",
                                   request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
        answer = call(b"", timeout=10)
    assert answer in (b"", b"\x08\x00", b"\x08\x01"), answer
    return answer == b"\x08\x01"


def test_unhealthy_backend_fails_liveness_and_exits_3(start_server):
    grace_s = 3
    metrics_port = free_port()
    s = start_server("--enable_fault_injection", f"--shutdown_grace_seconds={grace_s}", f"--metrics_port={metrics_port}",
                     name="fault")
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    with flashserve.Client(s.address, timeout=60) as c:
        c.attention(*_qkv(1))  # healthy first
        assert http_get(f"{s.http}/v2/health/live")[0] == 200
        assert scrape(metrics).value("flashserve_backend_healthy") == 1.0
        assert _kserve_server_live(s.address)
        try:
            c.attention(*_qkv(2), request_id=FAULT_ID)
            pytest.fail("the injected fault was computed: the CPU backend's fault hook (cpu_backend.cc) is broken, and "
                        "with it the only CPU test of the unhealthy-backend path")
        except flashserve.FlashserveError as fault:
            assert fault.code == grpc.StatusCode.INTERNAL, fault
        faulted = time.monotonic()
        deadline = faulted + 5
        while http_get(f"{s.http}/v2/health/live")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http_get(f"{s.http}/v2/health/live")[0] == 503, "liveness still passes after the fault"
        assert http_get(f"{s.http}/v2/health/ready")[0] == 503
        assert not _kserve_server_live(s.address), "KServe gRPC ServerLive still says live after the fault"
        assert scrape(metrics).value("flashserve_backend_healthy") == 0.0, "the metric an alert watches says healthy"
        while c.health_status() != "NOT_SERVING" and time.monotonic() < deadline:  # the server looks every second
            time.sleep(0.05)
        assert c.health_status() == "NOT_SERVING"
        with pytest.raises(flashserve.UnavailableError) as refused:
            c.attention(*_qkv(3))
        assert "injected fault" in str(refused.value), refused.value  # names the fault (README, sticky faults)
    try:  # no signal: the process must end itself once the grace period is over
        code = s.proc.wait(timeout=grace_s + 20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the unhealthy server still runs {grace_s + 20} s after its fault\n{s.logs()}")
    assert code == EXIT_BACKEND_UNHEALTHY, f"exit code {code}\n{s.logs()}"
    # It stayed up (not ready, not live) for the grace period: load balancers saw why before the port closed.
    assert time.monotonic() - faulted >= grace_s - 1.5, s.logs()
