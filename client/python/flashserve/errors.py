"""Typed exceptions for gRPC failures. Each carries the gRPC status code and the server's message.

    try:
        client.attention(q, k, v)
    except flashserve.InvalidArgumentError as e:   # also a ValueError
        print(e.code, e.message)                   # StatusCode.INVALID_ARGUMENT, "q.shape: ..."
"""

from __future__ import annotations

from typing import Optional

import grpc


class FlashserveError(Exception):
    """A failed call. ``code`` is a grpc.StatusCode, ``message`` the server's (or client's) explanation."""

    def __init__(self, code: grpc.StatusCode, message: str, request_id: Optional[str] = None):
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        name = self.code.name if isinstance(self.code, grpc.StatusCode) else str(self.code)
        suffix = f" (request_id={self.request_id})" if self.request_id else ""
        return f"{name}: {self.message}{suffix}"


class InvalidArgumentError(FlashserveError, ValueError):
    """INVALID_ARGUMENT: the request is malformed (raised client-side too, for inputs the client can check)."""


class ResourceExhaustedError(FlashserveError):
    """RESOURCE_EXHAUSTED: over a size limit, or the server's queue is full (retry later)."""


class UnavailableError(FlashserveError, ConnectionError):
    """UNAVAILABLE: the server cannot be reached or is shutting down."""


class NotFoundError(FlashserveError, LookupError):
    """NOT_FOUND: a sequence id the server does not hold (released, evicted after its TTL, or the server restarted).

    ``missing_ids``: every missing id of the call when the server named them (DecodeStep's trailing metadata
    ``flashserve-missing-sequence-ids``), else empty.
    """

    def __init__(self, code: grpc.StatusCode, message: str, request_id: Optional[str] = None, missing_ids=()):
        super().__init__(code, message, request_id)
        self.missing_ids = tuple(missing_ids)


class DeadlineExceededError(FlashserveError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's timeout passed before the answer came."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
}
MISSING_IDS_KEY = "flashserve-missing-sequence-ids"


def error_for(code: grpc.StatusCode, message: str, request_id: Optional[str] = None) -> FlashserveError:
    """The exception for a status code: a subclass where one exists, else FlashserveError."""
    return _BY_CODE.get(code, FlashserveError)(code, message, request_id)


def from_rpc_error(error: grpc.RpcError, request_id: Optional[str] = None) -> FlashserveError:
    """Converts a grpc.RpcError (sync) or grpc.aio.AioRpcError into the typed exception."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    result = error_for(code, details or "", request_id)
    if isinstance(result, NotFoundError):
        result.missing_ids = _missing_ids(error)
    return result


def _missing_ids(error) -> tuple:
    """The ids in trailing metadata ``flashserve-missing-sequence-ids`` (comma-separated), if any."""
    trailing = error.trailing_metadata() if callable(getattr(error, "trailing_metadata", None)) else None
    for key, value in trailing or ():
        if key == MISSING_IDS_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            return tuple(i for i in text.split(",") if i)
    return ()
