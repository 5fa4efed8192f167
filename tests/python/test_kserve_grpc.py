"""KServe v2 / Open Inference Protocol gRPC (inference.GRPCInferenceService on the gRPC port) against the real binary,
through stubs generated at test time from proto/inference/open_inference_grpc.proto."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest

from conftest import LIMITS_MAX_TENSOR_ELEMENTS, REPO_ROOT

pytestmark = pytest.mark.e2e

PROTO = REPO_ROOT / "proto" / "inference" / "open_inference_grpc.proto"
DATATYPES = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}
NUMPY = {"FP16": np.float16, "BF16": ml_dtypes.bfloat16, "FP32": np.float32}
BIG = 2**31 - 1


@pytest.fixture(scope="module")
def oip(tmp_path_factory):
    """(pb2, pb2_grpc) generated from our .proto with grpc_tools."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dependency of flashserve) is not installed")
    out = tmp_path_factory.mktemp("oip_stubs")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO.parents[1]}", f"--python_out={out}",
                    f"--grpc_python_out={out}", str(PROTO)], check=True)
    sys.path.insert(0, str(out))
    try:
        pb2 = importlib.import_module("inference.open_inference_grpc_pb2")
        pb2_grpc = importlib.import_module("inference.open_inference_grpc_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    return pb2, pb2_grpc


def stub_for(oip, address):
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", BIG),
                                                      ("grpc.max_send_message_length", BIG)])
    return channel, oip[1].GRPCInferenceServiceStub(channel)


@pytest.fixture
def stub(oip, server):
    channel, s = stub_for(oip, server.address)
    yield s
    channel.close()


