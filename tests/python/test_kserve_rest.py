"""KServe v2 / Open Inference Protocol REST (port 8000) against the real binary: metadata and readiness, inference
with JSON tensors and with the binary tensor data extension for each dtype vs the fp64 reference, every error
status, and a >= 64 MiB binary request with exact byte accounting in the metrics."""

from __future__ import annotations

import json
import re
import threading
import time

import grpc
import ml_dtypes
import numpy as np
import pytest
import requests

from flashserve import attention_pb2 as pb
from flashserve import attention_pb2_grpc as pb_grpc

import metrics_helpers
from conftest import LIMITS_MAX_REQUEST_BYTES, LIMITS_MAX_TENSOR_ELEMENTS, ServerProcess, free_port

pytestmark = pytest.mark.e2e

DATATYPES = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}
NUMPY = {"FP16": np.float16, "BF16": ml_dtypes.bfloat16, "FP32": np.float32}
HEADER = "Inference-Header-Content-Length"


def infer_url(server, model="attention", version=None):
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
    return f"{server.http}{path}/infer"


def json_input(name, x):
    return {"name": name, "datatype": DATATYPES[x.dtype.name], "shape": list(x.shape),
            "data": np.asarray(x).astype(np.float64).ravel().tolist()}


def binary_body(header: dict, tensors) -> tuple:
    """(body, headers) for the binary tensor data extension: JSON header, then the tensors' bytes."""
    head = json.dumps(header).encode()
    return head + b"".join(np.ascontiguousarray(t).tobytes() for t in tensors), {HEADER: str(len(head))}


def binary_request(q, k, v, parameters=None, outputs=None, request_id=None):
    header = {"inputs": [
        {"name": n, "datatype": DATATYPES[x.dtype.name], "shape": list(x.shape),
         "parameters": {"binary_data_size": x.nbytes}} for n, x in (("Q", q), ("K", k), ("V", v))]}
    if parameters:
        header["parameters"] = parameters
    if outputs is not None:
        header["outputs"] = outputs
    if request_id is not None:
        header["id"] = request_id
    return binary_body(header, (q, k, v))


def decode(response) -> tuple:
    """(header JSON, {output name: numpy array}) of an infer response, binary outputs included."""
    assert response.status_code == 200, response.text[:500]
    body = response.content
    header_length = response.headers.get(HEADER)
    split = int(header_length) if header_length is not None else len(body)
    header = json.loads(body[:split])
    offset, outputs = split, {}
    for out in header["outputs"]:
        dtype = NUMPY[out["datatype"]]
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            arr = np.frombuffer(body[offset:offset + size], dtype=dtype)
            offset += size
        else:
            arr = np.array([np.nan if x is None else x for x in out["data"]], dtype=np.float64).astype(dtype)
        outputs[out["name"]] = arr.reshape(out["shape"])
    assert offset == len(body), "binary data left over"
    return header, outputs


def error_of(response, status):
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["Content-Type"].startswith("application/json")
    message = response.json()["error"]
    assert isinstance(message, str) and message
    return message


# --- metadata and health -------------------------------------------------------------------------------------------


def test_server_and_model_metadata(server):
    meta = requests.get(f"{server.http}/v2", timeout=10).json()
    assert meta["name"] == "flashserve" and meta["version"]
    # Shared memory is not offered by a server without --allow_client_shm (it refuses every register).
    assert meta["extensions"] == ["binary_tensor_data"], meta["extensions"]
    for path in ("/v2/models/attention", "/v2/models/attention/versions/1"):
        model = requests.get(server.http + path, timeout=10).json()
        assert model["name"] == "attention" and model["versions"] == ["1"]
        assert [i["name"] for i in model["inputs"]] == ["Q", "K", "V"]
        assert all(i["shape"] == [-1, -1, -1, -1] and i["datatype"] in NUMPY for i in model["inputs"])
        assert [(o["name"], len(o["shape"])) for o in model["outputs"]] == [("O", 4), ("LSE", 3)]
        assert model["outputs"][1]["datatype"] == "FP32"
    ready = requests.get(f"{server.http}/v2/models/attention/ready", timeout=10)
    assert ready.status_code == 200 and ready.json() == {"name": "attention", "ready": True}
    assert requests.get(f"{server.http}/v2/health/live", timeout=10).status_code == 200
    assert requests.get(f"{server.http}/v2/health/ready", timeout=10).status_code == 200


