"""Shutdown signals and exit codes (README "Exit codes"): SIGHUP drains like SIGTERM (it used to kill the process
at once, dropping what was in flight); a second signal during the drain stops it at once instead of waiting out
--shutdown_grace_seconds; a flag value the server cannot use -- a KV pool it cannot map, a --host that does not
resolve or is not this machine's -- exits 2 naming the flag, while a port in use stays 1 (the environment's)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

import flashserve
from conftest import attention_in_background, free_port, http_get
from metrics_helpers import scrape
from tcp_proxy import ThrottlingProxy

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def sighup_not_ignored():
    """Servers started here take SIGHUP as a shutdown signal unless they inherit it ignored: a test run under nohup
    (or a CI runner that ignores it) would pass that on. SIGHUP is the default for the children of these tests; the
    test that wants it ignored sets that in its own child."""
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, before)


def _inflight(server) -> float:
    return scrape(f"http://127.0.0.1:{server.metrics_port}/metrics").value("flashserve_inflight_requests")


def _wait_for_log(server, text: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in server.logs(limit=100_000):
            return True
        if server.proc.poll() is not None:
            return text in server.logs(limit=100_000)
        time.sleep(0.02)
    return False


def _wait_exit(server, timeout: float):
    """(exit code, seconds waited); kills the process and fails if it is still running after `timeout`."""
    started = time.monotonic()
    try:
        code = server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        pytest.fail(f"still running {timeout} s later\n{server.logs()}")
    return code, time.monotonic() - started


def test_sighup_drains_like_sigterm(start_server):
    """SIGHUP (a terminal's hang-up, some logrotate setups) is a graceful shutdown: the request in flight is answered
    correctly, the server logs which signal came and exits 0. It used to die at once (the default action)."""
    server = start_server("--shutdown_grace_seconds=60", "--worker_threads=1", name="sighup")
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 4096, 8, 64)).astype(np.float32) for _ in range(3))  # ~34 GFLOP
    thread, result = attention_in_background(server.address, q, k, v)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _inflight(server) < 1 and thread.is_alive():
        time.sleep(0.005)
    assert thread.is_alive() and _inflight(server) >= 1, "the request was not in flight; make it bigger"
    server.proc.send_signal(signal.SIGHUP)
    code, _ = _wait_exit(server, 60)
    thread.join(timeout=60)
    logs = server.logs()
    assert code == 0, f"exit code {code} after SIGHUP\n{logs}"
    assert "SIGHUP received: draining" in logs, logs
    assert "error" not in result, f"the request in flight failed: {result.get('error')}\n{logs}"
    rows = [0, 1, 2049, 4095]
    ref = flashserve.reference.attention(q[:, rows], k, v)
    np.testing.assert_allclose(result["out"][:, rows], ref, atol=1e-5, rtol=0)


def test_a_server_started_with_sighup_ignored_keeps_ignoring_it(flashserve_bin, tmp_path):
    """`nohup flashserve ...` ignores SIGHUP so that the server outlives the operator's session. Blocking SIGHUP to
    take it as a shutdown signal overrode that (a blocked signal is never discarded): the server drained and exited
    when the session closed (review). Now SIGHUP is taken only when it was not ignored at start."""
    nohup = shutil.which("nohup")
    if nohup is None:
        pytest.skip("no nohup on this machine")
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    log = open(tmp_path / "nohup.log", "w")
    # nohup itself (it ignores SIGHUP and execs the server: same pid), not a preexec_fn, which runs Python in a fork
    # of this process: with this process's gRPC threads busy, one such fork printed gRPC's "epoll_wait error: Bad
    # file descriptor" and never became a ready server (CI, session 45).
    proc = subprocess.Popen([nohup, str(flashserve_bin), "--backend=cpu", "--host=127.0.0.1",
                             f"--grpc_port={grpc_port}", f"--http_port={http_port}", f"--metrics_port={metrics_port}"],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        ready = f"http://127.0.0.1:{http_port}/v2/health/ready"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and http_get(ready)[0] != 200:
            time.sleep(0.05)
        assert http_get(ready)[0] == 200, (tmp_path / "nohup.log").read_text()
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None, (tmp_path / "nohup.log").read_text()
        assert http_get(ready)[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.parametrize("first,second", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGHUP, signal.SIGINT)],
                         ids=["term-term", "hup-int"])
def test_a_second_signal_during_the_drain_stops_it_now(start_server, rng, first, second):
    """A native call admitted from its first byte whose client then stalls holds the drain up to the grace period
    (60 s here). A second signal means "stop now": the server logs it, cancels what is left, as the end of the grace
    period does, and exits 0 within a second or two. It used to be ignored: only SIGKILL ended the wait sooner."""
    server = start_server("--shutdown_grace_seconds=60", name="second_signal")
    proxy = ThrottlingProxy(server.grpc_port, upload_limit=1 << 20)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in [(1, 4096, 4, 128), (1, 8, 4, 128),
                                                                             (1, 8, 4, 128)])  # 8 MiB of q
    thread, result = attention_in_background(proxy.address, q, k, v)
    try:
        proxy.wait_to_server(1 << 20, timeout=30)
        assert proxy.to_server == 1 << 20, "the upload never reached the stall point"
        time.sleep(0.5)  # the server reads what the proxy passed on: the call is admitted
        server.proc.send_signal(first)
        # Taken before the second comes: two pending signals of one kind would count once.
        assert _wait_for_log(server, "received: draining"), f"no drain after {first!r}\n{server.logs()}"
        time.sleep(0.5)
        assert server.proc.poll() is None, f"exited before the stalled call's grace period\n{server.logs()}"
        server.proc.send_signal(second)
        code, took = _wait_exit(server, 15)
    finally:
        proxy.close()
    thread.join(timeout=30)
    logs = server.logs()
    assert code == 0, f"exit code {code}\n{logs}"
    assert took < 10, f"exited {took:.1f} s after the second signal\n{logs}"
    assert f"{signal.Signals(second).name} received: stopping now" in logs, logs
    assert "error" in result, "a request that never arrived whole was answered?"


HANG_ID = "flashserve-test:inject-device-hang"  # with --enable_fault_injection: a job that never completes
OVERRUN_S = 20  # ShutdownOptions::kShutdownOverrunSeconds: what the shutdown may take after "stop now"


def _hung_call_and_stop_now(start_server, name):
    """A server with a launch that never completes (the CPU backend's fault-injection hang stands in for a hung GPU
    kernel) and a grace period far longer than any test, SIGTERM, then SIGTERM again once the drain began: the
    server, and the time of the second signal."""
    server = start_server("--enable_fault_injection", "--shutdown_grace_seconds=600", "--worker_threads=1",
                          name=name)
    q = np.zeros((1, 8, 2, 64), np.float16)

    def call():
        try:
            with flashserve.Client(server.address, timeout=900) as c:
                c.attention(q, q, q, request_id=HANG_ID)
        except BaseException:  # noqa: BLE001 - the hung call fails or never returns; either is fine here
            pass

    threading.Thread(target=call, daemon=True).start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _inflight(server) < 1:
        time.sleep(0.01)
    assert _inflight(server) >= 1, f"the hanging request never arrived\n{server.logs()}"
    server.proc.send_signal(signal.SIGTERM)
    assert _wait_for_log(server, "SIGTERM received: draining"), f"no drain after SIGTERM\n{server.logs()}"
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)
    second = time.monotonic()
    assert _wait_for_log(server, "received: stopping now", timeout=15), f"no stop after SIGTERM\n{server.logs()}"
    return server, second


def test_stop_now_bounds_a_launch_that_never_completes(start_server):
    """The second signal ended the drain's wait, but gRPC's Shutdown and the teardown then waited for the hung launch
    until the watchdog armed before the drain -- grace period + 20 s (up to a day) -- and no further signal was
    taken (audit). Now "stop now" brings the watchdog forward: the process exits 3 (restart me) within 20 s of the
    second signal, not 620 s after the first."""
    server, second = _hung_call_and_stop_now(start_server, "stop_now_hung")
    code, _ = _wait_exit(server, OVERRUN_S + 25)  # generous under ASan; the old binary ran to 620 s
    took = time.monotonic() - second
    logs = server.logs(limit=100_000)
    print(f"exit {code} {took:.1f} s after the second signal (grace 600 s)")
    assert code == 3, f"exit code {code}\n{logs}"
    assert "shutdown still running" in logs, logs
    assert took < OVERRUN_S + 25, f"exited {took:.1f} s after the second signal\n{logs}"


def test_a_signal_after_stop_now_exits_at_once(start_server):
    """After "stop now" the teardown may still wait for a hung launch (up to 20 s); a third signal ends the process at
    once, exit 3 as for the watchdog's forced stop. The old binary took no signal after the second."""
    server, _ = _hung_call_and_stop_now(start_server, "third_signal")
    time.sleep(0.5)
    assert server.proc.poll() is None, f"exited before the third signal\n{server.logs()}"
    server.proc.send_signal(signal.SIGINT)
    code, took = _wait_exit(server, 10)
    logs = server.logs(limit=100_000)
    print(f"exit {code} {took:.2f} s after the third signal")
    assert code == 3, f"exit code {code}\n{logs}"
    assert took < 5, f"exited {took:.1f} s after the third signal\n{logs}"
    assert "SIGINT received again: exiting now" in logs, logs


def _run(flashserve_bin, *flags):
    return subprocess.run([str(flashserve_bin), "--backend=cpu", "--grpc_port=0", "--http_port=0",
                           "--metrics_port=0", *flags], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("flag", ["--kv_cache_bytes=9223372036854775807", "--host=999.1.1.1", "--host=192.0.2.1"],
                         ids=["kv_pool_unmappable", "host_unresolvable", "host_not_this_machine"])
def test_a_flag_value_the_server_cannot_use_exits_2_naming_it(flashserve_bin, flag):
    """README: exit 2 when a flag's value is refused, the message naming the flag. A KV pool too large to map exited 1
    (RESOURCE_EXHAUSTED), and a --host that does not resolve (or is not an address of this machine: 192.0.2.1 is
    TEST-NET-1) exited 1 with only gRPC's "Name or service not known"."""
    name, value = flag.split("=", 1)
    if flag == "--host=999.1.1.1":
        try:
            socket.getaddrinfo(value, None)
        except socket.gaierror as e:
            if e.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                pytest.skip(f"this machine's resolver cannot tell (a name that does not resolve: {e})")
        else:
            pytest.skip(f"{value} resolves on this machine?")
    r = _run(flashserve_bin, flag)
    assert r.returncode == 2, (flag, r.returncode, r.stderr[-3000:])
    assert any(name in line and "error" in line for line in r.stderr.splitlines()), r.stderr[-3000:]


def test_a_port_in_use_exits_1(flashserve_bin):
    """A port another process holds is the environment's problem, not the flag's: exit 1 ("cannot start")."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = _run(flashserve_bin, "--host=127.0.0.1", f"--grpc_port={port}")
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert "cannot listen" in r.stderr, r.stderr[-3000:]