def infer_request(pb2, q, k, v, model="attention", **parameters):
    request = pb2.ModelInferRequest(model_name=model)
    for name, x in (("Q", q), ("K", k), ("V", v)):
        request.inputs.add(name=name, datatype=DATATYPES[x.dtype.name], shape=list(x.shape))
        request.raw_input_contents.append(np.ascontiguousarray(x).tobytes())
    for key, value in parameters.items():
        param = request.parameters[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        else:
            param.double_param = value
    return request


def outputs_of(response):
    assert len(response.outputs) == len(response.raw_output_contents)
    return {o.name: np.frombuffer(raw, dtype=NUMPY[o.datatype]).reshape(list(o.shape))
            for o, raw in zip(response.outputs, response.raw_output_contents)}


def test_health_and_metadata(oip, stub):
    pb2 = oip[0]
    assert stub.ServerLive(pb2.ServerLiveRequest()).live
    assert stub.ServerReady(pb2.ServerReadyRequest()).ready
    assert stub.ModelReady(pb2.ModelReadyRequest(name="attention")).ready
    assert stub.ModelReady(pb2.ModelReadyRequest(name="attention", version="1")).ready
    meta = stub.ServerMetadata(pb2.ServerMetadataRequest())
    assert meta.name == "flashserve" and meta.version and "binary_tensor_data" in meta.extensions
    model = stub.ModelMetadata(pb2.ModelMetadataRequest(name="attention"))
    assert model.name == "attention" and list(model.versions) == ["1"] and model.platform
    assert [(i.name, list(i.shape)) for i in model.inputs] == [(n, [-1] * 4) for n in "QKV"]
    assert [(o.name, o.datatype, len(o.shape)) for o in model.outputs][1] == ("LSE", "FP32", 3)
    for call, request in ((stub.ModelReady, pb2.ModelReadyRequest(name="bert")),
                          (stub.ModelMetadata, pb2.ModelMetadataRequest(name="bert")),
                          (stub.ModelMetadata, pb2.ModelMetadataRequest(name="attention", version="3"))):
        with pytest.raises(grpc.RpcError) as e:
            call(request)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_message_quoting_a_huge_name_keeps_its_code(oip, stub):
    """A 1 MiB model name quoted whole in the NOT_FOUND message made a trailer past the client's metadata limit (8 KiB
    by default): the client saw RESOURCE_EXHAUSTED. Messages are cut at 4 KiB (on a UTF-8 character boundary)."""
    pb2 = oip[0]
    for name in ("x" * (1 << 20), "\u00e9" * 3000):
        for call, request in ((stub.ModelReady, pb2.ModelReadyRequest(name=name)),
                              (stub.ModelInfer, pb2.ModelInferRequest(model_name=name))):
            with pytest.raises(grpc.RpcError) as e:
                call(request)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, (e.value.code(), e.value.details()[:200])
            details = e.value.details()
            assert details.startswith("unknown model") and "(cut, " in details and len(details.encode()) < 4200
            assert "\ufffd" not in details  # not cut inside a character


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_model_infer(oip, stub, rng, make_qkv, check_answer, dtype):
    q, k, v = make_qkv(rng, 2, 33, 65, 8, 2, 64, dtype)
    request = infer_request(oip[0], q, k, v, causal=True, return_lse=True, softmax_scale=0.1)
    request.id = f"grpc-{dtype}"
    response = stub.ModelInfer(request, timeout=60)
    assert response.id == f"grpc-{dtype}" and response.model_name == "attention" and response.model_version == "1"
    assert response.parameters["kernel"].string_param
    outputs = outputs_of(response)
    assert list(outputs) == ["O", "LSE"]
    check_answer(outputs["O"], outputs["LSE"], q, k, v, causal=True, softmax_scale=0.1)


def test_model_infer_typed_fp32_and_requested_outputs(oip, stub, rng, make_qkv, check_answer):
    """FP32 through contents.fp32_contents; outputs as requested (LSE alone)."""
    pb2 = oip[0]
    q, k, v = make_qkv(rng, 1, 5, 7, 2, 1, 16, "float32")
    request = pb2.ModelInferRequest(model_name="attention", model_version="1")
    for name, x in (("Q", q), ("K", k), ("V", v)):
        tensor = request.inputs.add(name=name, datatype="FP32", shape=list(x.shape))
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
    request.outputs.add(name="LSE")
    request.outputs.add(name="O")
    outputs = outputs_of(stub.ModelInfer(request, timeout=60))
    assert list(outputs) == ["LSE", "O"]
    check_answer(outputs["O"], outputs["LSE"], q, k, v)


def test_a_name_with_a_newline_cannot_forge_a_log_line(oip, limits_server):
    """A failure's log line quotes its status message, which quotes the client's model name: the message is escaped,
    so a newline in the name cannot start a line of its own (it did before: message= was written raw)."""
    channel, stub = stub_for(oip, limits_server.address)
    forged = "[2026-01-01 00:00:00.000] [flashserve] [error] forged by a client"
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelReady(oip[0].ModelReadyRequest(name="x\n" + forged), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    deadline = time.monotonic() + 5
    while "x\\x0a[2026-01-01" not in limits_server.logs() and time.monotonic() < deadline:
        time.sleep(0.05)
    logs = limits_server.logs()
    assert "x\\x0a[2026-01-01" in logs, logs[-2000:]
    assert not any(line.startswith(forged) for line in logs.splitlines()), logs[-2000:]
    channel.close()


def test_model_infer_errors(oip, limits_server):
    """On limits_server (small requests fit): the warnings stay out of the shared server's log."""
    pb2 = oip[0]
    channel, stub = stub_for(oip, limits_server.address)
    q = np.zeros((1, 4, 2, 8), np.float16)
    k = np.zeros((1, 5, 2, 8), np.float16)

    def code_of(stub_, request):
        with pytest.raises(grpc.RpcError) as e:
            stub_.ModelInfer(request, timeout=30)
        return e.value.code(), e.value.details()

    assert code_of(stub, infer_request(pb2, q, k, k, model="bert"))[0] == grpc.StatusCode.NOT_FOUND
    bad_name = infer_request(pb2, q, k, k)
    bad_name.inputs[2].name = "W"
    assert code_of(stub, bad_name) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       'inputs[2].name: unknown input "W" (this model takes Q, K and V)')
    short = infer_request(pb2, q, k, k)
    short.raw_input_contents[1] = short.raw_input_contents[1][:-2]
    code, details = code_of(stub, short)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("k.data")
    fp16_typed = pb2.ModelInferRequest(model_name="attention")
    for name in "QKV":
        fp16_typed.inputs.add(name=name, datatype="FP16", shape=[1, 1, 1, 1]).contents.fp32_contents.append(1.0)
    code, details = code_of(stub, fp16_typed)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents" in details
    bad_param = infer_request(pb2, q, k, k)
    bad_param.parameters["causal"].string_param = "true"
    assert "parameters.causal" in code_of(stub, bad_param)[1]
    big_q = np.zeros((1, LIMITS_MAX_TENSOR_ELEMENTS // 8 + 1, 1, 8), np.float16)
    code, details = code_of(stub, infer_request(pb2, big_q, k[:, :, :1], k[:, :, :1]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max_tensor_elements" in details
    # Still serving.
    assert len(stub.ModelInfer(infer_request(pb2, q, k, k), timeout=30).outputs) == 1
    channel.close()


@pytest.mark.parametrize("method,field", [("ModelInfer", b"\x2a\x00"),  # inputs {} (an empty InferInputTensor)
                                          ("ServerLive", b"\x08\x00")])  # an unknown field; health needs no token
def test_requests_that_parse_into_many_objects_are_refused_unparsed(oip, server, method, field):
    """2 bytes on the wire became a message of ~200 bytes (or an unknown field of ~50) when parsed: 16 MiB of them
    grew the server by 1.8 GiB (ModelInfer) or 0.5 GiB (ServerLive, open without a token), and --max_request_bytes
    allows 1 GiB. Now the objects are counted on the wire first and the request refused."""
    from test_bad_input_matrix import PeakRss

    channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", BIG)])
    call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
    with PeakRss(server.proc.pid) as rss:
        with pytest.raises(grpc.RpcError) as e:
            call(field * (8 << 20), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "more than 65536 messages, strings, map entries and unknown fields" in e.value.details()
    assert rss.growth < 160, f"peak RSS +{rss.growth:.0f} MiB for a 16 MiB request"
    assert oip[1].GRPCInferenceServiceStub(channel).ServerLive(oip[0].ServerLiveRequest()).live
    channel.close()
