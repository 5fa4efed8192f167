"""flashserve: Python client for the flashserve attention service, an fp64 reference, and an answer checker."""

from . import reference
from .client import (
    AsyncClient,
    AttentionResult,
    Client,
    DeviceInfo,
    Limits,
    ServerInfo,
    Timing,
)
from .errors import (
    DeadlineExceededError,
    FlashserveError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from ._pb import attention_pb2, attention_pb2_grpc
from .striped import StripedClient

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AttentionResult",
    "Client",
    "DeadlineExceededError",
    "DeviceInfo",
    "FlashserveError",
    "InvalidArgumentError",
    "Limits",
    "ResourceExhaustedError",
    "ServerInfo",
    "StripedClient",
    "Timing",
    "UnavailableError",
    "attention_pb2",
    "attention_pb2_grpc",
    "reference",
]
