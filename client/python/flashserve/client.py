"""Synchronous and asyncio clients for flashserve.v1.AttentionService.

    with flashserve.Client("127.0.0.1:8001") as client:
        out = client.attention(q, k, v, causal=True)                 # same kind as q: numpy or torch
        out, lse = client.attention(q, k, v, return_lse=True)
        result = client.attention_with_metadata(q, k, v)             # + timing, kernel, request_id

    async with flashserve.AsyncClient("127.0.0.1:8001") as client:
        out = await client.attention(q, k, v)

Thread safety: a Client may be shared by threads (grpc channels and stubs are thread-safe); an AsyncClient belongs
to the event loop it was first used on.
"""

from __future__ import annotations

import dataclasses
import uuid
import warnings
from typing import Any, List, Optional, Sequence, Tuple

import grpc
import grpc.aio

from . import tensors
from ._pb import attention_pb2 as pb
from ._pb import attention_pb2_grpc as pb_grpc
from ._wire import varint
from .errors import FlashserveError, error_for, from_rpc_error
from .shm import TorchCudaIpc

# gRPC's limit is a signed 32-bit length; tensors of a few hundred MB are normal here.
MAX_MESSAGE_BYTES = 2**31 - 1
DEFAULT_ADDRESS = "127.0.0.1:8001"

_HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
HEALTH_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


@dataclasses.dataclass(frozen=True)
class Timing:
    """Server-side time per phase, microseconds (h2d/d2h are 0 on the CPU backend).

    stage_us is the server's host copy of the inputs into the buffers the backend reads (pinned
    memory on a GPU); it is part of total_us and not of h2d_us.
    """

    queue_us: int = 0
    h2d_us: int = 0
    compute_us: int = 0
    d2h_us: int = 0
    total_us: int = 0
    stage_us: int = 0

    @classmethod
    def from_proto(cls, t: Any) -> "Timing":
        """From a flashserve.v1.Timing message."""
        return cls(t.queue_us, t.h2d_us, t.compute_us, t.d2h_us, t.total_us, t.stage_us)


@dataclasses.dataclass(frozen=True)
class AttentionResult:
    out: Any
    lse: Any  # None unless return_lse
    timing: Timing
    kernel: str
    request_id: str


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    name: str
    compute_capability: Tuple[int, int]
    total_memory_bytes: int
    index: int


@dataclasses.dataclass(frozen=True)
class Limits:
    max_request_bytes: int
    max_tensor_elements: int
    queue_capacity: int


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    version: str
    backend: str
    devices: List[DeviceInfo]
    dtypes: List[str]  # "float16" / "bfloat16" / "float32"; unknown enum values appear as "dtype_<n>"
    head_dims: List[int]  # explicit list (CUDA backend); may be empty on the CPU backend
    max_head_dim: int  # CPU backend: any head_dim in [1, max_head_dim]
    limits: Limits
    worker_threads: int
    build: str

    def supports_head_dim(self, head_dim: int) -> bool:
        if self.head_dims:
            return head_dim in self.head_dims
        return 1 <= head_dim <= self.max_head_dim if self.max_head_dim else True


def _server_info_from_proto(m: "pb.ServerInfo") -> ServerInfo:
    return ServerInfo(
        version=m.version,
        backend=m.backend,
        devices=[
            DeviceInfo(d.name, (d.compute_capability_major, d.compute_capability_minor), d.total_memory_bytes, d.index)
            for d in m.devices
        ],
        dtypes=[tensors.NAME_OF_PROTO_DTYPE.get(d, f"dtype_{int(d)}") for d in m.dtypes],
        head_dims=list(m.head_dims),
        max_head_dim=m.max_head_dim,
        limits=Limits(m.limits.max_request_bytes, m.limits.max_tensor_elements, m.limits.queue_capacity),
        worker_threads=m.worker_threads,
        build=m.build,
    )


def _channel_options(extra: Optional[Sequence[Tuple[str, Any]]]) -> List[Tuple[str, Any]]:
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    if extra:
        overridden = {name for name, _ in extra}
        options = [o for o in options if o[0] not in overridden] + list(extra)
    return options


# --- grpc.health.v1 by hand: HealthCheckRequest{string service = 1}, HealthCheckResponse{ServingStatus status = 1}.
# Two one-field messages do not justify another generated-code dependency.


def _encode_health_request(service: str) -> bytes:
    raw = service.encode()
    return b"\x0a" + varint(len(raw)) + raw if raw else b""


def _decode_varint(data: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _decode_health_response(data: bytes) -> int:
    """Returns the ServingStatus number (0 when the field is absent, as proto3 says)."""
    status, pos = 0, 0
    while pos < len(data):
        key, pos = _decode_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _decode_varint(data, pos)
            if field == 1:
                status = value
        elif wire_type == 1:
            pos += 8
        elif wire_type == 2:
            length, pos = _decode_varint(data, pos)
            pos += length
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire_type} in HealthCheckResponse")
    return status


