"""flashserve_requests_total counts a native Attention call that ends without a complete request as what happened to
it (server/edge/grpc/attention_call.cc), not as one INVALID_ARGUMENT for every such end:

* a request gRPC refused as larger than --max_request_bytes (the client gets RESOURCE_EXHAUSTED "Received message
  larger than max"): RESOURCE_EXHAUSTED, so FlashserveShedding (deploy/prometheus/alerts.yml) sees it;
* a client that resets its stream or drops its connection mid-upload: CANCELLED;
* a deadline that passes mid-upload: DEADLINE_EXCEEDED;
* a client that ends its stream with a truncated message: INVALID_ARGUMENT, which it receives.

Raw HTTP/2 (the `h2` package, as tests/python/hostile_grpc_stream.py) sends the calls no gRPC client would."""

from __future__ import annotations

import socket
import struct
import time

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from conftest import ServerProcess
from flashserve import attention_pb2 as pb
from flashserve import attention_pb2_grpc as pb_grpc
from metrics_helpers import scrape

pytestmark = pytest.mark.e2e

LIMIT = 1 << 20  # --max_request_bytes
ATTENTION = "/flashserve.v1.AttentionService/Attention"
STATUSES = ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED")
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


@pytest.fixture(scope="module")
def oversize_server(flashserve_bin, tmp_path_factory):
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("oversize_server"), [f"--max_request_bytes={LIMIT}"],
                      name="oversize_server").start()
    yield s
    code = s.stop()
    assert code == 0, f"oversize_server exited with {code}\n{s.logs()}"


def attention_counts(server, method: str = "Attention") -> dict:
    exported = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    return {status: exported.value("flashserve_requests_total", method=method, status=status)
            for status in STATUSES}


def counted(server, before: dict, expected: dict, timeout: float = 10.0, method: str = "Attention") -> dict:
    """Waits until Attention's counts moved from `before` by `expected` (status -> increase; others by 0) -- a
    call may be counted just after its client heard the answer -- and returns the increases seen last."""
    deadline = time.monotonic() + timeout
    while True:
        now = attention_counts(server, method)
        moved = {status: now[status] - before[status] for status in STATUSES if now[status] != before[status]}
        if moved == expected or time.monotonic() > deadline:
            return moved
        time.sleep(0.05)


def raw_call(address: str, claim: int, body: bytes, end: str, headers=(), wait_s: float = 5.0) -> str:
    """One Attention call on a new HTTP/2 connection: a gRPC prefix claiming `claim` bytes, `body` (under the 64 KiB
    initial window), then `end`: "end_stream" (half-close), "reset" (RST_STREAM CANCEL), "close" (drop the
    connection) or "wait" (neither: until the server ends the call). Returns the gRPC status the server sent on the
    stream ("" when none came within `wait_s`)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", ATTENTION),
                                   (":authority", address), ("content-type", "application/grpc"),
                                   ("te", "trailers"), *headers])
        data = struct.pack(">BI", 0, claim) + body
        for start in range(0, len(data), 16384):  # HTTP/2's default largest frame
            conn.send_data(stream, data[start:start + 16384], end_stream=end == "end_stream" and start + 16384 >= len(data))
        if end == "reset":
            conn.reset_stream(stream, error_code=0x8)
        sock.sendall(conn.data_to_send())
        if end in ("reset", "close"):
            time.sleep(0.2)
            return ""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                data = sock.recv(1 << 16)
            except socket.timeout:
                break
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    status = dict(event.headers).get("grpc-status")
                    if status is not None:
                        return CODE_NAMES.get(int(status), status)
                elif isinstance(event, h2.events.StreamReset):
                    return f"reset {event.error_code}"
            sock.sendall(conn.data_to_send())
        return ""


def test_a_request_over_max_request_bytes_counts_as_resource_exhausted(oversize_server):
    before = attention_counts(oversize_server)
    with grpc.insecure_channel(oversize_server.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        for size in (LIMIT + 1, 2 * LIMIT, 16 * LIMIT):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Attention(pb.AttentionRequest(request_id="x" * size), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            assert "larger than max" in refused.value.details(), refused.value.details()
    # It used to count as INVALID_ARGUMENT ("no complete message was received"): FlashserveShedding missed it.
    assert counted(oversize_server, before, {"RESOURCE_EXHAUSTED": 3}) == {"RESOURCE_EXHAUSTED": 3}


def test_many_requests_over_the_limit_at_once_all_count_as_resource_exhausted(oversize_server):
    """gRPC's cancellation of such a call may reach the server's handler before or after its read ends."""
    before = attention_counts(oversize_server)
    with grpc.insecure_channel(oversize_server.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        calls = [stub.Attention.future(pb.AttentionRequest(request_id="y" * (LIMIT + 1000 * i)), timeout=60)
                 for i in range(32)]
        codes = {call.exception().code() for call in calls}
    assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert counted(oversize_server, before, {"RESOURCE_EXHAUSTED": 32}) == {"RESOURCE_EXHAUSTED": 32}


@pytest.mark.parametrize("end", ["reset", "close"])
def test_a_client_that_leaves_mid_upload_counts_as_cancelled(oversize_server, end):
    before = attention_counts(oversize_server)
    raw_call(oversize_server.address, claim=LIMIT // 2, body=bytes(30000), end=end)
    assert counted(oversize_server, before, {"CANCELLED": 1}) == {"CANCELLED": 1}


def test_a_deadline_that_passes_mid_upload_counts_as_deadline_exceeded(oversize_server):
    before = attention_counts(oversize_server)
    status = raw_call(oversize_server.address, claim=LIMIT // 2, body=bytes(30000), end="wait",
                      headers=[("grpc-timeout", "300m")])
    assert status == "DEADLINE_EXCEEDED", status
    assert counted(oversize_server, before, {"DEADLINE_EXCEEDED": 1}) == {"DEADLINE_EXCEEDED": 1}


def test_a_truncated_message_is_invalid_argument_for_the_client_and_the_count(oversize_server):
    before = attention_counts(oversize_server)
    status = raw_call(oversize_server.address, claim=LIMIT // 2, body=bytes(30000), end="end_stream")
    assert status == "INVALID_ARGUMENT", status
    assert counted(oversize_server, before, {"INVALID_ARGUMENT": 1}) == {"INVALID_ARGUMENT": 1}


def test_an_upload_chunk_over_max_request_bytes_counts_as_resource_exhausted(oversize_server):
    before = attention_counts(oversize_server, "Upload")
    with grpc.insecure_channel(oversize_server.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = pb_grpc.AttentionStreamServiceStub(channel)
        for size in (LIMIT + 1, 4 * LIMIT):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Upload(iter([pb.AttentionChunk(session_id="s", data=bytes(size))]), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        # An Upload that sends no chunk at all ends as the client asked: an ack of 0 bytes, OK.
        assert stub.Upload(iter([]), timeout=30).bytes_received == 0
    # The chunks over the limit used to count as OK.
    expected = {"RESOURCE_EXHAUSTED": 2, "OK": 1}
    assert counted(oversize_server, before, expected, method="Upload") == expected
