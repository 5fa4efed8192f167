"""A shutdown signal during startup (README "Exit codes"). The shutdown signals are blocked from the start of main so
that the serve loop can take them later, and until startup finished nothing took them: a start held by a DNS lookup
for --host, a GPU's initialisation or a listener's bind ignored `kill -TERM` (what Docker and Kubernetes send) until
the supervisor's SIGKILL. Now such a signal ends the process within a second, exit 0, logging why; once serving, the
drain is as before.

The start is held with the TEST ONLY hook $FLASHSERVE_TEST_HOLD_STARTUP_MS (honoured only with
--enable_fault_injection; server/config/server.cc): a sleep deaf to signals after the gRPC listener started, with
the backend's, scheduler's and gRPC's threads running, as a hang would be."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conftest import free_port

pytestmark = pytest.mark.e2e

HOLD_LINE = "holding the start for"


@pytest.fixture(autouse=True)
def sighup_not_ignored():
    """As in test_signals_exit_codes.py: a test run under nohup would pass an ignored SIGHUP on to the servers."""
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, before)


def _start_held(flashserve_bin, tmp_path, hold_ms: int, name: str):
    """A CPU server whose start is held for `hold_ms` once its gRPC listener runs: (process, its log file), after
    the hold began."""
    log = tmp_path / f"{name}.log"
    args = [str(flashserve_bin), "--backend=cpu", "--host=127.0.0.1", "--enable_fault_injection",
            f"--grpc_port={free_port()}", f"--http_port={free_port()}", f"--metrics_port={free_port()}"]
    env = dict(os.environ, FLASHSERVE_TEST_HOLD_STARTUP_MS=str(hold_ms))
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 30
    while HOLD_LINE not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"the start was never held (exit {proc.returncode})\n{log.read_text(errors='replace')}")
        time.sleep(0.02)
    return proc, log


def _wait_exit(proc, log, timeout: float):
    """(exit code, seconds waited); kills the process and fails if it is still running after `timeout`."""
    started = time.monotonic()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running {timeout} s after the signal\n{log.read_text(errors='replace')[-4000:]}")
    return code, time.monotonic() - started


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_during_a_held_startup_ends_it_within_a_second(flashserve_bin, tmp_path, sig):
    """A start held for 10 minutes: the signal ends it about 0.5 s later (startup work that polls for it gets that
    long to unwind; a hang does not), exit 0 as after a drain, with a line naming the signal. The old server sat out
    the whole hold, then drained."""
    proc, log = _start_held(flashserve_bin, tmp_path, 600_000, name=f"held_{sig.name}")
    proc.send_signal(sig)
    code, took = _wait_exit(proc, log, 15)
    text = log.read_text(errors="replace")
    print(f"{sig.name} during startup: exit {code} after {took:.2f} s")
    assert code == 0, f"exit code {code}\n{text[-4000:]}"
    assert took < 3, f"exited {took:.1f} s after {sig.name}\n{text[-4000:]}"
    assert f"{sig.name} received during startup" in text, text[-4000:]
    assert "startup still running" in text and "exiting now with code 0" in text, text[-4000:]
    assert "serving:" not in text and "draining" not in text, text[-4000:]


def test_a_signal_during_startup_that_finishes_meanwhile_drains(flashserve_bin, tmp_path):
    """A start held briefly (200 ms, inside the 0.5 s a start gets to wind down): the signal is taken during
    startup, startup completes, and the signal is handed to the serve loop, which drains as for any signal and exits
    0 -- the server may already have accepted connections, so it must not just vanish."""
    proc, log = _start_held(flashserve_bin, tmp_path, 200, name="held_briefly")
    proc.send_signal(signal.SIGTERM)
    code, took = _wait_exit(proc, log, 30)
    text = log.read_text(errors="replace")
    assert code == 0, f"exit code {code}\n{text[-4000:]}"
    assert "SIGTERM received during startup" in text, text[-4000:]
    assert "serving:" in text and "SIGTERM received: draining" in text, text[-4000:]
    assert "startup still running" not in text, text[-4000:]
