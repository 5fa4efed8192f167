"""A hostile gRPC client on raw HTTP/2 (the `h2` package): one call whose message claims `claim` bytes in its 5-byte
gRPC prefix and whose body is streamed as fast as the server's flow control allows, generated lazily (a zero block
sent again and again), so 64 clients claiming 1 GiB each cost the test almost no memory. It stops when the server
ends or resets the stream (or the connection), when the whole claim is sent, or at `deadline_s`. As an attacker would,
it does not wait for an answer while it may send: it reads the server's frames only when flow control blocks it.

Used by tests/python/test_hostile_mixed.py. The status is taken from the server's answer: `grpc-status` of a
trailers-only response or of the trailers, else the RST_STREAM code mapped as gRPC's HTTP/2 spec says
(doc/PROTOCOL-HTTP2.md: ENHANCE_YOUR_CALM -> RESOURCE_EXHAUSTED, CANCEL -> CANCELLED, REFUSED_STREAM -> UNAVAILABLE).
"""

from __future__ import annotations

import select
import socket
import struct
import time
from dataclasses import dataclass

from grpc_filler import filler_head

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions

BLOCK = bytes(1 << 20)


def message_head(claim: int) -> bytes:
    """The gRPC prefix claiming `claim` bytes and the start of a valid protobuf message of that size: one unknown
    bytes field whose contents (zeros) fill the rest, so a message that arrives whole parses."""
    return struct.pack(">BI", 0, claim) + filler_head(claim)[0]


RST_TO_GRPC = {0x8: "CANCELLED", 0x7: "UNAVAILABLE", 0xB: "RESOURCE_EXHAUSTED", 0xC: "PERMISSION_DENIED"}
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class _GoawayTolerantConnection(h2.connection.H2Connection):
    """h2 closes its side of the connection at a GOAWAY and raises ProtocolError at every later frame. But a GOAWAY
    only refuses streams above its last_stream_id; the server still answers those at or below it (RFC 9113 6.8), and
    gRPC does: its graceful GOAWAY carries 2^31 - 1, and the answer can follow it in the same read (a CI run lost a
    call's status, and its thread, that way). This connection reports the GOAWAY and stays open for the answer."""

    def _receive_goaway_frame(self, frame):
        event = h2.events.ConnectionTerminated()
        event.error_code = h2.errors._error_code_from_int(frame.error_code)
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]


@dataclass
class StreamResult:
    status: str = ""  # gRPC status name, "" if the server never answered
    sent: int = 0  # message bytes (prefix included) handed to the kernel: an upper bound on what the server read
    seconds: float = 0.0  # from the call's headers to the server's answer
    how: str = ""  # what ended it: "answer", "reset", "goaway", "closed", "deadline"
    message: str = ""  # grpc-message of the answer


