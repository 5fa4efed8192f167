"""Answers a client does not read: gRPC, then KServe REST. gRPC answers a client does not read (CPU backend, the real binary). A raw HTTP/2 client that opens no flow-control
window lets the server send headers but no data: gRPC keeps each answer -- and the request buffers its slices point
into -- until the window opens. Those answers used to leave --max_inflight_bytes as soon as they were computed, so one
connection held +5.4 MiB per 4 MiB call without bound (1.6 GiB for 300 calls). Now an answer's bytes stay counted
until it has left (later calls get RESOURCE_EXHAUSTED while they are), and an answer not taken within
--answer_timeout_s is dropped: the call is cancelled, its bytes freed."""

from __future__ import annotations

import select
import socket
import struct
import time

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import numpy as np
import pytest

import flashserve
from flashserve import sequences_pb2 as spb
from flashserve import tensors
from flashserve._pb import attention_pb2 as pb

pytestmark = pytest.mark.e2e

BUDGET = 32 << 20  # --max_inflight_bytes: three or four of the calls below
TIMEOUT_S = 10     # --answer_timeout_s: well past the sends below on a loaded machine
CALLS = 16
STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class WindowlessClient:
    """One HTTP/2 connection whose streams get no flow-control window: the server's answers wait unsent."""

    def __init__(self, port: int):
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0, h2.settings.SettingCodes.ENABLE_PUSH: 0})
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.ended = {}  # stream -> gRPC status name (trailers) or "reset"

    def call(self, path: str, message: bytes) -> int:
        """Sends one unary call whole (the server's window allows it) and returns its stream id."""
        body = struct.pack(">BI", 0, len(message)) + message
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                     (":authority", f"127.0.0.1:{self.port}"), ("content-type", "application/grpc"),
                                     ("te", "trailers")])
        sent, deadline = 0, time.monotonic() + 30
        while sent < len(body):
            n = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size, len(body) - sent)
            if n > 0:
                self.conn.send_data(sid, body[sent:sent + n])
                sent += n
            self._flush()
            if n <= 0:
                assert time.monotonic() < deadline, "the server opened no window for the request"
                self.pump(0.05)
        self.conn.end_stream(sid)
        self._flush()
        return sid

    def _flush(self):
        out = self.conn.data_to_send()
        if out:
            self.sock.sendall(out)

    def pump(self, seconds: float) -> None:
        """Reads the server's frames for `seconds`, noting how streams end."""
        until = time.monotonic() + seconds
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return
            if not select.select([self.sock], [], [], left)[0]:
                return
            data = self.sock.recv(1 << 20)
            if not data:
                raise AssertionError("the server closed the connection")
            for event in self.conn.receive_data(data):
                if isinstance(event, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
                    status = dict(event.headers).get("grpc-status")  # on headers: a trailers-only error answer
                    if status is not None:
                        self.ended[event.stream_id] = STATUS_NAMES.get(int(status), status)
                elif isinstance(event, h2.events.StreamReset):
                    self.ended[event.stream_id] = "reset"
            self._flush()

    def close(self):
        self.sock.close()


def _attention_message(rng) -> bytes:
    """4 MiB of q and 4 MiB of O for almost no compute (8 keys)."""
    q = rng.standard_normal((1, 4096, 8, 64)).astype(np.float16)
    k = rng.standard_normal((1, 8, 8, 64)).astype(np.float16)
    v = rng.standard_normal((1, 8, 8, 64)).astype(np.float16)
    return pb.AttentionRequest(q=tensors.to_proto(q, "q"), k=tensors.to_proto(k, "k"),
                               v=tensors.to_proto(v, "v")).SerializeToString()


def _decode_step_message(server, rng) -> bytes:
    """An attend-only DecodeStep of 4 MiB of q (and O): 32 sequences of 8 keys, 16 query rows of 32 heads each."""
    request = spb.DecodeStepRequest()
    with flashserve.SequenceClient(server.address, timeout=30) as client:
        for _ in range(32):
            kv = rng.standard_normal((8, 8, 128)).astype(np.float16)
            seq = client.create(num_layers=1, heads_q=32, heads_kv=8, head_dim=128, dtype="float16",
                                prefix={0: (kv, kv)})
            q = rng.standard_normal((16, 32, 128)).astype(np.float16)
            request.items.add(sequence_id=seq.id, layer=0, q=tensors.to_proto_rows(q, "q"))
    return request.SerializeToString()


def _stream_compute_messages(server, rng, n: int):
    """Striped sessions, each with 4 MiB of q uploaded, and for each a Compute asking for O inline (in its answer)."""
    q = rng.standard_normal((1, 4096, 8, 64)).astype(np.float16)
    kv = rng.standard_normal((1, 8, 8, 64)).astype(np.float16)
    header = pb.AttentionRequest(q=pb.Tensor(dtype=pb.FLOAT16, shape=q.shape), k=pb.Tensor(dtype=pb.FLOAT16,
                                 shape=kv.shape), v=pb.Tensor(dtype=pb.FLOAT16, shape=kv.shape))
    messages = []
    with flashserve.StripedClient(server.address, timeout=30) as client:
        stub = client.stubs[0]
        for _ in range(n):
            session = stub.OpenSession(header, timeout=30).session_id
            chunks = [pb.AttentionChunk(session_id=session, tensor=1, offset=0, data=q.tobytes()),
                      pb.AttentionChunk(tensor=2, offset=0, data=kv.tobytes()),
                      pb.AttentionChunk(tensor=3, offset=0, data=kv.tobytes())]
            stub.Upload(iter(chunks), timeout=30)
            messages.append(pb.ComputeRequest(session_id=session, inline_output=True).SerializeToString())
    return messages


@pytest.mark.parametrize("api", ["attention", "decode_step", "stream_compute"])
def test_unread_answers_count_as_in_flight_and_are_dropped_after_the_timeout(api, start_server, rng):
    server = start_server(f"--max_inflight_bytes={BUDGET}", f"--answer_timeout_s={TIMEOUT_S}",
                          "--kv_cache_bytes=67108864", name="unread")
    if api == "attention":
        path, messages = "/flashserve.v1.AttentionService/Attention", [_attention_message(rng)] * CALLS
    elif api == "decode_step":
        path, messages = "/flashserve.v1.Sequences/DecodeStep", [_decode_step_message(server, rng)] * CALLS
    else:  # 3 sessions: open ones count against a budget of their own (as large): the answers' timeout is tested
        path, messages = "/flashserve.v1.AttentionStreamService/Compute", _stream_compute_messages(server, rng, 3)
    client = WindowlessClient(server.grpc_port)
    try:
        streams = []
        for message in messages:  # one at a time: each is answered (or refused) before the next
            streams.append(client.call(path, message))
            client.pump(0.1)
        client.pump(1.0)
        refused = [s for s in streams if client.ended.get(s) == "RESOURCE_EXHAUSTED"]
        held = [s for s in streams if s not in client.ended]
        assert 1 <= len(held) <= 5, f"answers held unsent: {len(held)} of {len(streams)} ({client.ended})"
        assert len(refused) == len(streams) - len(held), client.ended
        # Held past the timeout: cancelled (reset), their bytes freed for other clients.
        client.pump(TIMEOUT_S + 2.5)
        assert all(client.ended.get(s) in ("CANCELLED", "reset") for s in held), {s: client.ended.get(s) for s in held}
        with flashserve.Client(server.address, timeout=30) as other:
            q = rng.standard_normal((1, 4096, 8, 64)).astype(np.float16)
            kv = rng.standard_normal((1, 8, 8, 64)).astype(np.float16)
            other.attention(q, kv, kv)  # whole budget's worth again: admitted
    finally:
        client.close()
    assert "dropped" in server.logs(limit=20000), "the dropped answers were not logged"


def _post_unread(port: int, body: bytes, headers: dict) -> socket.socket:
    """Sends one REST infer on a connection of its own and never reads the answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # the answer cannot hide in socket buffers
    sock.connect(("127.0.0.1", port))
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    sock.sendall(f"POST /v2/models/attention/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
                 f"{head}\r\n".encode() + body)
    return sock


def test_unread_rest_answers_hold_the_receive_budget_and_are_dropped_after_the_timeout(start_server, rng):
    """KServe REST: a JSON answer (~15 bytes of text per element, ~15 MiB here for 2 MiB of q) waits in the server for
    a client that does not read it. It counted nowhere (15 of them held +569 MiB against a 64 MiB receive budget) and,
    sent a little at a time, never timed out. Now the answer's bytes come out of --http_max_receive_bytes before the
    request is computed (later requests get 503 while it waits), and an answer not taken within --answer_timeout_s
    closes its connection; a request whose body and JSON answer could never fit the budget is refused up front
    (413, naming binary outputs)."""
    requests = pytest.importorskip("requests")
    from test_kserve_rest import binary_request

    server = start_server(f"--http_max_receive_bytes={128 << 20}", f"--answer_timeout_s={TIMEOUT_S}",
                          name="unread_rest")
    q = rng.standard_normal((1, 2048, 8, 64)).astype(np.float16)  # 1 Mi elements: ~15 MiB of JSON, 50 MiB counted
    kv = rng.standard_normal((1, 8, 8, 64)).astype(np.float16)
    body, headers = binary_request(q, kv, kv)
    held = [_post_unread(server.http_port, body, headers) for _ in range(2)]
    try:
        time.sleep(2.5)  # parsed and computed: their answers wait (dropped at TIMEOUT_S)
        refused = requests.post(f"{server.http}/v2/models/attention/infer", data=body, headers=headers, timeout=30)
        assert refused.status_code == 503, refused.text[:300]
        assert "--http_max_receive_bytes" in refused.text
        big_q = rng.standard_normal((1, 4096, 8, 128)).astype(np.float16)  # 4 Mi elements: 192 MiB as JSON
        big_kv = rng.standard_normal((1, 8, 8, 128)).astype(np.float16)
        big_body, big_headers = binary_request(big_q, big_kv, big_kv)
        too_big = requests.post(f"{server.http}/v2/models/attention/infer", data=big_body, headers=big_headers,
                                timeout=30)
        assert too_big.status_code == 413 and "binary_data_output" in too_big.text, too_big.text[:300]
        time.sleep(TIMEOUT_S + 1.5)  # the unread answers' connections are closed, their bytes given back
        for sock in held:
            sock.settimeout(5)
            received = b""
            while True:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    break
                received += chunk
            assert len(received) < 12 << 20, "a whole answer reached a client that read nothing for the timeout"
        answered = requests.post(f"{server.http}/v2/models/attention/infer", data=body, headers=headers, timeout=30)
        assert answered.status_code == 200, answered.text[:300]
    finally:
        for sock in held:
            sock.close()


def test_an_unread_download_gives_its_session_back_after_the_timeout(start_server, rng):
    """A striped Download the client never reads held its session -- a slot of --stream_max_sessions and its bytes --
    forever: its writes were watched by nothing, and the reaper drops a session from the table, not from its room
    (two such calls refused every OpenSession of every client, audit of session 47). Each write now has
    --answer_timeout_s to leave."""
    server = start_server("--stream_max_sessions=2", "--stream_session_timeout_ms=1000",
                          f"--answer_timeout_s={TIMEOUT_S}", name="unread_download")
    q = rng.standard_normal((1, 1024, 8, 64)).astype(np.float32)
    header = pb.AttentionRequest(q=pb.Tensor(dtype=pb.FLOAT32, shape=q.shape), k=pb.Tensor(dtype=pb.FLOAT32,
                                 shape=q.shape), v=pb.Tensor(dtype=pb.FLOAT32, shape=q.shape))
    client = WindowlessClient(server.grpc_port)
    try:
        with flashserve.StripedClient(server.address, timeout=30) as striped:
            stub = striped.stubs[0]
            streams = []
            for _ in range(2):
                session = stub.OpenSession(header, timeout=30).session_id
                stub.Upload(iter([pb.AttentionChunk(session_id=session, tensor=t, offset=0, data=q.tobytes())
                                  for t in (1, 2, 3)]), timeout=30)
                stub.Compute(pb.ComputeRequest(session_id=session), timeout=30)
                streams.append(client.call("/flashserve.v1.AttentionStreamService/Download",
                                           pb.DownloadRequest(session_id=session, tensor=pb.TENSOR_OUT)
                                           .SerializeToString()))
            client.pump(1.0)
            assert not any(s in client.ended for s in streams), client.ended  # held unsent
            with pytest.raises(grpc.RpcError) as full:
                stub.OpenSession(header, timeout=30)
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            client.pump(TIMEOUT_S + 2.5)
            assert all(client.ended.get(s) in ("CANCELLED", "reset") for s in streams), client.ended
            assert stub.OpenSession(header, timeout=30).session_id  # the slots came back
    finally:
        client.close()
