"""Large JSON bodies are parsed off the HTTP listener threads. A JSON body takes ~29 ns per byte to post, parse and
refuse here (27 MiB: 0.82 s); on a listener thread every other request of that thread's connections waited behind it,
health probes included: eight clients posting 27 MiB JSON bodies, without a token, held /v2/health/live up to 2.3 s
(measured; a Kubernetes liveness probe times out at 2 s). Bodies whose JSON is 256 KiB or more are now parsed on the
edge's two parse threads; the listener threads stay free."""

from __future__ import annotations

import http.client
import json
import threading
import time

import numpy as np
import pytest
import requests

from flashserve import reference
from test_http_hostile import INFER
from test_kserve_rest import HEADER, binary_body, decode, error_of, infer_url, json_input

pytestmark = pytest.mark.e2e

CLIENTS = 8
ELEMENTS = 3 << 20  # ~24 MiB of JSON numbers per body


def big_json_body(rng, wrong_count: bool) -> bytes:
    """A JSON-only infer body of q, k, v [1, n, 4, 64] with ~ELEMENTS numbers in all; with `wrong_count`, q's data
    is one element short, so the server parses all of it and then refuses it (400), computing nothing."""
    n = ELEMENTS // 3 // 256
    shape = [1, n, 4, 64]
    inputs = []
    for name in ("q", "k", "v"):
        data = rng.standard_normal(n * 256).astype(np.float32)
        if wrong_count and name == "q":
            data = data[:-1]
        text = ",".join(f"{x:.6g}" for x in data)
        inputs.append(f'{{"name":"{name}","shape":{shape},"datatype":"FP32","data":[{text}]}}')
    return ('{"inputs":[' + ",".join(inputs) + "]}").encode()


def probe_latencies(port: int, seconds: float) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/v2/health/live")
        response = conn.getresponse()
        response.read()
        conn.close()
        assert response.status == 200, response.status
        out.append(time.perf_counter() - start)
        time.sleep(0.02)
    return out


def test_health_answers_while_clients_post_large_json(start_server, rng):
    server = start_server("--http_max_json_bytes=67108864")
    body = big_json_body(rng, wrong_count=True)
    statuses = []
    stop = threading.Event()

    def post():
        while not stop.is_set():
            try:
                statuses.append(requests.post(f"{server.http}{INFER}", data=body, timeout=120).status_code)
            except requests.RequestException as e:
                statuses.append(repr(e))

    threads = [threading.Thread(target=post) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        live = probe_latencies(server.http_port, 6.0)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    print(f"{CLIENTS} clients posting {len(body) / 2**20:.0f} MiB JSON bodies: {len(statuses)} answered; "
          f"/v2/health/live p50 {np.median(live) * 1e3:.1f} ms, max {max(live) * 1e3:.0f} ms over {len(live)} probes")
    assert statuses and set(statuses) == {400}, set(statuses)
    assert max(live) < 1.0, f"health waited {max(live):.2f} s behind JSON parses"


def chunks(body: bytes):
    return iter([body[i:i + 65521] for i in range(0, len(body), 65521)])


def large_json_q_binary_kv(rng, seqlen_q: int):
    """q as JSON numbers (over the 256 KiB inline-parse limit), k and v as binary inputs after the header."""
    q = rng.standard_normal((1, seqlen_q, 2, 64)).astype(np.float32)
    k = rng.standard_normal((1, 37, 2, 64)).astype(np.float32)
    v = rng.standard_normal((1, 37, 2, 64)).astype(np.float32)
    header = {"inputs": [json_input("Q", q)] + [
        {"name": n, "datatype": "FP32", "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}
        for n, x in (("K", k), ("V", v))]}
    body, headers = binary_body(header, (k, v))
    return q, k, v, body, headers


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_large_header_with_binary_inputs_after_it(start_server, rng, chunked):
    """The header is parsed after the whole body came: the binary bytes that followed it wait in a stash and are
    copied into their tensors then. Checked against the fp64 reference; odd sizes."""
    server = start_server()
    q, k, v, body, headers = large_json_q_binary_kv(rng, seqlen_q=1531)
    assert int(headers[HEADER]) > 256 << 10
    data = chunks(body) if chunked else body
    _, outputs = decode(requests.post(infer_url(server), data=data, headers=headers, timeout=60))
    want = reference.attention(q, k, v)
    assert not np.isnan(outputs["O"]).any()
    assert np.abs(outputs["O"].astype(np.float64) - want).max() < 1e-5


@pytest.mark.parametrize("cut, chunked, wanted", [
    (-3, False, "37885 bytes follow the JSON header"),  # Content-Length: checked when the header is parsed
    (3, False, "37891 bytes follow the JSON header"),
    (-3, True, "ended before the binary data"),  # chunked: checked as the stash is copied into the tensors
    (3, True, "more bytes than the inputs' binary_data_size"),
], ids=["short", "long", "short-chunked", "long-chunked"])
def test_a_large_header_with_the_wrong_binary_bytes_is_refused(start_server, rng, cut, chunked, wanted):
    server = start_server()
    _, _, _, body, headers = large_json_q_binary_kv(rng, seqlen_q=1531)
    body = body[:cut] if cut < 0 else body + bytes(cut)
    message = error_of(requests.post(infer_url(server), data=chunks(body) if chunked else body, headers=headers,
                                     timeout=60), 400)
    assert wanted in message, message


def test_a_large_header_that_is_the_whole_body(start_server, rng):
    """Inference-Header-Content-Length equal to the body: all JSON, parsed off the listener too."""
    server = start_server()
    q = rng.standard_normal((1, 811, 2, 64)).astype(np.float32)
    k = rng.standard_normal((1, 45, 2, 64)).astype(np.float32)
    v = rng.standard_normal((1, 45, 2, 64)).astype(np.float32)
    body = json.dumps({"inputs": [json_input(n, x) for n, x in (("Q", q), ("K", k), ("V", v))]}).encode()
    assert len(body) > 256 << 10
    _, outputs = decode(requests.post(infer_url(server), data=body, headers={HEADER: str(len(body))}, timeout=60))
    assert np.abs(outputs["O"].astype(np.float64) - reference.attention(q, k, v)).max() < 1e-5
