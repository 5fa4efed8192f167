"""Compressed gRPC requests are refused before they are inflated: gRPC 1.51 inflates a whole message before it checks
--max_request_bytes, outside --grpc_memory_quota_bytes, so ~1 MB of gzip made the server hold 1 GiB per call (an
audit's compression bomb: 4 calls, 2.2 GiB peak on a server capped at 256 MiB per message and a 320 MiB quota).
Tensors do not compress anyway, so the server takes identity only (server/edge/grpc/grpc_edge.cc)."""

from __future__ import annotations

import socket
import struct
import threading
import zlib

import grpc
import numpy as np
import pytest

from flashserve import attention_pb2 as pb
from flashserve import attention_pb2_grpc as pb_grpc
from flashserve import sequences_pb2 as spb
from flashserve import sequences_pb2_grpc
from flashserve import tensors
from grpc_filler import filler_head
from test_http_hostile import rss_kib

pytestmark = pytest.mark.e2e
MiB = 1 << 20
BOMB_MIB = 512  # what each message inflates to (~0.5 MB of gzip)


def _gzip_bomb(inflated: int) -> bytes:
    """A gRPC length-prefixed message, compressed flag set: one unknown bytes field of zeros, `inflated` bytes in all
    (valid protobuf for any message: an unknown field)."""
    head, length = filler_head(inflated)
    gz = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [gz.compress(head)]
    zeros = bytes(MiB)
    for left in range(length, 0, -MiB):
        parts.append(gz.compress(zeros[:min(left, MiB)]))
    parts.append(gz.flush())
    body = b"".join(parts)
    return struct.pack(">BI", 1, len(body)) + body


def _raw_gzip_call(port: int, path: str, payload: bytes) -> str:
    """Sends `payload` as a gzip-encoded gRPC request over raw HTTP/2; the grpc-status (or how the stream ended)."""
    h2_connection = pytest.importorskip("h2.connection")
    import h2.config
    import h2.events

    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        conn = h2_connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        conn.increment_flow_control_window(1 << 30)
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                   (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                                   ("te", "trailers"), ("grpc-encoding", "gzip"), ("grpc-accept-encoding", "gzip")])
        s.sendall(conn.data_to_send())
        sent = 0
        while True:
            while sent < len(payload):
                n = min(conn.local_flow_control_window(stream), conn.max_outbound_frame_size, len(payload) - sent)
                if n <= 0:
                    break
                conn.send_data(stream, payload[sent:sent + n], end_stream=sent + n == len(payload))
                sent += n
            s.sendall(conn.data_to_send())
            data = s.recv(MiB)
            if not data:
                return "closed"
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    headers = dict(event.headers)
                    if "grpc-status" in headers:
                        return headers["grpc-status"]
                elif isinstance(event, h2.events.StreamReset):
                    return f"reset {event.error_code}"
            s.sendall(conn.data_to_send())


def test_a_gzip_request_is_refused(start_server, rng):
    """A client that compresses (grpcio's compression=Gzip) gets UNIMPLEMENTED naming the algorithm, on every service;
    the same call uncompressed works."""
    server = start_server("--kv_cache_bytes=4194304")
    q, k, v = (rng.standard_normal((1, 5, 2, 32)).astype(np.float16) for _ in range(3))
    request = pb.AttentionRequest(q=tensors.to_proto(q, "q"), k=tensors.to_proto(k, "k"), v=tensors.to_proto(v, "v"))
    with grpc.insecure_channel(server.address) as channel:
        attention = pb_grpc.AttentionServiceStub(channel)
        sequences = sequences_pb2_grpc.SequencesStub(channel)
        for call, message in ((attention.Attention, request), (sequences.GetKvPoolInfo, spb.GetKvPoolInfoRequest())):
            with pytest.raises(grpc.RpcError) as refused:
                call(message, timeout=30, compression=grpc.Compression.Gzip)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED, refused.value
            assert "gzip" in refused.value.details(), refused.value.details()
            call(message, timeout=30)


def test_a_compression_bomb_is_refused_before_it_is_inflated(start_server):
    """Four ~0.5 MB gzip messages that inflate to 512 MiB each, at once, to the native, KServe and striped methods:
    every one refused, and the server's peak RSS grows by far less than one inflated message."""
    server = start_server(f"--max_request_bytes={256 * MiB}", f"--grpc_memory_quota_bytes={320 * MiB}")
    payload = _gzip_bomb(BOMB_MIB * MiB)
    assert len(payload) < MiB
    before = rss_kib(server.proc.pid, "VmHWM")
    paths = ["/flashserve.v1.AttentionService/Attention", "/inference.GRPCInferenceService/ModelInfer",
             "/flashserve.v1.AttentionStreamService/Upload", "/flashserve.v1.Sequences/DecodeStep"]
    answers = [None] * len(paths)

    def send(i):
        answers[i] = _raw_gzip_call(server.grpc_port, paths[i], payload)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(paths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    grown_mib = (rss_kib(server.proc.pid, "VmHWM") - before) / 1024
    assert all(a is not None and a != "0" for a in answers), answers  # none answered OK
    assert grown_mib < 128, f"peak RSS +{grown_mib:.0f} MiB for {len(paths)} x {BOMB_MIB} MiB bombs: inflated"
    assert server.proc.poll() is None
