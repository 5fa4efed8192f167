"""Bytes that do not parse as a method's request, on every unary method of every service the gRPC edge serves.

gRPC 1.51's typed callback methods answer such bytes UNIMPLEMENTED with an empty message before any handler runs: a
client reads "no such method", and the call is counted nowhere. A C++ or Go client can send them (a proto3 string
that is not UTF-8 fails the C++ parse). The edge registers every method raw and parses the request itself
(server/edge/grpc/grpc_call.h): INVALID_ARGUMENT naming the message -- and the field, for a string that is not UTF-8
-- counted under the method like any other refusal. Protobuf's own complaint about such a string goes through the
server's logger, so --log_format json stays one JSON object per line.
"""

from __future__ import annotations

import json

import grpc
import pytest

from flashserve import attention_pb2, sequences_pb2

from metrics_helpers import scrape

pytestmark = pytest.mark.e2e

GARBAGE = b"\xff\xff\xff"  # field 31 with wire type 7: not protobuf
NOT_UTF8 = b"\xff\xfe"
HEALTH = {"ServerLive", "ServerReady"}  # open and uncounted (edge/grpc/grpc_auth.h)

# KServe's service comes from proto/inference (not a client module): method -> (request type, its string field
# number 1, or None).
KSERVE = {
    "ServerLive": ("ServerLiveRequest", None),
    "ServerReady": ("ServerReadyRequest", None),
    "ModelReady": ("ModelReadyRequest", "name"),
    "ServerMetadata": ("ServerMetadataRequest", None),
    "ModelMetadata": ("ModelMetadataRequest", "name"),
    "ModelInfer": ("ModelInferRequest", "model_name"),
    "SystemSharedMemoryStatus": ("SystemSharedMemoryStatusRequest", "name"),
    "SystemSharedMemoryRegister": ("SystemSharedMemoryRegisterRequest", "name"),
    "SystemSharedMemoryUnregister": ("SystemSharedMemoryUnregisterRequest", "name"),
    "CudaSharedMemoryStatus": ("CudaSharedMemoryStatusRequest", "name"),
    "CudaSharedMemoryRegister": ("CudaSharedMemoryRegisterRequest", "name"),
    "CudaSharedMemoryUnregister": ("CudaSharedMemoryUnregisterRequest", "name"),
}



def _first_string_field(descriptor):
    for field in descriptor.fields:
        if field.type == field.TYPE_STRING:
            return field
    return None


def _methods():
    """(path, method label, request type's full name, (field name, number) of a top-level string or None)."""
    rows = []
    for module, service in ((attention_pb2, "AttentionService"), (attention_pb2, "AttentionStreamService"),
                            (sequences_pb2, "Sequences")):
        for method in module.DESCRIPTOR.services_by_name[service].methods:
            if method.client_streaming or method.server_streaming:
                continue  # Upload and Download read their own chunk format
            field = _first_string_field(method.input_type)
            rows.append((f"/{method.containing_service.full_name}/{method.name}", method.name,
                         method.input_type.full_name, (field.name, field.number) if field else None))
    for name, (request_type, field) in KSERVE.items():
        rows.append((f"/inference.GRPCInferenceService/{name}", name, f"inference.{request_type}",
                     (field, 1) if field else None))
    return rows


METHODS = _methods()


def _string_field(number: int, value: bytes) -> bytes:
    assert number < 16 and len(value) < 128
    return bytes([number << 3 | 2, len(value)]) + value


def _call(channel, path, body):
    try:
        channel.unary_unary(path)(body, timeout=10)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _refused(server, label):
    return scrape(f"http://127.0.0.1:{server.metrics_port}/metrics").value(
        "flashserve_requests_total", method=label, status="INVALID_ARGUMENT")


def test_the_table_covers_every_unary_method():
    paths = {path for path, *_ in METHODS}
    # AttentionService 2, AttentionStreamService 3 unary (of 5), Sequences 8, KServe 12.
    assert len(paths) == len(METHODS) == 2 + 3 + 8 + 12
    assert "/flashserve.v1.Sequences/DecodeStep" in paths and "/inference.GRPCInferenceService/ModelInfer" in paths


@pytest.mark.parametrize("path,label,message,string_field", METHODS, ids=[m[1] for m in METHODS])
def test_unparsable_bytes_are_invalid_argument_naming_the_message(server, path, label, message, string_field):
    before = _refused(server, label)
    with grpc.insecure_channel(server.address) as channel:
        code, details = _call(channel, path, GARBAGE)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert f"{message}: malformed protobuf bytes" in details, details
        sent = 1
        if string_field is not None:
            name, number = string_field
            code, details = _call(channel, path, _string_field(number, NOT_UTF8))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            assert f"{message}: malformed protobuf bytes" in details, details
            assert f"String field '{message}.{name}' contains invalid UTF-8 data)" in details, details
            sent += 1
        # The server still serves.
        info = attention_pb2.ServerInfo.FromString(
            channel.unary_unary("/flashserve.v1.AttentionService/GetServerInfo")(b"", timeout=10))
        assert info.version
    assert _refused(server, label) == before + (0 if label in HEALTH else sent)


def test_protobuf_complaints_stay_json_lines(start_server):
    server = start_server("--log_format=json", name="json-logs")
    request_id = attention_pb2.AttentionRequest.DESCRIPTOR.fields_by_name["request_id"].number
    not_utf8 = _string_field(request_id, NOT_UTF8)
    with grpc.insecure_channel(server.address) as channel:
        for path, body in (("/flashserve.v1.AttentionService/Attention", not_utf8),  # protobuf logs this one
                           ("/flashserve.v1.Sequences/GetSequenceInfo", _string_field(1, NOT_UTF8))):
            code, _ = _call(channel, path, body)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
    server.stop()
    logs = server.logs(limit=200000)
    assert "contains invalid UTF-8" in logs  # protobuf said it, and it was logged...
    assert "libprotobuf" not in logs  # ...not by protobuf's own stderr handler
    for line in logs.splitlines():
        if "invalid UTF-8" in line or "malformed protobuf" in line:
            record = json.loads(line)  # every such line is a JSON object
            assert record["level"] == "warning", record
