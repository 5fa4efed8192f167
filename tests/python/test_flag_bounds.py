"""Flag values at the ends of their ranges, end to end on the CPU backend. Each of these once started a server that
said it was serving and was not:

* --http_max_header_bytes near INT_MAX: libmicrohttpd's pool size (+ 16 KiB) overflowed int, every HTTP and metrics
  request got an empty reply; --http_idle_timeout_s >= 4294968: libmicrohttpd's 32-bit milliseconds wrapped to
  ~0.7 s; --worker_threads=100000: std::system_error ended the process; --grpc_memory_quota_bytes=1: ready, and every
  gRPC call failed with "Buffers full". Now each is refused at startup (exit 2) with a message naming the flag.
* --sequence_ttl_s huge ("forever"): the TTL sweeper's wait overflowed the steady clock and it spun on a core.
"""

import os
import socket
import subprocess
import time

import numpy as np
import pytest

import flashserve
from conftest import free_port, http_get

EXIT_BAD_CONFIG = 2


@pytest.mark.parametrize("flags, named", [
    (["--http_max_header_bytes=2147467264"], ["--http_max_header_bytes"]),
    (["--http_idle_timeout_s=4294968"], ["--http_idle_timeout_s"]),
    (["--http_body_timeout_s=86401"], ["--http_body_timeout_s"]),
    (["--worker_threads=100000"], ["--worker_threads"]),
    (["--grpc_memory_quota_bytes=1"], ["--grpc_memory_quota_bytes", "--max_request_bytes"]),
])
def test_out_of_range_flag_is_refused_at_startup(flashserve_bin, tmp_path, flags, named):
    args = [str(flashserve_bin), "--backend=cpu", "--host=127.0.0.1", f"--grpc_port={free_port()}",
            f"--http_port={free_port()}", f"--metrics_port={free_port()}", *flags]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(flags)} was accepted: the server was still running after 15 s\n"
                    f"{out.decode(errors='replace')[-3000:]}")
    text = out.decode(errors="replace")
    assert proc.returncode == EXIT_BAD_CONFIG, f"{' '.join(flags)}: exit code {proc.returncode}\n{text[-3000:]}"
    for name in named:
        assert name in text, f"{' '.join(flags)}: the refusal does not name {name}\n{text[-3000:]}"


def test_largest_accepted_values_serve(start_server):
    """The ends of the new ranges: HTTP answers, an idle connection outlives the ~0.7 s a wrapped timeout gave,
    gRPC calls get through at the smallest explicit quota."""
    server = start_server("--http_max_header_bytes=1048576", "--http_idle_timeout_s=86400",
                          "--http_header_timeout_s=86400", "--http_body_timeout_s=86400", "--worker_threads=1024",
                          "--max_request_bytes=1048576", f"--grpc_memory_quota_bytes={(1 << 20) + (4 << 20)}",
                          name="largest")
    assert http_get(f"{server.http}/v2/health/ready")[0] == 200
    assert http_get(f"http://127.0.0.1:{server.metrics_port}/metrics")[0] == 200
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=5) as idle:
        time.sleep(2.0)
        idle.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = idle.recv(4096)
    assert reply.startswith(b"HTTP/1.1 200"), f"an idle connection was closed within 2 s: {reply!r}"
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1300, 2, 32)).astype(np.float32)  # ~1 MB of q, k and v: near the limit
    with flashserve.Client(server.address, timeout=60) as client:
        for _ in range(2):
            out = client.attention(q, q, q)
            assert np.asarray(out).shape[1] == 1300


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (fields 14 and 15, after the ')' of the name)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("ttl_s", ["9223372036854775807", "100000000000"])
def test_huge_sequence_ttl_does_not_spin(start_server, ttl_s):
    """An idle server with a TTL of 'forever' uses (almost) no CPU; the sweeper spun on a whole core."""
    server = start_server("--kv_cache_bytes=4194304", f"--sequence_ttl_s={ttl_s}", name="ttl_forever")
    time.sleep(0.5)  # past startup
    before = cpu_seconds(server.proc.pid)
    time.sleep(2.0)
    used = cpu_seconds(server.proc.pid) - before
    assert used < 0.3, f"--sequence_ttl_s={ttl_s}: the idle server used {used:.2f} s of CPU in 2 s"
    assert server.stop() == 0
