"""The gRPC port's token gate (server/edge/grpc/grpc_auth.h) on a plaintext server with a token: every service but
health refuses a call without the token before its message is read (a 256 MiB message without a token must not grow
the server's memory), counts the refusal under the method's label, and lets the same call through with the token."""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import free_port
from flashserve import attention_pb2 as pb
from flashserve import attention_pb2_grpc as pb_grpc
from metrics_helpers import parse
from test_kserve_grpc import oip  # noqa: F401 - the fixture

pytestmark = pytest.mark.e2e

TOKEN = "gate-token-0123456789abcdef"
BIG = 2**31 - 1
MIB = 1 << 20


@pytest.fixture(scope="module")
def gated(flashserve_bin, tmp_path_factory):
    from conftest import ServerProcess, _stop_and_check

    d = tmp_path_factory.mktemp("gated")
    (d / "token").write_text(TOKEN + "\n")
    port = free_port()
    s = ServerProcess(flashserve_bin, d, [f"--auth_token_file={d / 'token'}", f"--metrics_port={port}"],
                      name="gated").start()
    s.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield s
    _stop_and_check(s)


@pytest.fixture
def channel(gated):
    with grpc.insecure_channel(gated.address, options=[("grpc.max_send_message_length", BIG),
                                                       ("grpc.max_receive_message_length", BIG)]) as c:
        yield c


def _scrape(server):
    request = urllib.request.Request(server.metrics_url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=5) as r:
        return parse(r.read().decode("utf-8"), r.headers.get("Content-Type", ""))


def _metadata(token):
    return (("authorization", f"Bearer {token}"),) if token else ()


def _header():
    h = pb.AttentionRequest()
    for t in (h.q, h.k, h.v):
        t.dtype = pb.FLOAT32
        t.shape.extend([1, 4, 1, 8])
    return h


def _calls(channel, oip):
    """(method label, call(metadata)) for one call of every method that needs the token."""
    native = pb_grpc.AttentionServiceStub(channel)
    stream = pb_grpc.AttentionStreamServiceStub(channel)
    kserve = oip[1].GRPCInferenceServiceStub(channel)
    kpb = oip[0]
    q = np.zeros((1, 4, 1, 8), np.float32)
    attention = pb.AttentionRequest(q=pb.Tensor(dtype=pb.FLOAT32, shape=q.shape, data=q.tobytes()))
    attention.k.CopyFrom(attention.q)
    attention.v.CopyFrom(attention.q)
    reflection = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                       request_serializer=lambda b: b, response_deserializer=lambda b: b)
    return [
        ("Attention", lambda md: native.Attention(attention, metadata=md, timeout=10)),
        ("GetServerInfo", lambda md: native.GetServerInfo(pb.GetServerInfoRequest(), metadata=md, timeout=10)),
        ("ModelInfer", lambda md: kserve.ModelInfer(kpb.ModelInferRequest(model_name="nope"), metadata=md,
                                                    timeout=10)),
        ("ModelReady", lambda md: kserve.ModelReady(kpb.ModelReadyRequest(name="attention"), metadata=md,
                                                    timeout=10)),
        ("ServerMetadata", lambda md: kserve.ServerMetadata(kpb.ServerMetadataRequest(), metadata=md, timeout=10)),
        ("ModelMetadata", lambda md: kserve.ModelMetadata(kpb.ModelMetadataRequest(name="attention"), metadata=md,
                                                          timeout=10)),
        ("OpenSession", lambda md: stream.OpenSession(_header(), metadata=md, timeout=10)),
        ("Upload", lambda md: stream.Upload(iter([pb.AttentionChunk(session_id="x", tensor=pb.TENSOR_Q, data=b"x")]),
                                            metadata=md, timeout=10)),
        ("Compute", lambda md: stream.Compute(pb.ComputeRequest(session_id="x"), metadata=md, timeout=10)),
        ("Download", lambda md: list(stream.Download(pb.DownloadRequest(session_id="x", tensor=pb.TENSOR_OUT),
                                                     metadata=md, timeout=10))),
        ("CloseSession", lambda md: stream.CloseSession(pb.CloseSessionRequest(session_id="x"), metadata=md,
                                                        timeout=10)),
        ("other", lambda md: list(reflection(iter([b"\x3a\x00"]), metadata=md, timeout=10))),  # list_services
    ]


