"""A KServe REST inference whose client closes its connection stops as a cancelled gRPC call does: computing, the
CPU backend stops within milliseconds; queued, it is dropped when its turn comes. The next request is answered at
once and the metrics count the request as CANCELLED (the log names the client as the reason). Over TLS too, where a
client's close sends close_notify bytes before its FIN.

The large request is q = k = v fp32 [1, 240000, 1, 4] (11.5 MB, test_cpu_cancel.py's): ~20 s of compute on a
2-core machine if it ran to its end, so without the stop the next request waits for seconds and every check fails.
Each request is sent over a raw socket, entirely received by the server before the socket is closed (a client
that leaves during the upload was always seen)."""

from __future__ import annotations

import fcntl
import re
import shutil
import socket
import ssl
import struct
import subprocess
import termios
import time
import urllib.request

import numpy as np
import pytest
import requests

import flashserve
from conftest import ServerProcess
from test_kserve_rest import HEADER, binary_request, decode

pytestmark = pytest.mark.e2e

LARGE = (1, 240000, 1, 4)
SMALL = (1, 64, 2, 32)
PROMPT_S = 2.0  # the small request's budget once the large ones gave up (it computes in microseconds)
SEEN_S = 5.0  # for the metrics and the log to show the cancel


def _qkv(shape, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(3))


def _raw_infer(request_id: str) -> bytes:
    """A whole HTTP/1.1 request for the large inference, binary tensors."""
    body, headers = binary_request(*_qkv(LARGE), request_id=request_id)
    head = (f"POST /v2/models/attention/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/octet-stream\r\n{HEADER}: {headers[HEADER]}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def _metric(server, name: str, **labels) -> float:
    cafile = getattr(server, "cafile", None)  # TLS: /metrics too
    url = f"{'https' if cafile else 'http'}://127.0.0.1:{server.metrics_port}/metrics"
    context = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    text = urllib.request.urlopen(url, timeout=5, context=context).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{name}{{{re.escape(want)}}} (\S+)$", text, re.MULTILINE) if labels else \
        re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _cancelled(server) -> float:
    return _metric(server, "flashserve_requests_total", method="KServeInfer", status="CANCELLED")


def _wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _unsent(sock) -> int:
    """Bytes the kernel has not yet had acknowledged by the server (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def _send_held(sock, data: bytes, server, inflight: int) -> None:
    """Sends a request and returns once the server holds it: every byte acknowledged, `inflight` requests
    counted, then a moment to parse it and submit or start it."""
    sock.sendall(data)
    assert _wait_until(lambda: _unsent(sock) == 0, 30), "the server did not read the request"
    assert _wait_until(lambda: _metric(server, "flashserve_inflight_requests") >= inflight, 30)
    time.sleep(0.5)


def _small_rest_answered_within(base_url: str, **kwargs) -> float:
    q, k, v = _qkv(SMALL, seed=1)
    body, headers = binary_request(q, k, v)
    started = time.monotonic()
    response = requests.post(f"{base_url}/v2/models/attention/infer", data=body, headers=headers, timeout=60,
                             **kwargs)
    took = time.monotonic() - started
    _, outputs = decode(response)
    np.testing.assert_allclose(outputs["O"], flashserve.reference.attention(q, k, v), atol=1e-5, rtol=0)
    return took


def _assert_cancelled_by_the_client(server, count: int, ids):
    assert _wait_until(lambda: _cancelled(server) >= count, SEEN_S), \
        f"{_cancelled(server)} REST requests counted CANCELLED, not {count}\n{server.logs()}"
    assert _cancelled(server) == count
    assert _metric(server, "flashserve_requests_total", method="KServeInfer", status="OK") == 1  # the small one
    for request_id in ids:  # logged as the metrics count it, and naming the client
        line = rf'KServeInfer failed: id="{request_id}" .*code=CANCELLED message="cancelled by the client'
        assert _wait_until(lambda: re.search(line, server.logs(limit=50000)), SEEN_S), server.logs(limit=50000)


def test_closed_connection_stops_the_computation(start_server):
    server = start_server(name="rest_disconnect")
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        _send_held(sock, _raw_infer("abandoned"), server, inflight=1)
    took = _small_rest_answered_within(server.http)
    assert took < PROMPT_S, f"the next request waited {took:.1f} s: the abandoned one kept computing\n{server.logs()}"
    _assert_cancelled_by_the_client(server, 1, ["abandoned"])
    assert "cancelled by the client while computing; stopped after" in server.logs(limit=50000)


def test_closed_connection_of_a_queued_request_is_dropped(start_server):
    # The CPU backend runs one request at a time: the second waits in the queue behind the first.
    server = start_server(name="rest_disconnect_queued")
    computing = socket.create_connection(("127.0.0.1", server.http_port))
    queued = socket.create_connection(("127.0.0.1", server.http_port))
    try:
        _send_held(computing, _raw_infer("computing"), server, inflight=1)
        _send_held(queued, _raw_infer("queued"), server, inflight=2)
    finally:
        queued.close()
        time.sleep(0.2)
        computing.close()
    took = _small_rest_answered_within(server.http)
    assert took < PROMPT_S, f"the next request waited {took:.1f} s: an abandoned one was computed\n{server.logs()}"
    _assert_cancelled_by_the_client(server, 2, ["computing", "queued"])


@pytest.fixture
def tls_server(flashserve_bin, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    from test_security import _start_tls

    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
        check=True, capture_output=True)
    server = ServerProcess(flashserve_bin, tmp_path,
                           [f"--tls_cert={tmp_path / 'cert.pem'}", f"--tls_key={tmp_path / 'key.pem'}"],
                           name="rest_disconnect_tls")
    server.cafile = tmp_path / "cert.pem"
    _start_tls(server, server.cafile)
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def test_tls_close_notify_stops_the_computation(tls_server):
    server = tls_server
    context = ssl.create_default_context(cafile=str(server.cafile))
    sock = context.wrap_socket(socket.create_connection(("127.0.0.1", server.http_port)),
                               server_hostname="localhost")
    _send_held(sock, _raw_infer("abandoned-tls"), server, inflight=1)
    # close_notify first: bytes the server does not read while it computes, then the FIN.
    sock.settimeout(0.5)
    try:
        sock.unwrap()  # sends close_notify, then times out waiting for the server's
    except (OSError, ssl.SSLError):
        pass
    sock.close()
    took = _small_rest_answered_within(f"https://127.0.0.1:{server.http_port}", verify=str(server.cafile))
    assert took < PROMPT_S, f"the next request waited {took:.1f} s: the abandoned one kept computing\n{server.logs()}"
    _assert_cancelled_by_the_client(server, 1, ["abandoned-tls"])
