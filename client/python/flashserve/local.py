"""The local transport: a flashserve server on this host with ``--local_socket=PATH`` answers Attention, DecodeStep
and Attend over a Unix socket, the same protobuf messages in length-prefixed frames (no HTTP/2: the round trip of a
small call is a fraction of gRPC's). Tensors best live in shared memory (``flashserve.shm.SystemRegion``, registered
over gRPC); inline tensors are allowed up to the server's ``--local_max_frame_bytes``.

    with flashserve.LocalClient("/run/flashserve.sock") as c:
        out = c.attention(q, k, v, causal=True)

Frame (proto/flashserve/v1/local_frame.h): 16 bytes -- magic "FSL1", method (request) or status code (response),
flags 0, payload bytes, reserved 0 (little-endian) -- then the payload. One call at a time per connection; a client
object is not thread-safe (use one per thread).
"""

from __future__ import annotations

import select
import socket
import struct
import time
import uuid
import weakref
from typing import Optional

import grpc
from google.protobuf.message import DecodeError

from ._pb import attention_pb2 as pb
from .client import AttentionResult, Timing, _Prepared
from .errors import NotFoundError, error_for

MAGIC = 0x314C5346  # "FSL1"
HEADER = struct.Struct("<IHHII")
HELLO, ECHO, ATTENTION, DECODE_STEP, ATTEND = 1, 2, 3, 4, 5
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_MISSING = "; missing sequence ids: "


MAX_POLL_US = 1_000_000
_REFUSAL_WAIT_S = 0.5  # how long a hung-up connection is read for the server's last answer
_MAX_REFUSAL_BYTES = 1 << 20


