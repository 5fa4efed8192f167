"""The HTTP ports against hostile clients (issue 17 items 1, 2 and 7; issue 16's HTTP middleware).

(a) 1,000 slow or idle connections on the HTTP port and 1,000 on the metrics port: health and /metrics still answer
    within 100 ms p99 (over fresh connections, measured and printed), and inference over other connections is right.
(b) 80 concurrent hostile uploads (oversized binary_data_size claims, trickled bodies, JSON bombs, chunked bodies
    with a lying Inference-Header-Content-Length, valid bodies over the receive budget): each refused with its
    status (a trickled body is cut off at --http_body_timeout_s), none crashes the server, and its peak RSS (VmHWM)
    stays under a bound derived from the flags.
(c) A bearer token containing '%' works over HTTP (header values are never percent-decoded).
Plus the header limits (count, size) and the header timeout.
"""

from __future__ import annotations

import http.client
import json
import resource
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import free_port
from flashserve import reference

pytestmark = pytest.mark.e2e

SLOW_PER_PORT = 1000
MiB = 1 << 20


def raise_open_file_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"open-file hard limit {hard} < {need}: raise ulimit -Hn to run this test")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def status_of(sock: socket.socket, timeout: float = 30.0) -> int:
    """The status code of the response on `sock` (0 if the server closed without one)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    if not data.startswith(b"HTTP/1."):
        return 0
    return int(data.split(b" ", 2)[1])


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def json_infer(server, rng):
    q = rng.standard_normal((1, 7, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 5, 2, 16)).astype(np.float32)
    v = rng.standard_normal((1, 5, 2, 16)).astype(np.float32)
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
                       for n, x in (("Q", q), ("K", k), ("V", v))]}
    r = requests.post(f"{server.http}/v2/models/attention/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text[:300]
    out = np.array(r.json()["outputs"][0]["data"], dtype=np.float64).reshape(q.shape)
    want = reference.attention(q, k, v)
    assert not np.isnan(out).any()
    assert np.abs(out - want).max() < 1e-5


def latencies(port: int, path: str, n: int) -> np.ndarray:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        conn.close()
        times.append(time.perf_counter() - start)
        assert response.status == 200, (path, response.status)
    return np.array(times)


def test_slow_and_idle_connections_do_not_starve_health_or_metrics(start_server, rng):
    raise_open_file_limit(4 * SLOW_PER_PORT + 512)
    server = start_server("--http_header_timeout_s=300", "--http_idle_timeout_s=300")
    held = []
    try:
        for port in (server.http_port, server.metrics_port):
            for i in range(SLOW_PER_PORT):
                s = connect(port)
                if i % 2 == 0:  # a slowloris: half a header line, then nothing
                    s.sendall(b"GET / HTTP/1.1\r\nX: ")
                else:  # an idle keep-alive connection after one answered request
                    s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                held.append((s, i % 2 == 1))
        for s, answered in held:
            if answered:
                assert status_of(s) in (200, 404)
        time.sleep(0.5)
        results = {}
        for port, path in ((server.http_port, "/v2/health/live"), (server.http_port, "/v2/health/ready"),
                           (server.metrics_port, "/metrics")):
            t = latencies(port, path, 200)
            results[path] = t
            print(f"{path} with {SLOW_PER_PORT} slow/idle connections on its port: "
                  f"p50 {np.percentile(t, 50) * 1e3:.2f} ms, p99 {np.percentile(t, 99) * 1e3:.2f} ms, "
                  f"max {t.max() * 1e3:.2f} ms (200 fresh connections)")
        for _ in range(3):
            json_infer(server, rng)
        for path, t in results.items():
            assert np.percentile(t, 99) < 0.100, f"{path}: p99 {np.percentile(t, 99) * 1e3:.1f} ms"
        # Every held connection is still open (none was dropped to make room).
        assert server.proc.poll() is None
    finally:
        for s, _ in held:
            s.close()


def test_headers_over_the_limits_are_refused(start_server):
    server = start_server("--http_max_header_bytes=4096")
    s = connect(server.http_port)
    s.sendall(b"GET /v2/health/live HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n")
    assert status_of(s) == 431
    s.close()
    s = connect(server.http_port)
    s.sendall(b"GET /v2/health/live HTTP/1.1\r\nX-Big: " + b"a" * 64000 + b"\r\n\r\n")
    assert status_of(s) in (431, 0)  # libmicrohttpd answers 431 or closes once its buffer is full
    s.close()
    assert requests.get(f"{server.http}/v2/health/live", timeout=5).status_code == 200


def test_header_timeout_closes_a_slowloris(start_server):
    server = start_server("--http_header_timeout_s=1", "--http_idle_timeout_s=30")
    s = connect(server.http_port)
    s.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
    start = time.monotonic()
    s.settimeout(10)
    try:
        while True:  # trickle a header byte at a time, faster than the idle timeout
            s.sendall(b"X")
            time.sleep(0.2)
            if time.monotonic() - start > 8:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    elapsed = time.monotonic() - start
    s.close()
    assert elapsed < 4, f"a trickled header kept its connection for {elapsed:.1f} s (header timeout 1 s)"


# --- (b) hostile uploads --------------------------------------------------------------------------------------------

HOSTILE_FLAGS = {
    "max_request_bytes": 256 * MiB,
    "http_max_receive_bytes": 128 * MiB,
    "http_max_json_bytes": 1 * MiB,
    "http_body_timeout_s": 3,
    "http_idle_timeout_s": 10,
    "max_tensor_elements": 32 * MiB,
}
LISTENER_THREADS = 4  # HttpOptions.threads: JSON headers under INLINE_PARSE_BYTES are parsed on these
PARSE_THREADS = 2  # kserve_rest.cc's kParseThreads: larger headers are parsed on these, one at a time each
INLINE_PARSE_BYTES = 256 << 10  # infer_body.h's kInlineJsonParseBytes


# Peak RSS of a JSON header's DOM per byte of its text, the worst the scan lets through (measured on the CPU build,
# 15 MiB bodies: nested empty arrays 27.6x, numbers 17.4x, strings and objects capped by count).
JSON_DOM_PER_TEXT = 28


def rss_bound_kib(base_kib: int, connections: int) -> int:
    """What the flags let the HTTP edge hold at once, on top of the idle server:
    - request-body bytes (JSON text and binary inputs, allocated only after validation): --http_max_receive_bytes;
    - JSON headers being parsed (json_dom_bytes): one per parse thread of at most --http_max_json_bytes of text and
      one per listener thread under INLINE_PARSE_BYTES, each DOM at most JSON_DOM_PER_TEXT times its text
      (server/edge/http/README.md);
    - per connection: the header pool (--http_max_header_bytes + 16 KiB) and socket buffers (say 64 KiB);
    - 64 MiB for the allocator's slack and thread stacks."""
    f = HOSTILE_FLAGS
    held = f["http_max_receive_bytes"] + json_dom_bytes()
    held += connections * ((16 << 10) + (16 << 10) + (64 << 10)) + 64 * MiB
    return base_kib + held // 1024


