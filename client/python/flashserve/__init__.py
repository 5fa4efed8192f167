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
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from ._pb import attention_pb2, attention_pb2_grpc, sequences_pb2, sequences_pb2_grpc
from .hashring import HashRing
from .local import LocalClient
from .striped import StripedClient

if sequences_pb2 is not None:  # a checkout without proto/flashserve/v1/sequences.proto has no Sequences API
    from .sequence_client import ROUTE_HEADER, SequenceClient
    from .sequences import Sequence, SequenceSpec

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AttentionResult",
    "Client",
    "DeadlineExceededError",
    "DeviceInfo",
    "FlashserveError",
    "HashRing",
    "InvalidArgumentError",
    "LocalClient",
    "Limits",
    "NotFoundError",
    "ResourceExhaustedError",
    "ServerInfo",
    "StripedClient",
    "Timing",
    "UnavailableError",
    "attention_pb2",
    "attention_pb2_grpc",
    "sequences_pb2",
    "sequences_pb2_grpc",
    "reference",
]
if sequences_pb2 is not None:
    __all__ += ["ROUTE_HEADER", "Sequence", "SequenceClient", "SequenceSpec"]