class LocalClient:
    """One connection to the server's local socket at ``path``; ``token``: the server's bearer token (sent once, as
    a Hello). ``timeout`` (seconds) bounds each call's socket operations; None: no limit. ``poll_us``: after sending,
    poll the socket this long (microseconds, without sleeping; at most 1 s) for the reply before blocking in recv:
    the thread is awake when a short call's answer lands (the C++ load generator's same option took 20-35 us off a
    64-sequence decode step on an H200, bench/results/service-h200-2026-11-28-decode-poll.md), at the cost of a busy
    core while it waits. 0: block at once."""

    def __init__(self, path: str, token: Optional[str] = None, timeout: Optional[float] = None, poll_us: int = 0):
        if not 0 <= poll_us <= MAX_POLL_US:
            raise ValueError(f"poll_us must be in 0..{MAX_POLL_US}, got {poll_us}")
        self.path = path
        self.poll_us = poll_us
        self.closed = False  # set by close(), also when a call had to give the connection up
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Closed when the client is collected (a thread's connection when the thread ends: SequenceClient): an open
        # one holds one of the server's --local_max_connections slots.
        self._closer = weakref.finalize(self, self._sock.close)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
            self._poller = select.poll()
            self._poller.register(self._sock.fileno(), select.POLLIN)
            if token is not None:
                self.call(HELLO, token.encode())
        except BaseException:  # no server, or the Hello refused: the socket was left open until collected
            self.close()
            raise

    def call(self, method: int, payload: bytes, request_id: Optional[str] = None) -> bytearray:
        """Sends one request frame and returns the response's payload; raises FlashserveError on an error status.
        The header and the payload go in two writes: joined, a 3 MiB step was copied once more. A call that ends
        without its whole answer read (a timeout, a hang-up, a bad frame, or anything raised while it waited: a
        signal, out of memory) closes the connection: the next call would otherwise read this one's answer."""
        payload = memoryview(payload).cast("B")
        try:
            status, body = self._exchange(method, payload, request_id)
        except socket.timeout:
            self.close()
            raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "local socket: no answer in time", request_id) from None
        except (BrokenPipeError, ConnectionResetError) as e:
            refusal = self._refusal_left(request_id)
            self.close()
            if refusal is not None:
                raise refusal from None
            raise error_for(grpc.StatusCode.UNAVAILABLE, f"local socket: the connection is gone ({e})",
                            request_id) from None
        except BaseException:
            self.close()
            raise
        if status != 0:
            message = body.decode("utf-8", "replace")
            error = error_for(_CODES.get(status, grpc.StatusCode.UNKNOWN), message, request_id)
            if isinstance(error, NotFoundError) and _MISSING in message:
                error.missing_ids = tuple(i for i in message.rsplit(_MISSING, 1)[1].split(",") if i)
            raise error
        return body

    def _exchange(self, method: int, payload: memoryview, request_id: Optional[str]):
        """One request frame out, one response frame in: (status, payload)."""
        self._sock.sendall(HEADER.pack(MAGIC, method, 0, len(payload), 0))
        self._sock.sendall(payload)
        if self.poll_us:
            self._poll_for_reply()
        magic, status, _, size, _ = HEADER.unpack(self._recv(HEADER.size))
        if magic != MAGIC:
            raise error_for(grpc.StatusCode.INTERNAL, f"local socket: bad response magic {magic:#x}", request_id)
        return status, self._recv(size)

    def _refusal_left(self, request_id: Optional[str]):
        """After the server hung up while the request was still going out: the error it answered before closing (a
        frame over its --local_max_frame_bytes is refused RESOURCE_EXHAUSTED from the header), or None."""
        try:
            self._sock.settimeout(_REFUSAL_WAIT_S)
            magic, status, _, size, _ = HEADER.unpack(self._recv(HEADER.size))
            if magic != MAGIC or status == 0 or size > _MAX_REFUSAL_BYTES:
                return None
            message = self._recv(size).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - nothing (readable) was left: the caller reports the hang-up
            return None
        return error_for(_CODES.get(status, grpc.StatusCode.UNKNOWN), message, request_id)

    def _poll_for_reply(self) -> None:
        """Returns when the reply's first bytes (or a hang-up) are there, or after poll_us; _recv then reads as usual."""
        deadline = time.perf_counter() + self.poll_us * 1e-6
        while not self._poller.poll(0) and time.perf_counter() < deadline:
            pass

    def _recv(self, n: int) -> bytearray:
        view = bytearray(n)
        got = 0
        while got < n:
            k = self._sock.recv_into(memoryview(view)[got:], n - got)
            if k == 0:
                raise error_for(grpc.StatusCode.UNAVAILABLE, "local socket: the server closed the connection")
            got += k
        return view  # not copied into bytes: protobuf parses a bytearray as well

    def set_timeout(self, timeout: Optional[float]) -> None:
        """Seconds each later call's socket operations may take (None: no limit)."""
        self._sock.settimeout(timeout)

    def echo(self, data: bytes) -> bytes:
        """The transport's floor: the server answers with the same bytes."""
        return bytes(self.call(ECHO, data))

    def attention_with_metadata(self, q, k, v, causal: bool = False, softmax_scale: Optional[float] = None,
                                return_lse: bool = False, request_id: Optional[str] = None,
                                region=None) -> AttentionResult:
        """Like flashserve.Client.attention_with_metadata (numpy or CPU torch tensors; ``region``: a
        flashserve.shm.SystemRegion the tensors go through instead of the socket)."""
        prepared = _Prepared(q, k, v, causal, softmax_scale, return_lse, request_id or uuid.uuid4().hex)
        outputs = region.place(prepared.request, prepared.return_lse) if region is not None else []
        request_id = prepared.request.request_id
        response = pb.AttentionResponse.FromString(
            self.call(ATTENTION, prepared.request.SerializeToString(), request_id))
        for field, offset, nbytes in outputs:  # complete in the region once answered
            getattr(response, field).data = region.read(offset, nbytes)
        return prepared.result(response)

    def attention(self, q, k, v, causal: bool = False, softmax_scale: Optional[float] = None,
                  return_lse: bool = False, request_id: Optional[str] = None, region=None):
        """out, or (out, lse) with return_lse; as flashserve.Client.attention."""
        result = self.attention_with_metadata(q, k, v, causal, softmax_scale, return_lse, request_id, region)
        return (result.out, result.lse) if return_lse else result.out

    def decode_step(self, request):
        """A sequences_pb2.DecodeStepRequest (or its wire bytes) -> DecodeStepResponse (the Sequences API; sequences
        are created and released over gRPC). NOT_FOUND raises NotFoundError with ``missing_ids``."""
        from ._pb import sequences_pb2 as spb

        data = request if isinstance(request, (bytes, bytearray)) else request.SerializeToString()
        return _parsed(spb.DecodeStepResponse.FromString, self.call(DECODE_STEP, data))

    def decode_step_answer(self, request):
        """decode_step, answered as a _step_answer.DecodeStepAnswer (a packed answer's O / LSE: views of the reply)."""
        from ._step_answer import DecodeStepAnswer

        data = request if isinstance(request, (bytes, bytearray)) else request.SerializeToString()
        return _parsed(DecodeStepAnswer.parse, self.call(DECODE_STEP, data))

    def attend(self, request):
        """A sequences_pb2.AttendRequest -> AttendResponse."""
        from ._pb import sequences_pb2 as spb

        return _parsed(spb.AttendResponse.FromString, self.call(ATTEND, request.SerializeToString()))

    def close(self) -> None:
        self.closed = True
        self._closer()

    def __enter__(self) -> "LocalClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parsed(parse, payload):
    """parse(payload); INTERNAL for an answer that does not parse: the server's fault, and the call ran (a step's
    rows are on the server: SequenceClient marks them doubtful, as after any INTERNAL)."""
    try:
        return parse(payload)
    except DecodeError as e:
        raise error_for(grpc.StatusCode.INTERNAL, f"local socket: the answer does not parse ({e})") from None


__all__ = ["LocalClient", "Timing"]