class _Call:
    def __init__(self, address: str, path: str, metadata, deadline_s: float):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = _GoawayTolerantConnection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.goaway_code: int | None = None  # the error code of a GOAWAY that let this stream finish
        self.conn.initiate_connection()
        self.stream = self.conn.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", address),
                   ("content-type", "application/grpc"), ("te", "trailers"), *metadata]
        self.conn.send_headers(self.stream, headers)
        self.flush()
        self.result = StreamResult()
        self.start = time.monotonic()
        self.deadline = self.start + deadline_s

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def _finish(self, how: str, status: str = "") -> None:
        if not self.result.how:
            self.result.how, self.result.seconds = how, time.monotonic() - self.start
            if status and not self.result.status:
                self.result.status = status

    def _on(self, event) -> None:
        if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            headers = dict(event.headers)
            status = headers.get("grpc-status")
            if status is not None:
                self.result.message = headers.get("grpc-message", "")
                self._finish("answer", CODE_NAMES.get(int(status), f"code {status}"))
        elif isinstance(event, h2.events.StreamEnded):
            self._finish("answer")
        elif isinstance(event, h2.events.StreamReset):
            self._finish("reset", RST_TO_GRPC.get(event.error_code, "INTERNAL"))
        elif isinstance(event, h2.events.ConnectionTerminated):
            if event.last_stream_id is not None and event.last_stream_id >= self.stream:
                self.goaway_code = int(event.error_code)  # this stream may still be answered
            else:
                self._finish("goaway", "UNAVAILABLE")
        elif isinstance(event, h2.events.DataReceived):
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)

    def pump(self, wait_s: float, reply: bool = True) -> None:
        """Reads and handles what the server sent, waiting at most `wait_s` for it; with `reply`, sends what h2
        answers (acknowledgements, window updates)."""
        readable, _, _ = select.select([self.sock], [], [], wait_s)
        if not readable:
            return
        try:
            data = self.sock.recv(1 << 16)
        except (ConnectionResetError, OSError):
            data = b""
        if not data:
            self._closed()
            return
        try:
            events = self.conn.receive_data(data)
        except KeyError:
            # h2 raises KeyError for a frame (a WINDOW_UPDATE) of a stream it has already closed and
            # forgotten: that stream's answer came in an earlier read. (It killed a test's client
            # thread under a slow, sanitized server.)
            return
        except h2.exceptions.ProtocolError as e:  # the server broke HTTP/2 (h2 has sent its GOAWAY)
            if not self.result.how:
                self.result.message = f"HTTP/2 protocol error from the server: {e}"
            self._finish("closed", "UNAVAILABLE")
            return
        for event in events:
            self._on(event)
        if not reply:
            return
        try:
            self.flush()
        except OSError:
            self.closed_while_sending()

    def closed_while_sending(self) -> None:
        """A send failed: the server closed or reset the connection. What it sent before (a GOAWAY and its code, an
        answer) can still wait in our receive buffer -- the kernel keeps it past the reset -- so read it to the end
        before concluding (a CI run took a GOAWAY ENHANCE_YOUR_CALM, unread behind a failed send, for UNAVAILABLE)."""
        deadline = time.monotonic() + 2.0
        while not self.result.how and time.monotonic() < deadline:
            self.pump(0.1, reply=False)
        self._closed()

    def _closed(self) -> None:
        """The connection ended without an answer: after a GOAWAY, the status its code maps to (as for a reset)."""
        status = "UNAVAILABLE" if self.goaway_code is None else RST_TO_GRPC.get(self.goaway_code, "UNAVAILABLE")
        self._finish("closed", status)

    def send_some(self, message: memoryview, remaining: int) -> int:
        """Sends what flow control allows now (at most `remaining`); returns the bytes sent."""
        window = min(self.conn.local_flow_control_window(self.stream), self.conn.max_outbound_frame_size,
                     len(message), remaining)
        if window <= 0:
            return 0
        end = remaining == window
        self.conn.send_data(self.stream, message[:window], end_stream=end)
        self.sock.sendall(self.conn.data_to_send())
        return window


def stream_claimed_message(address: str, path: str, claim: int, metadata=(), deadline_s: float = 30.0,
                           body_limit: int | None = None) -> StreamResult:
    """Claims `claim` message bytes and streams them (or `body_limit` of them) until the server answers."""
    call = _Call(address, path, metadata, deadline_s)
    total = 5 + (claim if body_limit is None else min(claim, body_limit))
    head = message_head(claim)
    try:
        while not call.result.how and call.result.sent < total:
            if time.monotonic() > call.deadline:
                call._finish("deadline")
                break
            first = call.result.sent == 0
            message = memoryview(head + BLOCK[: (1 << 20) - len(head)]) if first else memoryview(BLOCK)
            try:
                sent = call.send_some(message, total - call.result.sent)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                call.pump(0.5)
                break
            except OSError:  # reset, broken pipe, or a send blocked for 10 s
                call.closed_while_sending()
                break
            call.result.sent += sent
            if sent == 0:
                call.pump(0.2)  # blocked by flow control: wait for WINDOW_UPDATE or the answer
        while not call.result.how and time.monotonic() < call.deadline:
            call.pump(0.2)  # everything sent (or the stream closed on our side): wait for the answer
        if not call.result.how:
            call._finish("deadline")
    finally:
        call.sock.close()
    return call.result