def _health_status_name(data: bytes) -> str:
    status = _decode_health_response(data)
    return HEALTH_STATUS_NAMES.get(status, f"STATUS_{status}")


def _identity(x: bytes) -> bytes:
    return x


class _Prepared:
    """A request plus what is needed to decode its answer into the caller's kind of tensor."""

    __slots__ = ("request", "kind", "device", "return_lse")

    def __init__(self, q, k, v, causal, softmax_scale, return_lse, request_id, with_data=True):
        self.kind, name = tensors.check_inputs(q, k, v)
        self.device = q.device if self.kind == "torch" else None
        self.return_lse = bool(return_lse)

        def encode(x, field):  # without data: the tensor is named in a shared-memory region instead
            if with_data:
                return tensors.to_proto(x, field)
            return pb.Tensor(dtype=tensors.PROTO_DTYPE[name], shape=[int(d) for d in x.shape])

        request = pb.AttentionRequest(
            q=encode(q, "q"),
            k=encode(k, "k"),
            v=encode(v, "v"),
            causal=bool(causal),
            return_lse=self.return_lse,
            request_id=request_id if request_id is not None else uuid.uuid4().hex,
        )
        if softmax_scale is not None:
            request.softmax_scale = float(softmax_scale)
        self.request = request

    def result(self, response: "pb.AttentionResponse") -> AttentionResult:
        out = tensors.from_proto(response.out, self.kind, self.device)
        lse = None
        if self.return_lse:
            if not response.HasField("lse"):
                raise error_for(grpc.StatusCode.INTERNAL, "return_lse was set but the response has no lse",
                                response.request_id)
            lse = tensors.from_proto(response.lse, self.kind, self.device)
        return AttentionResult(
            out=out,
            lse=lse,
            timing=Timing.from_proto(response.timing),
            kernel=response.kernel,
            request_id=response.request_id,
        )


