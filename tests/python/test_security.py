"""TLS and bearer-token auth end to end: generated self-signed certificate, real server, real client."""

from __future__ import annotations

import json
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

import flashserve
from flashserve import reference

pytestmark = pytest.mark.e2e

TOKEN = "s3cret-token-0123456789abcdef"


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
        check=True, capture_output=True)
    (d / "token").write_text(TOKEN + "\n")
    return d


@pytest.fixture(scope="module")
def secure_server(flashserve_bin, cert, tmp_path_factory):
    from conftest import ServerProcess, _stop_and_check

    args = [f"--tls_cert={cert / 'cert.pem'}", f"--tls_key={cert / 'key.pem'}",
            f"--auth_token_file={cert / 'token'}"]
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("secure"), args, name="secure")
    _start_tls(s, cert / "cert.pem")
    yield s
    _stop_and_check(s)


def _https_get(url, cafile, token=None):
    ctx = ssl.create_default_context(cafile=str(cafile))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _start_tls(server, cafile):
    """ServerProcess.start polls readiness over plain HTTP: point its probe at HTTPS while it starts."""
    import conftest

    original = conftest.http_get
    conftest.http_get = lambda url, timeout=2.0: _safe_https(url.replace("http://", "https://", 1), cafile)
    try:
        server.start()
    finally:
        conftest.http_get = original


def _safe_https(url, cafile):
    try:
        return _https_get(url, cafile)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return 0, b""


def _creds(cert):
    return grpc.ssl_channel_credentials(root_certificates=(cert / "cert.pem").read_bytes())


def _problem():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 9, 2, 64)).astype(np.float32)
    return q, q[:, :5].copy(), q[:, :5].copy()


def test_tls_with_token_answers_correctly(secure_server, cert):
    q, k, v = _problem()
    with flashserve.Client(secure_server.address, credentials=_creds(cert), token=TOKEN, timeout=30) as c:
        out = c.attention(q, k, v)
    assert np.abs(out - reference.attention(q, k, v)).max() < 1e-5


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789abcdef", TOKEN[:-1], TOKEN + "x"])
def test_missing_or_wrong_token_is_unauthenticated(secure_server, cert, token):
    q, k, v = _problem()
    with flashserve.Client(secure_server.address, credentials=_creds(cert), token=token, timeout=30) as c:
        with pytest.raises(flashserve.FlashserveError) as e:
            c.attention(q, k, v)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(flashserve.FlashserveError) as e:
            c.server_info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_health_stays_open(secure_server, cert):
    with flashserve.Client(secure_server.address, credentials=_creds(cert), timeout=30) as c:
        assert c.health()


def test_plaintext_client_cannot_talk_to_tls_port(secure_server):
    q, k, v = _problem()
    with flashserve.Client(secure_server.address, token=TOKEN, timeout=5) as c:
        with pytest.raises(flashserve.FlashserveError) as e:
            c.attention(q, k, v)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_http_auth_and_open_health(secure_server, cert):
    base = f"https://127.0.0.1:{secure_server.http_port}"
    ca = cert / "cert.pem"
    assert _https_get(f"{base}/v2/health/ready", ca)[0] == 200  # open by default
    assert _https_get(f"{base}/v2/health/live", ca)[0] == 200
    status, body = _https_get(f"{base}/v2/models/attention", ca)
    assert status == 401 and b"bearer token" in body
    assert _https_get(f"{base}/v2/models/attention", ca, "nope-nope-nope-nope")[0] == 401
    assert _https_get(f"{base}/v2/models/attention", ca, TOKEN)[0] != 401


def test_metrics_need_the_token_and_count_rejections(secure_server, cert):
    base = f"https://127.0.0.1:{secure_server.metrics_port}/metrics"
    ca = cert / "cert.pem"
    assert _https_get(base, ca)[0] == 401
    status, body = _https_get(base, ca, TOKEN)
    assert status == 200
    text = body.decode()
    assert 'status="UNAUTHENTICATED"' in text


def test_check_cli_with_tls_and_token(secure_server, cert):
    proc = subprocess.run(
        [sys.executable, "-m", "flashserve", "check", "--quick", "--address", secure_server.address,
         "--tls-ca", str(cert / "cert.pem"), "--token-file", str(cert / "token")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_short_token_is_refused_at_startup(flashserve_bin, tmp_path):
    (tmp_path / "t").write_text("short")
    proc = subprocess.run([str(flashserve_bin), "--backend=cpu", f"--auth_token_file={tmp_path / 't'}",
                           "--grpc_port=0", "--http_port=0", "--metrics_port=0"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "at least 16 characters" in proc.stderr + proc.stdout


def test_binds_loopback_by_default(server):
    # The startup line is near the start of the log (other tests' traffic may follow it).
    startup = (server.log_dir / f"{server.name}.stderr").read_text(errors="replace")[:4000]
    assert "grpc=127.0.0.1:" in startup and "http=127.0.0.1:" in startup, startup


def test_grpc_core_log_lines_stay_json(flashserve_bin, cert, tmp_path):
    """gRPC core logs a failed TLS handshake itself (a plaintext client on the TLS port: one line per connection);
    with --log_format=json that line was gRPC's own "E1129 ... ssl_transport_security.cc" among the JSON objects. It
    goes through the server's logger now."""
    from conftest import ServerProcess

    args = [f"--tls_cert={cert / 'cert.pem'}", f"--tls_key={cert / 'key.pem'}", "--log_format=json"]
    server = ServerProcess(flashserve_bin, tmp_path, args, name="json_tls")
    _start_tls(server, cert / "cert.pem")
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                try:
                    s.recv(100)
                except OSError:
                    pass
        time.sleep(0.5)
    finally:
        server.stop()
    stderr = (tmp_path / "json_tls.stderr").read_text()
    assert "Handshake failed" in stderr, stderr[-2000:]  # gRPC said it...
    assert not re.search(r"^[EWID]\d{4} ", stderr, re.MULTILINE), stderr[-2000:]  # ...not in its own format...
    for line in stderr.splitlines():  # ...but as one JSON object per line (a sanitizer's exit summary aside)
        if "Handshake failed" in line:
            record = json.loads(line)
            assert {"time", "level", "msg"} <= set(record), line
