"""The real server's surroundings: health (gRPC + HTTP), reflection, server info, --help, the check CLI."""

import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import flashserve

from conftest import http_get

pytestmark = pytest.mark.e2e


def test_grpc_health_standard_stub(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_health_through_client(client):
    assert client.health() is True
    assert client.health_status("") == "SERVING"


@pytest.mark.parametrize("path", ["/v2/health/live", "/v2/health/ready"])
def test_http_health(server, path):
    status, body = http_get(server.http + path)
    assert status == 200, body


def test_http_unknown_path_is_404(server):
    status, _ = http_get(server.http + "/no/such/path")
    assert status == 404


def test_reflection_lists_the_services(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    from google.protobuf.descriptor_pool import DescriptorPool

    with grpc.insecure_channel(server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert "flashserve.v1.AttentionService" in services
        assert "grpc.health.v1.Health" in services
        # The served descriptor is the real one: its methods resolve.
        pool = DescriptorPool(database)
        service = pool.FindServiceByName("flashserve.v1.AttentionService")
        assert {m.name for m in service.methods} == {"Attention", "GetServerInfo"}


def test_server_info(client):
    info = client.server_info()
    assert info.backend == "cpu"
    assert info.version
    assert set(info.dtypes) == {"float16", "bfloat16", "float32"}
    assert info.devices == []
    assert info.max_head_dim >= 256 or 256 in info.head_dims
    assert info.limits.max_request_bytes == 1073741824
    assert info.limits.max_tensor_elements == 268435456
    assert info.limits.queue_capacity == 64
    assert info.worker_threads == 2


def test_server_info_reflects_flags(limits_server):
    from conftest import LIMITS_MAX_REQUEST_BYTES, LIMITS_MAX_TENSOR_ELEMENTS

    with flashserve.Client(limits_server.address, timeout=30) as c:
        info = c.server_info()
    assert info.limits.max_request_bytes == LIMITS_MAX_REQUEST_BYTES
    assert info.limits.max_tensor_elements == LIMITS_MAX_TENSOR_ELEMENTS


def test_help_documents_the_flags(flashserve_bin):
    result = subprocess.run([str(flashserve_bin), "--help"], capture_output=True, text=True, timeout=30)
    text = result.stdout + result.stderr
    assert result.returncode == 0, f"--help exited with {result.returncode}\n{text[-3000:]}"
    for flag in ("--backend", "--grpc_port", "--http_port", "--max_request_bytes", "--max_tensor_elements",
                 "--queue_capacity", "--worker_threads"):
        assert flag.lstrip("-") in text, f"{flag} not documented in --help"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_refused_configuration_exits_2_and_says_why_on_stderr(flashserve_bin, tmp_path, log_format):
    """README "Exit codes": 2 for a refused flag or a file it names. A --tls_cert file that is not there exited 1 (the
    edge's NOT_FOUND was not taken for a refused flag), and a refused flag value was logged on stdout, as plain text
    whatever --log_format said."""
    ports = ["--grpc_port=0", "--http_port=0", "--metrics_port=0"]
    cases = [(["--stream_max_sessions=0"], "--stream_max_sessions"),
             ([f"--tls_cert={tmp_path}/none.pem", f"--tls_key={tmp_path}/none.key"], "none.pem")]
    for flags, named in cases:
        r = subprocess.run([str(flashserve_bin), "--backend=cpu", f"--log_format={log_format}", *ports, *flags],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (flags, r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        assert r.stdout == "", (flags, r.stdout[-2000:])
        lines = [line for line in r.stderr.splitlines() if named in line]
        assert lines, (flags, r.stderr[-2000:])
        if log_format == "json":
            assert json.loads(lines[0])["level"] == "error", lines[0]


def test_check_cli(server):
    result = subprocess.run(
        [sys.executable, "-m", "flashserve", "check", "--address", server.address, "--seed", "7"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "max_abs_err" in result.stdout and "PASS" in result.stdout and "FAIL" not in result.stdout


def test_info_cli(server):
    result = subprocess.run([sys.executable, "-m", "flashserve", "info", "--address", server.address],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "backend:        cpu" in result.stdout