# --- inference -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_infer_json(server, rng, make_qkv, check_answer, dtype):
    q, k, v = make_qkv(rng, 2, 17, 33, 4, 2, 64, dtype)
    body = {"id": f"json-{dtype}", "parameters": {"causal": True, "return_lse": True},
            "inputs": [json_input("Q", q), json_input("K", k), json_input("V", v)]}
    response = requests.post(infer_url(server), json=body, timeout=60)
    assert response.headers["Content-Type"].startswith("application/json")
    assert HEADER not in response.headers
    header, outputs = decode(response)
    assert header["id"] == f"json-{dtype}" and header["model_name"] == "attention"
    assert header["parameters"]["kernel"]
    assert [o["name"] for o in header["outputs"]] == ["O", "LSE"]
    assert header["outputs"][0]["datatype"] == DATATYPES[dtype]
    check_answer(outputs["O"], outputs["LSE"], q, k, v, causal=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_infer_binary(server, rng, make_qkv, check_answer, dtype):
    q, k, v = make_qkv(rng, 1, 40, 97, 6, 3, 128, dtype)
    body, headers = binary_request(q, k, v, parameters={"binary_data_output": True, "return_lse": True,
                                                        "softmax_scale": 0.05}, request_id="bin-1")
    response = requests.post(infer_url(server, version="1"), data=body, headers=headers, timeout=60)
    assert response.headers["Content-Type"] == "application/octet-stream"
    header, outputs = decode(response)
    assert header["id"] == "bin-1"
    assert all("data" not in o for o in header["outputs"])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == q.nbytes
    check_answer(outputs["O"], outputs["LSE"], q, k, v, softmax_scale=0.05)


def test_infer_mixed_outputs_and_inputs(server, rng, make_qkv, check_answer):
    """JSON K beside binary Q and V; O as binary and LSE as JSON, in the order asked for."""
    q, k, v = make_qkv(rng, 1, 9, 9, 2, 1, 32, "float16")
    header = {"inputs": [
        {"name": "V", "datatype": "FP16", "shape": list(v.shape), "parameters": {"binary_data_size": v.nbytes}},
        json_input("K", k),
        {"name": "Q", "datatype": "FP16", "shape": list(q.shape), "parameters": {"binary_data_size": q.nbytes}}],
        "outputs": [{"name": "LSE"}, {"name": "O", "parameters": {"binary_data": True}}]}
    body, headers = binary_body(header, (v, q))
    response = requests.post(infer_url(server), data=body, headers=headers, timeout=60)
    got, outputs = decode(response)
    assert [o["name"] for o in got["outputs"]] == ["LSE", "O"]
    assert "data" in got["outputs"][0] and "binary_data_size" in got["outputs"][1]["parameters"]
    check_answer(outputs["O"], outputs["LSE"], q, k, v)


# --- errors --------------------------------------------------------------------------------------------------------


def small_qkv(dtype=np.float16):
    q = np.ones((1, 4, 2, 8), dtype)
    k = np.ones((1, 5, 2, 8), dtype)
    return q, k, k.copy()


# The error tests use limits_server (small requests fit its limits): their warning log lines stay out of the shared
# server's log, which other tests read.
def test_errors_bad_request(limits_server):
    q, k, v = small_qkv()
    url = infer_url(limits_server)
    cases = [
        (b"{not json", {}, "not valid JSON: parse error at line 1, column 3"),
        # JSON text no double holds: said, not a bare "not valid JSON"
        (b'{"parameters": {"softmax_scale": 1e400}, "inputs": []}', {}, "number overflow parsing '1e400'"),
        (json.dumps({"inputs": [json_input("Q", q), json_input("K", k)]}).encode(), {}, "V missing"),
        (json.dumps({"inputs": [json_input("Q", q), json_input("K", k), json_input("X", v)]}).encode(), {},
         'unknown input "X"'),
        (json.dumps({"inputs": [json_input("Q", q), json_input("K", k[:, :, :1]), json_input("V", v)]}).encode(),
         {}, "v.shape"),
        (json.dumps({"parameters": {"causal": "yes"},
                     "inputs": [json_input("Q", q), json_input("K", k), json_input("V", v)]}).encode(), {},
         "parameters.causal"),
        (json.dumps({"inputs": [dict(json_input("Q", q), datatype="INT8"), json_input("K", k),
                                json_input("V", v)]}).encode(), {}, "datatype"),
        (json.dumps({"inputs": [dict(json_input("Q", q), shape=[1, 4, 2, 2**64 - 1]), json_input("K", k),
                                json_input("V", v)]}).encode(), {},
         "inputs[0].shape: 18446744073709551615 does not fit a signed 64-bit integer"),  # not shown as 2^63-1
    ]
    body, headers = binary_request(q, k, v)
    cases.append((body[:-2], headers, "binary_data_size adds up to"))  # body shorter than the sizes say
    cases.append((body, {HEADER: "12345678"}, "Inference-Header-Content-Length"))
    cases.append((body, {HEADER: "x"}, "Inference-Header-Content-Length"))
    for data, extra_headers, fragment in cases:
        message = error_of(requests.post(url, data=data, headers=extra_headers, timeout=30), 400)
        assert fragment in message, (fragment, message)
    # Still serving, on the same kind of request done right.
    body, headers = binary_request(q, k, v)
    assert requests.post(url, data=body, headers=headers, timeout=30).status_code == 200


def test_json_numbers_past_the_dtype_are_refused(limits_server):
    """A JSON number the datatype cannot hold (1e39 as FP32, 65520 as FP16) became inf: a silently different input
    (O came back null). Now 400 naming the element; the largest values each dtype holds still go through."""
    url = infer_url(limits_server)
    q, k, v = small_qkv(np.float32)
    for datatype, value in (("FP32", 1e39), ("FP32", -3.5e38), ("FP16", 65520.0), ("FP16", 1e6), ("BF16", 3.4e38)):
        bad = dict(json_input("K", k), datatype=datatype)
        bad["data"] = list(bad["data"])
        bad["data"][3] = value
        inputs = [dict(json_input("Q", q), datatype=datatype), bad, dict(json_input("V", v), datatype=datatype)]
        message = error_of(requests.post(url, json={"inputs": inputs}, timeout=30), 400)
        assert "inputs[1].data[3]" in message and "outside the range of" in message, message
    for datatype, value in (("FP32", 3.4e38), ("FP16", 65504.0), ("FP16", 65519.0), ("BF16", 3.38e38)):
        kk = dict(json_input("K", k), datatype=datatype)
        kk["data"] = list(kk["data"])
        kk["data"][3] = value
        inputs = [dict(json_input("Q", q), datatype=datatype), kk, dict(json_input("V", v), datatype=datatype)]
        response = requests.post(url, json={"inputs": inputs}, timeout=30)
        assert response.status_code == 200, (datatype, value, response.text[:300])


def test_duplicate_json_keys_are_refused(limits_server):
    """nlohmann kept a repeated key's last value, while a proxy or WAF in front that reads the first judged another
    request than the server ran. Now 400 naming the key, at the top level and inside a tensor (an escaped spelling
    of the same key too); the same bodies with each key once still run."""
    url = infer_url(limits_server)
    q, k, v = small_qkv()
    inputs = json.dumps([json_input("Q", q), json_input("K", k), json_input("V", v)])
    q_on = inputs[2:]  # Q's members, then K and V: '"name": "Q", ...}, {...}, {...}]'
    assert q_on.startswith('"name": "Q"')
    cases = [
        ('{"inputs": %s, "inputs": %s}' % (json.dumps([json_input("Q", q)]), inputs), "inputs"),
        ('{"inputs": [{"datatype": "FP32", %s}' % q_on, "datatype"),
        ('{"inputs": [{"data\\u0074ype": "FP32", %s}' % q_on, "datatype"),
        ('{"parameters": {"causal": true, "causal": false}, "inputs": %s}' % inputs, "causal"),
    ]
    for body, key in cases:
        message = error_of(requests.post(url, data=body.encode(), timeout=30), 400)
        assert f'duplicate key "{key}" in a JSON object' in message, (body[:80], message)
    for body in ('{"inputs": %s}' % inputs, '{"inputs": [{%s}' % q_on):
        assert requests.post(url, data=body.encode(), timeout=30).status_code == 200


def test_errors_not_found(limits_server):
    s = limits_server
    q, k, v = small_qkv()
    body, headers = binary_request(q, k, v)
    assert "unknown model" in error_of(
        requests.post(infer_url(s, model="bert"), data=body, headers=headers, timeout=30), 404)
    assert "unknown version" in error_of(
        requests.post(infer_url(s, version="7"), data=body, headers=headers, timeout=30), 404)
    assert "unknown model" in error_of(requests.get(f"{s.http}/v2/models/bert", timeout=10), 404)
    assert "unknown model" in error_of(requests.get(f"{s.http}/v2/models/bert/ready", timeout=10), 404)


def test_errors_too_large(limits_server):
    url = infer_url(limits_server)
    # Body over --max_request_bytes: refused from Content-Length.
    big = np.zeros((1, 1, 1, LIMITS_MAX_REQUEST_BYTES // 2 + 8), np.float16)
    body, headers = binary_request(big, big, big)
    assert len(body) > LIMITS_MAX_REQUEST_BYTES
    assert "--max_request_bytes" in error_of(requests.post(url, data=body, headers=headers, timeout=30), 413)
    # Small body, tensor over --max_tensor_elements.
    q = np.zeros((1, LIMITS_MAX_TENSOR_ELEMENTS // 8 + 1, 1, 8), np.float16)
    k = np.zeros((1, 2, 1, 8), np.float16)
    body, headers = binary_request(q, k, k)
    assert len(body) < LIMITS_MAX_REQUEST_BYTES
    assert "--max_tensor_elements" in error_of(requests.post(url, data=body, headers=headers, timeout=30), 413)
    # The server still answers on this connection pool.
    q, k, v = small_qkv()
    body, headers = binary_request(q, k, v)
    assert requests.post(url, data=body, headers=headers, timeout=30).status_code == 200


# --- a private server: model name flag, overload, large request ------------------------------------------------------


@pytest.fixture(scope="module")
def private(flashserve_bin, tmp_path_factory):
    """--model_name=flash, one worker and a queue of 1 (overload is easy), metrics on a known port."""
    metrics_port = free_port()
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("kserve_private"),
                      ["--model_name=flash", "--queue_capacity=1", "--worker_threads=1",
                       f"--metrics_port={metrics_port}"], name="kserve_private").start()
    s.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield s
    assert s.stop() == 0, s.logs()


def test_model_name_flag(private):
    assert requests.get(f"{private.http}/v2/models/flash", timeout=10).json()["name"] == "flash"
    assert requests.get(f"{private.http}/v2/models/flash/ready", timeout=10).status_code == 200
    error_of(requests.get(f"{private.http}/v2/models/attention", timeout=10), 404)


def test_a_large_json_answer_does_not_hold_up_other_requests(private):
    """An 8M-element O in JSON text takes the server a second or more to format. It was formatted on the thread that
    finished the call (the CPU backend's one worker here, a CUDA slot's completion thread there), and every request
    behind it waited: small ones sent meanwhile took as long as the large one (3 s of a 3.8 s answer)."""
    big_q = np.ones((1, 2048, 32, 128), np.float16)  # Sk 1: the compute is trivial, the JSON is not
    kv = np.ones((1, 1, 32, 128), np.float16)
    body, headers = binary_request(big_q, kv, kv.copy())
    done = {}
    start = time.monotonic()

    def send_big():
        r = requests.post(infer_url(private, "flash"), data=body, headers=headers, timeout=120)
        done["big"] = time.monotonic() - start
        done["status"] = r.status_code
        done["elements"] = len(r.json()["outputs"][0]["data"]) if r.status_code == 200 else 0

    big = threading.Thread(target=send_big)
    big.start()
    time.sleep(0.3)  # its upload and compute are over by now, or at least under way
    small = []
    for _ in range(3):
        q, k, v = small_qkv()
        small_body, small_headers = binary_request(q, k, v, parameters={"binary_data_output": True})
        t = time.monotonic()
        r = requests.post(infer_url(private, "flash"), data=small_body, headers=small_headers, timeout=120)
        assert r.status_code == 200, r.text
        small.append(time.monotonic() - t)
    big.join()
    assert done["status"] == 200 and done["elements"] == big_q.size
    assert done["big"] > 0.6, f"the large answer took {done['big']:.2f} s: too quick for this test to tell"
    assert max(small) < done["big"] / 3, f"small requests took {small} s beside a {done['big']:.2f} s JSON answer"


def test_errors_overloaded(private, rng):
    """With the queue full (slow native requests in flight), a REST inference gets 503 at once."""
    slow = rng.standard_normal((1, 2048, 8, 64)).astype(np.float32)
    tensor = pb.Tensor(dtype=pb.FLOAT32, shape=list(slow.shape), data=slow.tobytes())
    channel = grpc.insecure_channel(private.address, options=[("grpc.max_receive_message_length", 1 << 30)])
    stub = pb_grpc.AttentionServiceStub(channel)
    futures = [stub.Attention.future(pb.AttentionRequest(q=tensor, k=tensor, v=tensor), timeout=120)
               for _ in range(4)]
    q, k, v = small_qkv()
    body, headers = binary_request(q, k, v)
    statuses = []
    try:
        # Post only once one slow request waits in the queue: on a loaded machine the 12 MiB uploads can
        # take longer than a small REST inference, which then found the queue empty (flaky in CI).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(f.done() for f in futures):
            depth = re.search(r"^flashserve_queue_depth (\S+)$", requests.get(private.metrics_url, timeout=10).text, re.M)
            if depth and float(depth.group(1)) >= 1:
                break
            time.sleep(0.005)
        while not all(f.done() for f in futures) and 503 not in statuses:
            r = requests.post(infer_url(private, model="flash"), data=body, headers=headers, timeout=60)
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert "queue full" in error_of(r, 503)
    finally:
        for f in futures:
            try:
                f.result()
            except grpc.RpcError:
                pass  # RESOURCE_EXHAUSTED for the ones that found the queue full
        channel.close()
    assert 503 in statuses, statuses
    assert requests.post(infer_url(private, model="flash"), data=body, headers=headers, timeout=60).status_code == 200


def test_large_binary_request_byte_accounting(private, rng, check_answer):
    """A 64 MiB fp16 Q (cheap: two keys) in, a 64 MiB O out; request_bytes_total counts exactly the bodies."""
    q = rng.standard_normal((8, 1024, 32, 128)).astype(np.float16)  # 64 MiB
    k = rng.standard_normal((8, 2, 32, 128)).astype(np.float16)
    v = rng.standard_normal((8, 2, 32, 128)).astype(np.float16)
    body, headers = binary_request(q, k, v, parameters={"binary_data_output": True})
    assert len(body) >= 64 << 20
    before = metrics_helpers.scrape(private.metrics_url)
    response = requests.post(infer_url(private, model="flash"), data=body, headers=headers, timeout=120)
    header, outputs = decode(response)
    after = metrics_helpers.scrape(private.metrics_url)
    out = outputs["O"]
    assert out.shape == q.shape and out.dtype == np.float16
    for b in (0, 5):  # the fp64 reference on two batch entries keeps the test's memory small
        check_answer(out[b:b + 1], None, q[b:b + 1], k[b:b + 1], v[b:b + 1])
    name = "flashserve_request_bytes_total"
    assert after.value(name, direction="in") - before.value(name, direction="in") == len(body)
    assert after.value(name, direction="out") - before.value(name, direction="out") == len(response.content)
    requests_total = "flashserve_requests_total"
    assert (after.value(requests_total, method="KServeInfer", status="OK")
            - before.value(requests_total, method="KServeInfer", status="OK")) == 1
    # A refused call's error body is not an answer: out counts nothing for it, as on gRPC.
    refused = requests.post(infer_url(private, model="flash"), data=b"{not json", timeout=30)
    assert refused.status_code == 400 and refused.content
    again = metrics_helpers.scrape(private.metrics_url)
    assert again.value(name, direction="out") == after.value(name, direction="out")


def test_concurrent_rest_requests(server, rng, make_qkv, check_answer):
    """Several HTTP clients at once (the edge's handler threads block on their answers)."""
    problems = [make_qkv(rng, 1, 16, 24, 2, 2, 64, "float16") for _ in range(8)]
    results = [None] * len(problems)

    def run(i):
        body, headers = binary_request(*problems[i], parameters={"binary_data_output": True})
        results[i] = decode(requests.post(infer_url(server), data=body, headers=headers, timeout=60))[1]["O"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (q, k, v), out in zip(problems, results):
        check_answer(out, None, q, k, v)
