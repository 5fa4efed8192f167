"""What an operator's environment does to the server (session 42's audit; each test fails on the previous server): a
log pipe whose reader goes away, files a flag names that are devices, FIFOs or directories, a TLS pair gRPC refuses,
and file descriptors that run out under gRPC's listener."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import flashserve
from conftest import free_port

pytestmark = pytest.mark.e2e


def _ports():
    return [f"--grpc_port={free_port()}", f"--http_port={free_port()}", f"--metrics_port={free_port()}"]


def _wait_ready(http: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited {proc.returncode}"
        try:
            with urllib.request.urlopen(f"{http}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.05)
    pytest.fail("the server did not become ready")


def test_a_log_pipe_whose_reader_left_costs_log_lines_not_the_process(flashserve_bin):
    """stdout/stderr into a pipe whose reader exits (a crashed log shipper, `| head`): SIGPIPE killed the server at
    the next line a gRPC thread wrote (exit 141), and a SIGTERM drain died the same way instead of exiting 0."""
    ports = _ports()
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([str(flashserve_bin), "--backend=cpu", "--shutdown_grace_seconds=5", *ports],
                            stdout=write_end, stderr=write_end)
    os.close(write_end)
    http = f"http://127.0.0.1:{ports[1].split('=')[1]}"
    try:
        _wait_ready(http, proc)
        os.close(read_end)  # the reader goes away
        q = np.zeros((1, 8, 2, 64), np.float16)
        bad_k = np.zeros((1, 8, 2, 32), np.float16)
        with flashserve.Client(f"127.0.0.1:{ports[0].split('=')[1]}", timeout=30) as client:
            for _ in range(5):  # each failure is logged (a warning) from a gRPC thread
                with pytest.raises(flashserve.FlashserveError):
                    client.attention(q, bad_k, bad_k)
            assert client.attention(q, q, q).shape == q.shape
        assert proc.poll() is None, f"the server died writing its log: exit {proc.returncode}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "the drain's log line killed it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", ["device", "fifo", "directory"])
@pytest.mark.parametrize("flag", ["--auth_token_file", "--tls_cert", "--flagfile"])
def test_a_flag_file_that_is_not_a_small_regular_file_exits_2(flashserve_bin, tmp_path, kind, flag):
    """/dev/zero filled memory at ~1 GiB/s and a FIFO without a writer hung the start, both deaf to SIGTERM (the
    shutdown signals are blocked from the start); a directory read as an empty token. Now exit 2 at once, naming the
    flag. --flagfile (Abseil's, session 47's audit): a directory or a file it could not finish left the server on its
    defaults -- auth off, default ports -- without a word; a FIFO or /dev/zero held the start forever."""
    if kind == "device":
        path = "/dev/zero"
    elif kind == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    else:
        path = str(tmp_path)
    args = [f"{flag}={path}"] + (["--tls_key=/dev/null"] if flag == "--tls_cert" else [])
    proc = subprocess.run([str(flashserve_bin), "--backend=cpu", *args, *_ports()], capture_output=True, text=True,
                          timeout=20)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-1000:])
    assert f"{flag}: {path} is not a regular file" in proc.stderr, proc.stderr[-1000:]


def test_a_flag_file_given_as_the_next_argument_is_checked_too(flashserve_bin, tmp_path):
    proc = subprocess.run([str(flashserve_bin), "--flagfile", str(tmp_path), "--backend=cpu", *_ports()],
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2 and f"--flagfile: {tmp_path} is not a regular file" in proc.stderr, proc.stderr


def test_an_empty_token_in_the_environment_exits_2(flashserve_bin):
    """FLASHSERVE_AUTH_TOKEN set but empty (a Kubernetes secret that resolved to nothing) served with auth off and no
    warning, while a one-space token was refused as too short. Now exit 2, saying how to serve without a token."""
    env = dict(os.environ, FLASHSERVE_AUTH_TOKEN="")
    proc = subprocess.run([str(flashserve_bin), "--backend=cpu", *_ports()], capture_output=True, text=True,
                          timeout=20, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-1000:])
    assert "FLASHSERVE_AUTH_TOKEN is set but empty" in proc.stderr, proc.stderr[-1000:]


def test_a_tls_pair_grpc_refuses_exits_2_naming_the_flags(flashserve_bin, tmp_path):
    """A certificate and a key that do not match (or an encrypted key, or garbage) made gRPC refuse the port: exit
    1 and "cannot listen on", read as a port conflict. The port was free: exit 2 naming --tls_cert / --tls_key."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    for name in ("a", "b"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=x",
                        "-keyout", str(tmp_path / f"{name}.key"), "-out", str(tmp_path / f"{name}.pem")],
                       check=True, capture_output=True)
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    for cert, key in (("a.pem", "b.key"), ("garbage.pem", "a.key")):
        proc = subprocess.run([str(flashserve_bin), "--backend=cpu", f"--tls_cert={tmp_path / cert}",
                               f"--tls_key={tmp_path / key}", *_ports()], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2, (cert, key, proc.returncode, proc.stderr[-1500:])
        assert "--tls_cert / --tls_key" in proc.stderr, proc.stderr[-1500:]


@pytest.mark.parametrize("name", ["a b", "a/b", "a%2Fb", "a\x1b[31mred", "caf\u00e9", "..", "m" * 257, "m" * 3000])
def test_a_model_name_a_url_cannot_carry_exits_2(flashserve_bin, name):
    """--model_name took any bytes at any length: one over ~2 KiB made /v2/models/<name> answer 414 (the model was
    unreachable over REST while the server said ready), a space or '/' needed percent-encoding or split the path, and
    control bytes reached the log and the metric labels. Now exit 2, naming the flag and the rule, not echoing it."""
    proc = subprocess.run([str(flashserve_bin), "--backend=cpu", f"--model_name={name}", *_ports()],
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-1000:])
    line = next((x for x in proc.stderr.splitlines() if "--model_name" in x), "")
    assert "letters, digits, '_', '-' and '.'" in line, proc.stderr[-1000:]
    assert "\x1b" not in proc.stderr and "m" * 257 not in proc.stderr, proc.stderr[-1000:]