def _code(call, metadata):
    try:
        call(metadata)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_every_service_needs_the_token_and_counts_refusals(gated, channel, oip):
    before = _scrape(gated)
    calls = _calls(channel, oip)
    for label, call in calls:
        for metadata in (_metadata(None), _metadata("wrong-token-0123456789abc"), _metadata(TOKEN[:-1])):
            code, details = _code(call, metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (label, code, details)
            assert details == "missing or invalid bearer token", (label, details)
        code, details = _code(call, _metadata(TOKEN))  # the same call with the token gets past the gate
        assert code != grpc.StatusCode.UNAUTHENTICATED, (label, details)
    after = _scrape(gated)
    for label, _ in calls:
        refused = (after.value("flashserve_requests_total", method=label, status="UNAUTHENTICATED")
                   - before.value("flashserve_requests_total", method=label, status="UNAUTHENTICATED"))
        assert refused == 3, (label, refused)


def test_health_needs_no_token(gated, channel, oip):
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    kserve = oip[1].GRPCInferenceServiceStub(channel)
    assert kserve.ServerLive(oip[0].ServerLiveRequest(), timeout=10).live
    assert kserve.ServerReady(oip[0].ServerReadyRequest(), timeout=10).ready


def _memory_kib(pid):
    """(VmRSS, VmHWM) of a process in KiB."""
    status = open(f"/proc/{pid}/status").read()
    return tuple(int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M).group(1)) for key in ("VmRSS", "VmHWM"))


@pytest.mark.parametrize("method", ["ModelInfer", "OpenSession", "Attention"])
def test_unauthenticated_256_mib_is_refused_before_it_is_read(start_server, tmp_path, oip, method):
    """The message is refused from its headers: the server's peak RSS must not grow by anything near its size.
    gRPC still reads (and drops) what the client sent before the refusal reached it: at most the stream's
    flow-control window (edge/grpc/grpc_auth.h), so the bound is 64 MiB, a quarter of the message. A fresh server
    per case: VmHWM is the process's peak so far."""
    (tmp_path / "token").write_text(TOKEN)
    gated = start_server(f"--auth_token_file={tmp_path / 'token'}", name="gate256")
    channel = grpc.insecure_channel(gated.address, options=[("grpc.max_send_message_length", BIG)])
    payload = np.random.default_rng(1).integers(0, 255, 256 * MIB, dtype=np.uint8).tobytes()
    if method == "ModelInfer":
        request = oip[0].ModelInferRequest(model_name="attention")
        request.inputs.add(name="Q", datatype="FP32", shape=[1, 64 * MIB // 8, 1, 8])
        request.raw_input_contents.append(payload)
        call = oip[1].GRPCInferenceServiceStub(channel).ModelInfer
    elif method == "OpenSession":
        request = _header()
        request.q.data = payload
        call = pb_grpc.AttentionStreamServiceStub(channel).OpenSession
    else:
        request = pb.AttentionRequest(q=pb.Tensor(dtype=pb.FLOAT32, shape=[1, 64 * MIB // 8, 1, 8], data=payload))
        call = pb_grpc.AttentionServiceStub(channel).Attention
    pid = gated.proc.pid
    rss_before, hwm_before = _memory_kib(pid)
    for _ in range(2):
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
    rss_after, hwm_after = _memory_kib(pid)
    grew_mib = (hwm_after - hwm_before) / 1024
    print(f"{method}: 2 x 256 MiB refused, last in {time.monotonic() - started:.2f} s; server VmHWM "
          f"{hwm_before / 1024:.0f} -> {hwm_after / 1024:.0f} MiB (+{grew_mib:.1f}), VmRSS "
          f"{rss_before / 1024:.0f} -> {rss_after / 1024:.0f} MiB")
    assert grew_mib < 64, f"the server's peak RSS grew by {grew_mib:.0f} MiB for a refused 256 MiB message"
    # The server still answers, with the token.
    assert pb_grpc.AttentionServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(), metadata=_metadata(TOKEN),
                                                               timeout=10).backend == "cpu"
    channel.close()
    assert gated.stop() == 0
