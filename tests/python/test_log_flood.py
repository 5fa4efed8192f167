"""A client cannot flood the server's log: calls refused for a missing token are counted, not logged at warn (HTTP
did so already), and the warnings other failures cause are capped at a burst of 50 and 10 per second (the rest go at
debug level; the next warning says how many). One client sending bad calls as fast as it could wrote ~30 MB of
warnings per second (audit): every refused or failed call, gRPC or HTTP, wrote a line of up to 16 KiB."""
from __future__ import annotations

import time
import urllib.error
import urllib.request

import grpc

from flashserve import attention_pb2 as pb
from flashserve import attention_pb2_grpc as pb_grpc

CALLS = 600
BURST, PER_SECOND = 50, 10


def _warnings(server, text: str) -> int:
    return sum(1 for line in server.logs(limit=1 << 24).splitlines() if "[warning]" in line and text in line)


def _bad_attention_calls(address: str, metadata=()) -> float:
    """CALLS Attention calls with a q of the wrong rank (INVALID_ARGUMENT); returns the seconds they took."""
    start = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        request = pb.AttentionRequest(q=pb.Tensor(dtype=pb.FLOAT32, shape=[3], data=b"\0" * 12))
        for _ in range(CALLS):
            try:
                stub.Attention(request, metadata=metadata, timeout=10)
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED), e
    return time.monotonic() - start


def test_calls_without_the_token_are_not_logged_at_warn(start_server, tmp_path):
    (tmp_path / "token").write_text("flood-token-0123456789abcdef\n")
    server = start_server(f"--auth_token_file={tmp_path / 'token'}", name="gated")
    _bad_attention_calls(server.address)
    time.sleep(0.3)
    assert _warnings(server, "UNAUTHENTICATED") == 0, server.logs()


def test_failed_calls_warn_within_the_budget(start_server):
    server = start_server(name="flooded")
    seconds = _bad_attention_calls(server.address)
    time.sleep(0.3)
    failed = _warnings(server, "failed: request_id")
    assert 1 <= failed <= BURST + PER_SECOND * (seconds + 1), (failed, seconds)
    assert _warnings(server, "went to debug level") >= 1 or failed == CALLS


def test_failed_http_requests_warn_within_the_budget(start_server):
    server = start_server(name="flooded_http")
    url = f"http://127.0.0.1:{server.http_port}/v2/models/attention/infer"
    start = time.monotonic()
    for _ in range(CALLS // 2):
        try:
            urllib.request.urlopen(urllib.request.Request(url, data=b"{bad json", method="POST"), timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code == 400, e.code
    seconds = time.monotonic() - start
    time.sleep(0.3)
    failed = _warnings(server, "failed: http=400")
    assert 1 <= failed <= BURST + PER_SECOND * (seconds + 1), (failed, seconds)