def test_the_longest_model_name_is_served_over_rest(flashserve_bin):
    name = "m" * 256
    ports = _ports()
    http = f"http://127.0.0.1:{ports[1].split('=')[1]}"
    proc = subprocess.Popen([str(flashserve_bin), "--backend=cpu", f"--model_name={name}", *ports],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(http, proc)
        with urllib.request.urlopen(f"{http}/v2/models/{name}/versions/1/ready", timeout=10) as r:
            assert r.status == 200
    finally:
        proc.kill()
        proc.wait()


def _physical_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("claim", [1 << 60, "twice physical memory"])
def test_a_kv_cache_larger_than_the_host_exits_2(flashserve_bin, claim):
    """The CPU backend maps its KV pool lazily (MAP_NORESERVE): a pool past physical memory (or the cgroup's
    memory.max) that the address space holds was accepted, and the OOM killer ended the process once sequences filled
    it. Now exit 2 at startup naming the flag, the claim and the bound. (1 << 60 was refused before too, by mmap.)"""
    if claim == "twice physical memory":
        claim = 2 * _physical_memory_bytes()
    start = time.monotonic()
    proc = subprocess.run([str(flashserve_bin), "--backend=cpu", f"--kv_cache_bytes={claim}", *_ports()],
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-1000:])
    assert time.monotonic() - start < 10
    line = next((x for x in proc.stderr.splitlines() if f"--kv_cache_bytes={claim} (" in x), "")
    assert "is more memory than this host has: " in line and " bytes (" in line, proc.stderr[-1000:]
    bound = int(line.rsplit(" is ", 1)[1].split(" bytes")[0])
    assert 0 < bound <= _physical_memory_bytes() < claim, line


def test_descriptors_that_ran_out_under_grpc_end_in_a_restart(flashserve_bin):
    """gRPC 1.51's listener stops for good at an accept error such as EMFILE: the port took no connection again,
    while /v2/health/live and ready said 200 and the process ran on (a Kubernetes pod stayed Ready, serving nothing).
    Now the process reports not live and exits 3 after the grace period, for its supervisor to restart it."""
    ports = _ports()
    grpc_port, http_port = int(ports[0].split("=")[1]), int(ports[1].split("=")[1])

    # util-linux's prlimit sets the limit and execs the server (same pid); a preexec_fn would run Python in a fork of
    # this process, whose gRPC threads may be busy (such a fork once never became a ready server: session 45).
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("no prlimit (util-linux) on this machine")
    proc = subprocess.Popen([prlimit, "--nofile=64:64", str(flashserve_bin), "--backend=cpu",
                             "--shutdown_grace_seconds=2", *ports],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(f"http://127.0.0.1:{http_port}", proc)
        held = []
        for _ in range(100):
            try:
                held.append(socket.create_connection(("127.0.0.1", grpc_port), timeout=2))
            except OSError:
                break
        time.sleep(1.5)
        for s in held:
            s.close()
        code = proc.wait(timeout=20)
        stderr = proc.stderr.read()
        assert code == 3, (code, stderr[-2000:])
        assert "gRPC stopped accepting connections" in stderr, stderr[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
