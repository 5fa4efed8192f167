"""HTTP requests an attacker writes in minutes (session 42's audit, each failing on the previous server): JSON bodies
of many objects, a %00 in the path, a GET with a body, and a body that alone passes the edge's receive budget."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import requests

from test_http_hostile import INFER, connect, post_head, status_of

pytestmark = pytest.mark.e2e


def _objects_body(n: int) -> bytes:
    return b'{"junk":[' + b",".join([b"{}"] * n) + b"]}"


def test_json_bodies_of_many_objects_are_refused_at_once(start_server):
    """{"junk":[{},{},...]} passed every check and nlohmann's callback parser rescanned the array at every object's
    end: 600 KB took 5 s on a listener thread, and four 900 KB bodies (one per listener thread) left health probes
    unanswered. Objects are now counted before parsing (and the parse is linear: kserve_convert_test)."""
    server = start_server()
    answers = []

    def post_objects():
        s = connect(server.http_port)
        body = _objects_body(300_000)
        s.sendall(post_head(INFER, {"Content-Type": "application/json"}, content_length=len(body)) + body)
        start = time.monotonic()
        answers.append((status_of(s, timeout=60), time.monotonic() - start))
        s.close()

    posts = [threading.Thread(target=post_objects) for _ in range(4)]
    for p in posts:
        p.start()
    for _ in range(3):
        start = time.monotonic()
        assert requests.get(f"{server.http}/v2/health/live", timeout=3).status_code == 200
        assert time.monotonic() - start < 1.0, "health waited behind the JSON bodies"
    for p in posts:
        p.join(60)
    assert [a[0] for a in answers] == [400] * 4, answers
    assert max(a[1] for a in answers) < 2.0, answers


@pytest.mark.parametrize("with_token", [False, True], ids=["open", "token"])
def test_a_nul_in_the_path_matches_no_route(start_server, tmp_path, with_token):
    """libmicrohttpd decoded %00 and handed the path on as a C string, cut there: /v2/health/live%00/admin was
    routed (and, with a token set, let through) as the open health route, infer%00anything.html ran an inference.
    %00 now stays as written, so such paths match nothing (404; 401 without the token)."""
    args = []
    token = "nul-path-token-0123456789"
    if with_token:
        (tmp_path / "token").write_text(token)
        args.append(f"--auth_token_file={tmp_path / 'token'}")
    server = start_server(*args)
    no_route = 401 if with_token else 404
    for method, path in (("GET", "/v2/health/live%00/admin"), ("GET", "/v2/models/attention%00x/ready"),
                         ("POST", "/v2/models/attention/infer%00/ready"), ("POST", f"{INFER}%00anything.html")):
        s = connect(server.http_port)
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
        got = status_of(s)
        s.close()
        assert got == no_route, (method, path, got)
    # Other escapes still decode: %2F-free names, %76 = "v".
    headers = {"Authorization": f"Bearer {token}"} if with_token else {}
    assert requests.get(f"{server.http}/%762/health/live", headers=headers, timeout=5).status_code == 200


def test_a_get_with_a_body_is_refused_before_it_is_read(start_server, tmp_path):
    """GET routes answered only once the body had ended and never bounded it: Content-Length 100 GB on the open
    /v2/health/live, with a token set, was read and dropped at ~5 GB/s until the body timeout (300 s). Now 400 at
    once and the connection closed; Content-Length 0 stays fine."""
    (tmp_path / "token").write_text("get-body-token-0123456789")
    server = start_server(f"--auth_token_file={tmp_path / 'token'}")
    for framing in ("Content-Length: 100000000000", "Transfer-Encoding: chunked"):
        s = connect(server.http_port)
        s.sendall(f"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n".encode() + b"x" * 65536)
        assert status_of(s, timeout=5) == 400, framing
        s.settimeout(5)
        try:
            while s.recv(65536):  # the rest of the answer, then the close
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        s.close()
    s = connect(server.http_port)
    s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert status_of(s) == 200
    s.close()


def test_a_body_the_receive_budget_can_never_hold_gets_413(start_server):
    """--http_max_receive_bytes under --max_request_bytes: a binary request larger than the budget alone got 503
    "retry later" on an idle server, forever (clients and proxies retry 503s). It is too large: 413."""
    server = start_server("--http_max_receive_bytes=1048576")
    q = np.zeros((1, 4096, 1, 64), np.float32)  # 1 MiB
    kv = np.zeros((1, 8, 1, 64), np.float32)
    header = json.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}
                                    for n, x in (("Q", q), ("K", kv), ("V", kv))]}).encode()
    body = header + q.tobytes() + kv.tobytes() + kv.tobytes()
    for _ in range(2):
        answer = requests.post(f"{server.http}{INFER}", data=body, timeout=30,
                               headers={"Inference-Header-Content-Length": str(len(header))})
        assert answer.status_code == 413, (answer.status_code, answer.text)
        assert "--http_max_receive_bytes=1048576" in answer.json()["error"]
    small = np.zeros((1, 8, 1, 64), np.float32)
    header = json.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": list(small.shape),
                                     "parameters": {"binary_data_size": small.nbytes}} for n in "QKV"]}).encode()
    answer = requests.post(f"{server.http}{INFER}", data=header + small.tobytes() * 3, timeout=30,
                           headers={"Inference-Header-Content-Length": str(len(header))})
    assert answer.status_code == 200, answer.text


def _raw_answer(port: int, request: bytes) -> tuple[int, str]:
    """The status and body of a request sent as is (with Connection: close, so the body ends at the close)."""
    s = connect(port)
    s.sendall(request)
    data = b""
    s.settimeout(10)
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode("utf-8", "replace")


def test_inference_header_lengths_that_differ_are_refused(start_server):
    """Two Inference-Header-Content-Length fields with different values split the body at two places (the server
    took the first, a proxy may take the last), as two Content-Lengths would: refused like those. The same value
    twice, as a proxy that repeats headers sends it, still works."""
    server = start_server()
    small = np.zeros((1, 8, 1, 64), np.float32)
    header = json.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": list(small.shape),
                                     "parameters": {"binary_data_size": small.nbytes}} for n in "QKV"]}).encode()
    body = header + small.tobytes() * 3

    def send(*lengths):
        fields = "".join(f"Inference-Header-Content-Length: {n}\r\n" for n in lengths)
        return _raw_answer(server.http_port, (
            f"POST {INFER} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{fields}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body)

    status, text = send(len(header), len(header) + 4)
    assert status == 400, text
    assert "Inference-Header-Content-Length: sent more than once with different values" in text
    status, text = send(len(header), len(header))
    assert status == 200, text


def test_error_messages_keep_utf8_names_readable(start_server):
    """Each byte >= 0x80 of an error message was escaped as \\u00XX: a model name sent in UTF-8 came back as
    Latin-1 mojibake ("cafÃ©"). Well-formed UTF-8 now comes back as sent; a byte that is no character is U+FFFD."""
    server = start_server()
    for path, name in (("caf%C3%A9", "caf\u00e9"), ("caf%FF", "caf\ufffd")):
        answer = requests.post(f"{server.http}/v2/models/{path}/infer", data=b"{}", timeout=10)
        assert answer.status_code in (400, 404), answer.text
        assert f'unknown model "{name}"' in answer.json()["error"], answer.text
