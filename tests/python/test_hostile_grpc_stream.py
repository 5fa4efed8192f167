"""The raw HTTP/2 client of test_hostile_mixed.py against a scripted server: how it reads a GOAWAY (also one left
unread behind a send that a reset failed).

A GOAWAY refuses only the streams above its last_stream_id; gRPC's graceful GOAWAY (last_stream_id 2^31 - 1) is
followed by the answers of the calls in flight, often in the same read. The `h2` package closes its connection at
any GOAWAY and raises ProtocolError at the next frame, which once killed a client thread of the hostile test and lost
its call's status (a CI run on 2026-12-02).
"""

from __future__ import annotations

import socket
import struct
import threading

import hpack
import hyperframe.frame as frames

from hostile_grpc_stream import stream_claimed_message

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
NO_ERROR, ENHANCE_YOUR_CALM = 0x0, 0xB


def goaway(last_stream_id: int, code: int) -> bytes:
    return frames.GoAwayFrame(0, last_stream_id=last_stream_id, error_code=code).serialize()


def trailers_only(stream_id: int, grpc_status: int, message: str) -> bytes:
    block = hpack.Encoder().encode([(":status", "200"), ("content-type", "application/grpc"),
                                    ("grpc-status", str(grpc_status)), ("grpc-message", message)])
    return frames.HeadersFrame(stream_id, data=block, flags=["END_HEADERS", "END_STREAM"]).serialize()


def scripted_server(reply: bytes, close_after: bool):
    """A listener that answers the first connection with SETTINGS then `reply` in one write, after the client's
    first frames arrive, and reads (and drops) what the client sends until the client closes. With `close_after`
    it ends its side of the connection (FIN, no RST: the client reads the reply first) once the client has sent its
    first flow-control window and must read."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            received = 0
            while received < len(PREFACE) + 9:  # the preface and at least one frame header
                received += len(conn.recv(1 << 16))
            conn.sendall(frames.SettingsFrame(0).serialize() + reply)
            open_ = True
            while chunk := conn.recv(1 << 16):
                received += len(chunk)
                if close_after and open_ and received > 65535:  # the default window: the client now waits
                    conn.shutdown(socket.SHUT_WR)
                    open_ = False

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", listener, thread


def run_against(reply: bytes, close_after: bool = False):
    address, listener, thread = scripted_server(reply, close_after)
    try:
        return stream_claimed_message(address, "/x.Y/Z", 1 << 30, deadline_s=10)
    finally:
        thread.join(10)
        listener.close()


def test_an_answer_after_a_graceful_goaway_in_the_same_read_is_the_status():
    result = run_against(goaway((1 << 31) - 1, NO_ERROR) + trailers_only(1, 8, "over the quota"))
    assert (result.how, result.status, result.message) == ("answer", "RESOURCE_EXHAUSTED", "over the quota"), result


def test_a_goaway_below_the_stream_refuses_it():
    result = run_against(goaway(0, NO_ERROR) + trailers_only(1, 8, "never read"))
    assert (result.how, result.status) == ("goaway", "UNAVAILABLE"), result


def test_a_close_after_a_goaway_takes_the_goaway_code():
    result = run_against(goaway((1 << 31) - 1, ENHANCE_YOUR_CALM), close_after=True)
    assert (result.how, result.status) == ("closed", "RESOURCE_EXHAUSTED"), result


def resetting_server(reply: bytes, after_bytes: int):
    """A listener that opens the flow-control windows wide, reads `after_bytes` of the client's stream, then sends
    `reply` and resets the connection (SO_LINGER 0: RST, no FIN) while the client is still sending."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        conn.settimeout(10)
        wide = (1 << 31) - 1
        received = 0
        while received < len(PREFACE) + 9:
            received += len(conn.recv(1 << 16))
        conn.sendall(frames.SettingsFrame(0, settings={frames.SettingsFrame.INITIAL_WINDOW_SIZE: wide}).serialize()
                     + frames.WindowUpdateFrame(0, window_increment=wide - 65535).serialize())
        while received < after_bytes:
            received += len(conn.recv(1 << 16))
        conn.sendall(reply)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", listener, thread


def test_a_goaway_before_a_reset_that_fails_a_send_takes_the_goaway_code():
    """gRPC over its memory quota sends GOAWAY ENHANCE_YOUR_CALM and drops the connection while the attacker is in
    a send: the send fails, and the GOAWAY waits unread in the receive buffer (a CI run on 2026-12-03 reported
    UNAVAILABLE). Ten tries: whether the send or the read sees the reset first varies."""
    for _ in range(10):
        address, listener, thread = resetting_server(goaway(1, ENHANCE_YOUR_CALM), after_bytes=4 << 20)
        try:
            result = stream_claimed_message(address, "/x.Y/Z", 1 << 30, deadline_s=10)
        finally:
            thread.join(10)
            listener.close()
        assert (result.how, result.status) == ("closed", "RESOURCE_EXHAUSTED"), result