class Client:
    """Blocking client. ``timeout`` (seconds) is the default deadline for each call; None means no deadline."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: Optional[float] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, Any]]] = None,
        token: Optional[str] = None,
        cuda_ipc: bool = True,
    ):
        self.address = address
        self.timeout = timeout
        # torch CUDA tensors to a server on this host go by CUDA IPC (flashserve.shm.TorchCudaIpc) unless turned
        # off here; a server that refuses it (no --allow_client_shm) turns it off for this client.
        local = address.split(":")[0] in ("127.0.0.1", "localhost", "[", "") or address.startswith(("unix:", "[::1]"))
        self._cuda_ipc = TorchCudaIpc(self) if cuda_ipc and local else None
        self._cuda_ipc_off = False  # set when a call found the memory or the server unwilling
        # Bearer token for a server started with --auth_token_file, sent as call metadata (also on
        # plaintext channels, where grpc's call credentials refuse to go: use TLS in production).
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        opts = _channel_options(options)
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=opts)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=opts)
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._health_check = self._channel.unary_unary(
            _HEALTH_CHECK_METHOD, request_serializer=_identity, response_deserializer=_identity
        )

    @property
    def channel(self) -> grpc.Channel:
        return self._channel

    @property
    def stub(self) -> "pb_grpc.AttentionServiceStub":
        """The raw generated stub, for sending hand-made requests."""
        return self._stub

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def attention_with_metadata(
        self, q, k, v, causal: bool = False, softmax_scale: Optional[float] = None, return_lse: bool = False,
        timeout: Optional[float] = None, request_id: Optional[str] = None, region=None,
    ) -> AttentionResult:
        """Like attention(), but returns an AttentionResult with out, lse, timing, kernel and request_id."""
        if region is None and self._cuda_ipc is not None and not self._cuda_ipc_off and tensors.is_torch(q) \
                and q.is_cuda:
            result = self._attention_cuda_ipc(q, k, v, causal, softmax_scale, return_lse, timeout, request_id)
            if result is not None:
                return result
        prepared = _Prepared(q, k, v, causal, softmax_scale, return_lse, request_id)
        outputs = region.place(prepared.request, prepared.return_lse) if region is not None else []
        try:
            response = self._stub.Attention(prepared.request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, prepared.request.request_id) from None
        for field, offset, nbytes in outputs:  # the answer comes once they are complete in the region
            getattr(response, field).data = region.read(offset, nbytes)
        return prepared.result(response)

    def _attention_cuda_ipc(self, q, k, v, causal, softmax_scale, return_lse, timeout, request_id):
        """The call with q, k, v, O and LSE on the GPU, named by CUDA IPC; None (the caller sends the bytes instead)
        when the server refuses shared memory or the memory cannot be shared."""
        prepared = _Prepared(q, k, v, causal, softmax_scale, return_lse, request_id, with_data=False)
        try:
            _inputs, out, lse = self._cuda_ipc.place(prepared.request, q, k, v, prepared.return_lse)
        except (RuntimeError, OSError, FlashserveError) as e:
            warnings.warn(f"flashserve: CUDA IPC off for this client, tensors go by value ({e})", stacklevel=3)
            self._cuda_ipc_off = True  # kept: close() still unregisters the regions it registered
            return None
        try:
            response = self._stub.Attention(prepared.request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, prepared.request.request_id) from None
        return AttentionResult(out=out, lse=lse, timing=Timing.from_proto(response.timing), kernel=response.kernel,
                               request_id=response.request_id)

    def attention(
        self, q, k, v, causal: bool = False, softmax_scale: Optional[float] = None, return_lse: bool = False,
        timeout: Optional[float] = None, request_id: Optional[str] = None, region=None,
    ):
        """Exact attention of q [batch, seqlen_q, heads_q, head_dim] over k, v [batch, seqlen_k, heads_kv, head_dim].

        Returns out (like q) or (out, lse) when return_lse; lse is float32 [batch, heads_q, seqlen_q]. Numpy in,
        numpy out; torch in, torch out on q's device. Raises FlashserveError subclasses on failure.
        ``region`` (flashserve.shm.SystemRegion, server on this host with --allow_client_shm): the tensors go through
        that shared-memory region instead of the socket.
        """
        result = self.attention_with_metadata(q, k, v, causal, softmax_scale, return_lse, timeout, request_id,
                                              region)
        return (result.out, result.lse) if return_lse else result.out

    def server_info(self, timeout: Optional[float] = None) -> ServerInfo:
        try:
            return _server_info_from_proto(self._stub.GetServerInfo(pb.GetServerInfoRequest(),
                                                                    timeout=self._timeout(timeout),
                                                                    metadata=self._metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def health_status(self, service: str = "", timeout: Optional[float] = None) -> str:
        """grpc.health.v1 status name: 'SERVING', 'NOT_SERVING', 'UNKNOWN' or 'SERVICE_UNKNOWN'."""
        try:
            return _health_status_name(self._health_check(_encode_health_request(service),
                                                          timeout=self._timeout(timeout)))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def health(self, service: str = "", timeout: Optional[float] = None) -> bool:
        """True when the server reports SERVING. Connection failures raise UnavailableError."""
        return self.health_status(service, timeout) == "SERVING"

    def wait_until_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the channel connects and health reports SERVING; raises DeadlineExceededError otherwise."""
        import time

        deadline = time.monotonic() + timeout
        last: Optional[Exception] = None
        while time.monotonic() < deadline:
            try:
                if self.health(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                    return
            except FlashserveError as e:
                last = e
            time.sleep(0.05)
        raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"{self.address} not SERVING after {timeout} s" + (f": {last}" if last else ""))

    def close(self) -> None:
        if self._cuda_ipc is not None:
            self._cuda_ipc.close()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client (grpc.aio); same methods as Client, as coroutines."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: Optional[float] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, Any]]] = None,
        token: Optional[str] = None,
    ):
        self.address = address
        self.timeout = timeout
        # Bearer token for a server started with --auth_token_file, sent as call metadata (also on
        # plaintext channels, where grpc's call credentials refuse to go: use TLS in production).
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        opts = _channel_options(options)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=opts)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=opts)
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._health_check = self._channel.unary_unary(
            _HEALTH_CHECK_METHOD, request_serializer=_identity, response_deserializer=_identity
        )

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel

    @property
    def stub(self) -> "pb_grpc.AttentionServiceStub":
        return self._stub

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    async def attention_with_metadata(
        self, q, k, v, causal: bool = False, softmax_scale: Optional[float] = None, return_lse: bool = False,
        timeout: Optional[float] = None, request_id: Optional[str] = None,
    ) -> AttentionResult:
        prepared = _Prepared(q, k, v, causal, softmax_scale, return_lse, request_id)
        try:
            response = await self._stub.Attention(prepared.request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, prepared.request.request_id) from None
        return prepared.result(response)

    async def attention(
        self, q, k, v, causal: bool = False, softmax_scale: Optional[float] = None, return_lse: bool = False,
        timeout: Optional[float] = None, request_id: Optional[str] = None,
    ):
        """See Client.attention."""
        result = await self.attention_with_metadata(q, k, v, causal, softmax_scale, return_lse, timeout, request_id)
        return (result.out, result.lse) if return_lse else result.out

    async def server_info(self, timeout: Optional[float] = None) -> ServerInfo:
        try:
            return _server_info_from_proto(await self._stub.GetServerInfo(pb.GetServerInfoRequest(),
                                                                          timeout=self._timeout(timeout),
                                                                          metadata=self._metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def health_status(self, service: str = "", timeout: Optional[float] = None) -> str:
        try:
            return _health_status_name(await self._health_check(_encode_health_request(service),
                                                                timeout=self._timeout(timeout)))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def health(self, service: str = "", timeout: Optional[float] = None) -> bool:
        return (await self.health_status(service, timeout)) == "SERVING"

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