def json_dom_bytes() -> int:
    """The most the JSON DOMs being built at once can hold under HOSTILE_FLAGS (rss_bound_kib's second term)."""
    text = HOSTILE_FLAGS["http_max_json_bytes"]
    return JSON_DOM_PER_TEXT * (PARSE_THREADS * text + LISTENER_THREADS * min(text, INLINE_PARSE_BYTES))


def binary_header(shapes, sizes, dtype="FP32", parameters=None):
    header = {"inputs": [
        {"name": n, "datatype": dtype, "shape": shape, "parameters": {"binary_data_size": size}}
        for n, shape, size in zip("QKV", shapes, sizes)]}
    if parameters:
        header["parameters"] = parameters
    return json.dumps(header).encode()


def post_head(path, headers, content_length=None, chunked=False):
    lines = [f"POST {path} HTTP/1.1", "Host: x"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


INFER = "/v2/models/attention/infer"


def oversized_claim(port, i, auth=()):
    """Three 256 MiB inputs claimed by Content-Length (413 before any body byte is read), or three 60 MiB inputs
    with a body that does not hold them (400: the sizes do not add up; nothing allocated)."""
    header = binary_header([[1, 8192, 32, 256]] * 3, [256 * MiB] * 3)
    s = connect(port)
    if i % 2 == 0:
        s.sendall(post_head(INFER, {**dict(auth), "Inference-Header-Content-Length": len(header)},
                            content_length=len(header) + 3 * 256 * MiB) + header)
        want = {413}
    else:
        header = binary_header([[1, 3840, 32, 128]] * 3, [60 * MiB] * 3)
        s.sendall(post_head(INFER, {**dict(auth), "Inference-Header-Content-Length": len(header)},
                            content_length=len(header) + 10) + header + b"x" * 10)
        want = {400}
    return s, want


TRICKLE_Q = [1, 1280, 32, 128]  # FP32: 20 MiB
TRICKLE_KV = [1, 640, 32, 128]  # 10 MiB each
TRICKLE_SIZES = [int(np.prod(TRICKLE_Q)) * 4] + [int(np.prod(TRICKLE_KV)) * 4] * 2
ZEROS = bytes(max(TRICKLE_SIZES))


def valid_claim(port, wrong_shape=False, auth=()):
    if wrong_shape:  # K's shape does not match its binary_data_size: 400 before anything is allocated
        header = binary_header([TRICKLE_Q, [1, 640, 32, 64], TRICKLE_KV], TRICKLE_SIZES)
    else:
        # A 1 us deadline: an admitted request expires in the queue (504), so no compute memory muddies the bound.
        # Binary output: its 20 MiB count in the budget from the header on (a JSON O would count 48 B per element).
        header = binary_header([TRICKLE_Q, TRICKLE_KV, TRICKLE_KV], TRICKLE_SIZES,
                               parameters={"timeout": 1, "binary_data_output": True})
    s = connect(port)
    s.sendall(post_head(INFER, {**dict(auth), "Inference-Header-Content-Length": len(header)},
                        content_length=len(header) + sum(TRICKLE_SIZES)) + header)
    return s


def over_budget(port, i, auth=()):
    """40 MiB of valid inputs (and a 20 MiB binary answer) at full speed, 16 at once: the receive budget (128 MiB)
    admits two at a time (they expire in the queue: 504), the others get 503 (retry later) without their tensors being
    allocated; a wrong shape gets 400."""
    s = valid_claim(port, wrong_shape=(i % 4 == 3), auth=auth)
    try:
        for size in TRICKLE_SIZES:
            s.sendall(memoryview(ZEROS)[:size])
    except (BrokenPipeError, ConnectionResetError):
        pass
    return s, ({400} if i % 4 == 3 else {504, 503})


def trickled_body(port, i, auth=()):
    """Valid shapes, 40 MiB claimed, then one byte every 0.3 s: cut off at --http_body_timeout_s (0: closed
    without an answer; libmicrohttpd answers only before or after a body). Checked for the time it took."""
    return valid_claim(port, auth=auth), {0}


def json_bomb(port, i, auth=()):
    """Deep nesting (400 before any DOM is built), a 2 MiB array by Content-Length (413 before it is read) and a
    chunked one (413: --http_max_json_bytes)."""
    s = connect(port)
    if i % 3 == 0:
        body = b'{"inputs":' + b"[" * 200000 + b"]" * 200000 + b"}"
        s.sendall(post_head(INFER, {**dict(auth), "Content-Type": "application/json"}, content_length=len(body)) + body)
        want = {400, 413}  # 400k bytes: under the JSON limit, refused for its depth
    elif i % 3 == 1:
        body = b'{"inputs":[{"name":"Q","datatype":"FP32","shape":[1],"data":[' + b"0," * MiB + b"0]}]}"
        s.sendall(post_head(INFER, {**dict(auth), "Content-Type": "application/json"}, content_length=len(body)))
        try:
            s.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        want = {413}
    else:  # chunked, 2 MiB: refused once it passes the limit, answered when it ends
        s.sendall(post_head(INFER, {**dict(auth), "Content-Type": "application/json"}, chunked=True))
        try:
            for _ in range(64):
                s.sendall(chunk(b"[" + b"1," * 16383 + b"1]"))
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        want = {413}
    return s, want


def lying_chunked(port, i, auth=()):
    """Chunked bodies whose Inference-Header-Content-Length lies: 2^40 (413 at once, nothing reserved) or longer
    than the JSON that follows (400 when the body ends inside the 'header')."""
    s = connect(port)
    if i % 2 == 0:
        s.sendall(post_head(INFER, {**dict(auth), "Inference-Header-Content-Length": 1 << 40}, chunked=True))
        want = {413}
    else:
        header = binary_header([[1, 4, 2, 16]] * 3, [512] * 3)
        s.sendall(post_head(INFER, {**dict(auth), "Inference-Header-Content-Length": len(header) + 5000}, chunked=True)
                  + chunk(header) + b"0\r\n\r\n")
        want = {400}
    return s, want


def trickle_until_answered(s: socket.socket, seconds: float) -> None:
    """One body byte every 0.3 s until the server answers or closes, or `seconds` pass."""
    stop = time.monotonic() + seconds
    s.setblocking(False)
    while time.monotonic() < stop:
        try:
            s.send(b"\0")
        except BlockingIOError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            break
        try:
            if s.recv(1, socket.MSG_PEEK):
                break
        except BlockingIOError:
            pass
        except ConnectionResetError:
            break
        time.sleep(0.3)
    s.setblocking(True)


def run_upload(kind, port, i, auth=()):
    """One hostile upload of `kind`: (kind name, status got, statuses wanted). A trickled body must be cut off no
    sooner than --http_body_timeout_s (else its 'status' says how soon it was)."""
    begin = time.monotonic()
    s, want = kind(port, i, auth=auth)
    if kind is trickled_body:
        trickle_until_answered(s, 8)
    got = status_of(s, timeout=20)
    s.close()
    elapsed = time.monotonic() - begin
    if kind is trickled_body and elapsed < HOSTILE_FLAGS["http_body_timeout_s"] - 0.5:
        got = f"cut off after {elapsed:.1f} s"
    return kind.__name__, got, want


def test_hostile_uploads_are_refused_within_a_memory_bound(start_server, rng):
    raise_open_file_limit(1024)
    server = start_server(*[f"--{k}={v}" for k, v in HOSTILE_FLAGS.items()])
    pid = server.proc.pid
    json_infer(server, rng)  # warm: the idle server's RSS includes one answered request
    base = rss_kib(pid, "VmRSS")
    kinds = [oversized_claim, trickled_body, json_bomb, lying_chunked, over_budget]
    n = 80  # 16 of each
    results = [None] * n
    started = threading.Barrier(n)

    def attack(i):
        started.wait()
        results[i] = run_upload(kinds[i % len(kinds)], server.http_port, i // len(kinds))

    threads = [threading.Thread(target=attack, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert server.proc.poll() is None, server.logs()
    peak = rss_kib(pid, "VmHWM")
    bound = rss_bound_kib(base, n)
    print(f"hostile uploads: RSS before {base / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB, "
          f"bound {bound / 1024:.0f} MiB")
    wrong = [r for r in results if r is None or r[1] not in r[2]]
    assert not wrong, wrong
    assert peak < bound, f"peak RSS {peak} KiB over the bound {bound} KiB"
    json_infer(server, rng)  # still serving


# --- (c) a token containing '%' ----------------------------------------------------------------------------------


def test_token_with_percent_works_over_http(start_server, tmp_path):
    token = "abc%41def%zz-0123456789"
    (tmp_path / "token").write_text(token + "\n")
    server = start_server(f"--auth_token_file={tmp_path / 'token'}")
    url = f"{server.http}/v2/models/attention"
    assert requests.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=5).status_code == 200
    decoded = token.replace("%41", "A")
    assert requests.get(url, headers={"Authorization": f"Bearer {decoded}"}, timeout=5).status_code == 401
    assert requests.get(url, timeout=5).status_code == 401
    metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
    assert requests.get(metrics, headers={"Authorization": f"Bearer {token}"}, timeout=5).status_code == 200


def test_claimed_inputs_cost_memory_only_as_they_arrive(start_server):
    """Issue 17's case with default flags: a 1 KB header claiming three valid 256 MiB inputs, then a trickle. The
    shapes are validated first; the inputs get capacity, not zero-filled bytes, so RSS follows what arrived."""
    server = start_server()
    pid = server.proc.pid
    base = rss_kib(pid, "VmRSS")
    shape = [1, 8192, 32, 256]  # FP32: 256 MiB each
    header = binary_header([shape] * 3, [256 * MiB] * 3)
    s = connect(server.http_port)
    s.sendall(post_head(INFER, {"Inference-Header-Content-Length": len(header)},
                        content_length=len(header) + 3 * 256 * MiB) + header)
    for _ in range(10):
        s.sendall(b"\0" * 1024)
        time.sleep(0.1)
    grown = rss_kib(pid, "VmRSS") - base
    s.close()
    print(f"RSS growth after a 768 MiB claim and 10 KiB of body: {grown / 1024:.1f} MiB")
    assert grown < 64 * 1024, f"RSS grew by {grown} KiB"
    assert requests.get(f"{server.http}/v2/health/live", timeout=5).status_code == 200


def test_a_trickled_claim_gives_its_receive_budget_back(start_server):
    """A KServe infer whose header claims 40 MiB of valid inputs holds that much of --http_max_receive_bytes (64 MiB
    here) from the header on. Trickled in (a byte every 0.3 s: under the idle timeout) it held it until
    --http_body_timeout_s (300 s), a few hundred bytes denying every large REST infer meanwhile (503). Now a body
    under --http_min_body_bytes_per_s on average 5 s after its headers is cut off, and the budget comes back."""
    server = start_server(f"--http_max_receive_bytes={64 * MiB}")

    def honest_status():
        s, _ = over_budget(server.http_port, 0)  # 40 MiB at full speed, a 1 us deadline: 504 once admitted
        got = status_of(s)
        s.close()
        return got

    slow = valid_claim(server.http_port)
    started = time.monotonic()
    time.sleep(0.5)
    assert honest_status() == 503, "the claim does not hold the budget: the test proves nothing"
    trickle_until_answered(slow, 30)
    held = time.monotonic() - started
    got = status_of(slow, timeout=5)
    slow.close()
    assert got == 0, got  # closed without an answer (libmicrohttpd answers only before or after a body)
    assert 4.5 < held < 12, f"the trickled claim was cut off after {held:.1f} s (floor from 5 s after its headers)"
    assert honest_status() == 504  # admitted: the budget came back


def test_token_is_checked_before_the_body_is_read(start_server, tmp_path):
    """A POST claiming 100 MiB without a token gets 401 at once: nothing of its body is waited for."""
    token = "token-0123456789abcdef"
    (tmp_path / "token").write_text(token)
    server = start_server(f"--auth_token_file={tmp_path / 'token'}")
    s = connect(server.http_port)
    start = time.monotonic()
    s.sendall(post_head(INFER, {}, content_length=100 * MiB))
    assert status_of(s, timeout=5) == 401
    assert time.monotonic() - start < 2
    s.close()


def test_connection_cap(start_server):
    """At --http_max_connections the server stops accepting: a further connection waits in the listen backlog,
    unanswered, while the held ones are busy (here: mid-body, their bodies arriving over the rate floor); once one
    closes it is served."""
    server = start_server("--http_max_connections=20", "--http_min_body_bytes_per_s=1")
    held = [connect(server.http_port) for _ in range(20)]
    for s in held:
        s.sendall(post_head(INFER, {}, content_length=4096) + b"x" * 512)  # not idle: a body under way
    time.sleep(1.5)  # past the eviction's 0.5 s: connections making progress are never evicted
    extra = connect(server.http_port)
    extra.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    extra.settimeout(1.0)
    with pytest.raises(socket.timeout):
        extra.recv(1)
    held.pop().close()
    assert status_of(extra, timeout=5) == 200
    extra.close()
    for s in held:
        s.close()


def _closed_by_server(sockets) -> int:
    closed = 0
    for s in sockets:
        s.settimeout(0.01)
        try:
            closed += s.recv(1) == b""
        except (socket.timeout, BlockingIOError):
            pass
        except ConnectionResetError:
            closed += 1
        s.close()
    return closed


@pytest.mark.parametrize("stall", ["headers", "body"])
def test_stalled_requests_at_the_cap_make_room_for_health(start_server, stall):
    """One client holding the connection cap with requests that make no progress -- complete POST headers and then
    no body byte (evicted nowhere: liveness probes failed for the 30 s idle timeout, audit), or headers never
    finished (a slowloris) -- kept /v2/health/live unanswered. At the cap, after half a second without progress,
    they are closed like idle ones: a probe over a new connection is answered."""
    server = start_server("--http_max_connections=32", "--http_header_timeout_s=30")
    head = post_head(INFER, {}, content_length=MiB) if stall == "body" else b"POST /v2/models/attention/infer HTTP/1.1\r\n"
    held = [connect(server.http_port) for _ in range(32)]
    for s in held:
        s.sendall(head)
    time.sleep(0.7)
    start = time.monotonic()
    probe = connect(server.http_port)
    probe.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(probe, timeout=10) == 200
    waited = time.monotonic() - start
    probe.close()
    assert waited < 3, f"probe answered after {waited:.2f} s at the cap"
    assert 1 <= _closed_by_server(held) < 32  # room made; not every connection dropped


def test_a_body_that_never_starts_is_cut_off_at_the_rate_floor(start_server):
    """--http_min_body_bytes_per_s cut a slow body off only when a piece of it arrived: complete headers and then
    silence held the connection (and its slot) until the idle timeout. Now the floor holds from 5 s after the
    headers whether or not a byte came."""
    server = start_server("--http_idle_timeout_s=60")
    s = connect(server.http_port)
    start = time.monotonic()
    s.sendall(post_head(INFER, {}, content_length=MiB))
    assert status_of(s, timeout=20) == 0  # closed, no answer
    held = time.monotonic() - start
    s.close()
    assert 4.5 < held < 8, f"a body that never started held its connection {held:.1f} s (floor from 5 s)"


def test_idle_connections_at_the_cap_make_room_for_health(start_server):
    """Idle connections held by one client filled --http_max_connections and /v2/health/ready went unanswered (a
    liveness probe failing means a restart). At the cap the ones idle longest are closed (as nginx does with
    keep-alive connections): a probe over a new connection is answered within a second or so, and a client whose
    idle connection was closed just reconnects."""
    server = start_server("--http_max_connections=32")
    held = [connect(server.http_port) for _ in range(32)]  # opened, never sent anything
    time.sleep(0.2)
    start = time.monotonic()
    probe = connect(server.http_port)
    probe.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(probe, timeout=10) == 200
    waited = time.monotonic() - start
    print(f"probe answered after {waited:.2f} s at the cap")
    assert waited < 3, waited
    probe.close()
    assert 1 <= _closed_by_server(held) < 32  # the longest idle made room; not every connection was dropped


def test_health_answers_while_every_inference_computes(start_server, rng):
    """REST inferences that keep the workers busy wait suspended (no listener thread held): health and /metrics
    still answer. On a 2-core CI machine the compute takes the cores, hence the looser bound than (a)'s."""
    server = start_server("--queue_capacity=64")
    q = rng.standard_normal((1, 1024, 8, 64)).astype(np.float32)
    k = rng.standard_normal((1, 1024, 8, 64)).astype(np.float32)
    v = rng.standard_normal((1, 1024, 8, 64)).astype(np.float32)
    header = binary_header([list(q.shape)] * 3, [q.nbytes] * 3)
    body = header + q.tobytes() + k.tobytes() + v.tobytes()
    statuses = []
    stop = threading.Event()

    def infer():
        while not stop.is_set():
            try:
                r = requests.post(f"{server.http}{INFER}", data=body, timeout=120,
                                  headers={"Inference-Header-Content-Length": str(len(header))})
                statuses.append(r.status_code)
            except requests.RequestException as e:
                statuses.append(repr(e))

    threads = [threading.Thread(target=infer) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        live = latencies(server.http_port, "/v2/health/live", 50)
        scrape = latencies(server.metrics_port, "/metrics", 50)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    print(f"with 8 REST inferences computing: /v2/health/live p99 {np.percentile(live, 99) * 1e3:.1f} ms, "
          f"/metrics p99 {np.percentile(scrape, 99) * 1e3:.1f} ms")
    assert statuses and set(statuses) == {200}, statuses
    assert np.percentile(live, 99) < 0.5 and np.percentile(scrape, 99) < 0.5


def test_request_line_over_the_limit(start_server):
    """The request line and the headers share libmicrohttpd's per-connection pool of --http_max_header_bytes + 16 KiB
    (the headers alone are held to --http_max_header_bytes by the server): a request line longer than the pool gets
    414 (or 431, or the connection is closed once the buffer is full)."""
    server = start_server("--http_max_header_bytes=4096")
    s = connect(server.http_port)
    s.sendall(b"GET /v2/health/live?" + b"a" * (4096 + 16384 + 1000) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    got = status_of(s)
    s.close()
    assert got in (414, 431, 0), got
    assert requests.get(f"{server.http}/v2/health/live", timeout=5).status_code == 200


@pytest.mark.parametrize("with_token", [False, True], ids=["open", "token"])
def test_long_paths_get_414_before_routing(start_server, tmp_path, with_token):
    """A path of ~25,000 bytes under a route's pattern (/v2/models/<name>/...) overflowed the connection thread's
    stack in std::regex's recursive match and killed the server, before the token was checked (within the request
    line's room in libmicrohttpd's pool). Paths over 2 KiB now get 414 without being matched."""
    args = []
    if with_token:
        (tmp_path / "token").write_text("long-path-token-0123456789")
        args.append(f"--auth_token_file={tmp_path / 'token'}")
    server = start_server(*args)
    routed = 401 if with_token else 404  # a model of that name does not exist
    cases = [(b"GET", 2048 - 17, routed), (b"GET", 2049 - 17, 414), (b"GET", 27_000, 414), (b"POST", 28_000, 414),
             (b"GET", 30_000, 414)]
    for method, name_bytes, want in cases:
        verb = b"/ready" if method == b"GET" else b"/infer"
        s = connect(server.http_port)
        s.sendall(method + b" /v2/models/" + b"a" * name_bytes + verb + b" HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Length: 0\r\n\r\n")
        got = status_of(s)
        s.close()
        assert got == want, (method, name_bytes, got)
        assert server.proc.poll() is None, f"the server died on a path of {name_bytes + 17} bytes"
    assert requests.get(f"{server.http}/v2/health/live", timeout=5).status_code == 200


def test_idle_connection_is_closed(start_server):
    """A connection that sends nothing is closed after --http_idle_timeout_s (here 1 s), idle keep-alive too."""
    server = start_server("--http_idle_timeout_s=1")
    fresh = connect(server.http_port)
    kept = connect(server.http_port)
    kept.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(kept) == 200
    for s in (fresh, kept):
        start = time.monotonic()
        s.settimeout(10)
        try:
            while s.recv(4096):  # the rest of an answer, then the close
                pass
        except ConnectionResetError:
            pass
        waited = time.monotonic() - start
        s.close()
        assert waited < 5, f"an idle connection stayed open {waited:.1f} s (idle timeout 1 s)"


def test_connections_per_address_cap(start_server):
    """--http_max_connections_per_ip=3: a fourth connection from the same address is closed unanswered; once one
    closes, a new one is served."""
    server = start_server("--http_max_connections_per_ip=3")
    # The start-up readiness probes came from this address too: until the server has seen them close they count
    # against the cap, so the three held connections are retried until all three are served.
    deadline = time.monotonic() + 10
    while True:
        held = [connect(server.http_port) for _ in range(3)]
        statuses = []
        for s in held:
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            statuses.append(status_of(s, timeout=5))
        if statuses == [200, 200, 200] or time.monotonic() > deadline:
            break
        for s in held:
            s.close()
        time.sleep(0.1)
    assert statuses == [200, 200, 200]
    extra = connect(server.http_port)
    try:
        extra.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert status_of(extra, timeout=5) == 0
    extra.close()
    held.pop().close()
    deadline = time.monotonic() + 10  # until the server has seen the close, a fourth connection is still refused
    while True:
        try:
            answered = requests.get(f"{server.http}/v2/health/live", timeout=5).status_code
        except requests.ConnectionError:
            answered = None
        if answered is not None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert answered == 200
    for s in held:
        s.close()


def test_closed_health_and_unknown_paths_need_the_token(flashserve_bin, tmp_path):
    """--auth_open_health=false: health needs the token too; and with a token an unknown path answers 401, not 404
    (the token is checked before routing). Started here: conftest's readiness probe has no token."""
    token = "health-token-0123456789"
    (tmp_path / "token").write_text(token)
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen([str(flashserve_bin), "--backend=cpu", f"--grpc_port={grpc_port}",
                             f"--http_port={http_port}", f"--metrics_port={metrics_port}",
                             f"--auth_token_file={tmp_path / 'token'}", "--auth_open_health=false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, auth = f"http://127.0.0.1:{http_port}", {"Authorization": f"Bearer {token}"}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"{url}/v2/health/ready", headers=auth, timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server not ready"
            time.sleep(0.1)
        for path in ("/v2/health/live", "/v2/health/ready"):
            assert requests.get(f"{url}{path}", timeout=5).status_code == 401
            assert requests.get(f"{url}{path}", headers=auth, timeout=5).status_code == 200
        assert requests.get(f"{url}/no/such/path", timeout=5).status_code == 401
        assert requests.get(f"{url}/no/such/path", headers=auth, timeout=5).status_code == 404
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_chunked_body_over_max_request_bytes(start_server):
    """A chunked body (no Content-Length to refuse it by) over --max_request_bytes (1 MiB here): 413 when it ends if
    it ends within 16 MiB more; one that goes on is read and dropped up to that, then its connection is closed."""
    server = start_server("--max_request_bytes=1048576")
    piece = chunk(bytes(64 << 10))
    s = connect(server.http_port)
    s.sendall(post_head(INFER, {"Content-Type": "application/json"}, chunked=True) + piece * 32 + b"0\r\n\r\n")
    assert status_of(s) == 413
    s.close()
    s = connect(server.http_port)
    s.sendall(post_head(INFER, {"Content-Type": "application/json"}, chunked=True))
    sent = 0
    s.settimeout(10)
    try:
        while sent < 256 * MiB:
            s.sendall(piece)
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass
    s.close()
    print(f"a chunked body over --max_request_bytes=1MiB: connection closed after {sent / MiB:.1f} MiB sent")
    assert sent < 1 * MiB + 16 * MiB + 16 * MiB, sent  # limit + drain + what socket buffers held
    assert requests.get(f"{server.http}/v2/health/live", timeout=5).status_code == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
def test_shared_memory_calls_over_their_body_limit_get_413(start_server, chunked):
    """A shared-memory register body over its route's 64 KiB limit is a request that can never succeed: 413, as for
    the inference routes (it answered 503 "retry later": the limit's message named no size flag)."""
    server = start_server("--allow_client_shm")
    path = "/v2/systemsharedmemory/region/x/register"
    body = b"{" + b" " * 96_000 + b"}"
    s = connect(server.http_port)
    if chunked:
        s.sendall(post_head(path, {"Content-Type": "application/json"}, chunked=True) + chunk(body) + b"0\r\n\r\n")
    else:
        s.sendall(post_head(path, {"Content-Type": "application/json"}, content_length=len(body)) + body)
    got = status_of(s)
    s.close()
    assert got == 413, got
    assert requests.get(f"{server.http}/v2/health/live", timeout=5).status_code == 200
