"""Striped client: one request's bytes spread over several gRPC connections (flashserve.v1.AttentionStreamService).

One HTTP/2 connection carries about 2 GB/s (1.9-2.1 GB/s for unary Attention with the C++ load generator, H100
hosts; README "Large messages"); several in parallel scale. ``StripedClient`` opens ``stripes`` channels (one
connection each), and for each call:

  1. OpenSession with the shapes (no data);
  2. uploads Q, K, V as ``chunk_bytes`` pieces, round-robin over one client-streaming Upload per channel, in parallel;
  3. Compute;
  4. downloads O (and LSE) as ``stripes`` byte ranges, one server-streaming Download per channel, in parallel
     (outputs under ``inline_output_bytes``, or stripes == 1, come back inline in the Compute response instead).

    with flashserve.StripedClient("127.0.0.1:8001", stripes=4) as client:
        out = client.attention(q, k, v, causal=True)

Same inputs, outputs and errors as ``flashserve.Client`` (whose unary API stays the simple one). Thread safety: calls
may come from several threads; each call uses every channel.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import tensors
from ._pb import attention_pb2 as pb
from ._pb import attention_pb2_grpc as pb_grpc
from .client import AttentionResult, Timing, _channel_options
from .errors import from_rpc_error

DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 64 << 20  # a Download chunk at most (DownloadRequest.chunk_bytes)
# Outputs smaller than this come back inline in the Compute response.
INLINE_OUTPUT_BYTES = 1 << 20


def _as_bytes(x: Any) -> Tuple[memoryview, List[int], int]:
    """(little-endian contiguous bytes, shape, proto dtype) of a numpy array or torch tensor."""
    name = tensors.dtype_name(x)
    if tensors.is_torch(x):
        torch = tensors._torch_module()
        cpu = x.detach().cpu().contiguous()
        arr = cpu.view(torch.int16 if tensors.ITEMSIZE[name] == 2 else torch.int32).numpy()
    else:
        arr = np.ascontiguousarray(tensors.little_endian(x))
    return memoryview(arr.reshape(-1).view(np.uint8)), [int(s) for s in x.shape], tensors.PROTO_DTYPE[name]


def _left(deadline: Optional[float]) -> Optional[float]:
    """Seconds to ``deadline`` (time.monotonic()) for the next RPC of a call: the timeout bounds the whole call, not
    each of its OpenSession, Upload, Compute and Download RPCs (0 once passed: gRPC answers DEADLINE_EXCEEDED)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class StripedClient:
    """Blocking client for the striped streaming API. ``timeout`` (seconds) bounds each whole call."""

    def __init__(
        self,
        address: str = "127.0.0.1:8001",
        *,
        stripes: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        inline_output_bytes: int = INLINE_OUTPUT_BYTES,
        timeout: Optional[float] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, Any]]] = None,
        token: Optional[str] = None,
    ):
        if stripes < 1:
            raise ValueError("stripes must be >= 1")
        if not 4096 <= chunk_bytes <= MAX_CHUNK_BYTES:  # the server's DownloadRequest.chunk_bytes range
            raise ValueError(f"chunk_bytes must be in 4096..{MAX_CHUNK_BYTES}")
        self.address = address
        self.stripes = stripes
        self.chunk_bytes = chunk_bytes
        self.inline_output_bytes = inline_output_bytes
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channels: List[grpc.Channel] = []
        for i in range(stripes):
            # A distinct channel argument per stripe: its own subchannel, so its own TCP connection.
            opts = _channel_options(options) + [("flashserve.stripe", i), ("grpc.use_local_subchannel_pool", 1)]
            if credentials is None:
                self._channels.append(grpc.insecure_channel(address, options=opts))
            else:
                self._channels.append(grpc.secure_channel(address, credentials, options=opts))
        self._stubs = [pb_grpc.AttentionStreamServiceStub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(max_workers=stripes, thread_name_prefix="flashserve-stripe")
        self._closing: set = set()  # CloseSession calls in flight (not waited for)

    @property
    def stubs(self) -> List["pb_grpc.AttentionStreamServiceStub"]:
        """The raw generated stubs, one per stripe (for hand-made sessions)."""
        return self._stubs

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def attention_with_metadata(
        self, q, k, v, causal: bool = False, softmax_scale: Optional[float] = None, return_lse: bool = False,
        timeout: Optional[float] = None, request_id: Optional[str] = None,
    ) -> AttentionResult:
        kind, _ = tensors.check_inputs(q, k, v)
        device = q.device if kind == "torch" else None
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        timeout = self._timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        datas, header = [], pb.AttentionRequest(causal=bool(causal), return_lse=bool(return_lse),
                                                request_id=request_id)
        for field, x in (("q", q), ("k", k), ("v", v)):
            data, shape, dtype = _as_bytes(x)
            datas.append(data)
            getattr(header, field).CopyFrom(pb.Tensor(dtype=dtype, shape=shape))
        if softmax_scale is not None:
            header.softmax_scale = float(softmax_scale)

        session_id = None
        try:
            info = self._stubs[0].OpenSession(header, timeout=_left(deadline), metadata=self._metadata)
            session_id = info.session_id
            response = self._upload_and_compute(session_id, datas, q, return_lse, deadline)
            result = self._collect(session_id, response, kind, device, return_lse, deadline)
            session_id = None  # ended by the server (inline output, or every byte downloaded)
            return result
        except grpc.RpcError as e:
            raise from_rpc_error(e, request_id) from None
        finally:
            if session_id is not None:
                # Not waited for: a call past its timeout must not spend up to 5 s more closing its session (the
                # server drops it after its idle timeout anyway, and the channel outlives this call).
                # Kept until it ends: gRPC cancels a call whose future is garbage-collected.
                closing = self._stubs[0].CloseSession.future(pb.CloseSessionRequest(session_id=session_id),
                                                             timeout=5, metadata=self._metadata)
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)

    def attention(
        self, q, k, v, causal: bool = False, softmax_scale: Optional[float] = None, return_lse: bool = False,
        timeout: Optional[float] = None, request_id: Optional[str] = None,
    ):
        """Like ``Client.attention``: out, or (out, lse) when return_lse."""
        result = self.attention_with_metadata(q, k, v, causal, softmax_scale, return_lse, timeout, request_id)
        return (result.out, result.lse) if return_lse else result.out

    # --- steps ---------------------------------------------------------------------------------------------------

    def _upload_and_compute(self, session_id, datas, q, return_lse, deadline) -> "pb.AttentionResponse":
        pieces: List[List[Tuple[int, int, int]]] = [[] for _ in range(self.stripes)]
        n = 0
        for index, data in enumerate(datas):
            for offset in range(0, len(data), self.chunk_bytes):
                pieces[n % self.stripes].append((index + 1, offset, min(self.chunk_bytes, len(data) - offset)))
                n += 1

        def chunks(mine) -> Iterator["pb.AttentionChunk"]:
            for i, (tensor, offset, length) in enumerate(mine):
                yield pb.AttentionChunk(session_id=session_id if i == 0 else "", tensor=tensor, offset=offset,
                                        data=bytes(datas[tensor - 1][offset:offset + length]))

        uploads = [self._pool.submit(self._stubs[s].Upload, chunks(pieces[s]), timeout=_left(deadline),
                                     metadata=self._metadata)
                   for s in range(self.stripes) if pieces[s]]
        errors = []
        for f in uploads:
            try:
                f.result()
            except grpc.RpcError as e:
                errors.append(e)
        if errors:
            raise errors[0]
        out_bytes = len(datas[0])  # O is shaped and typed like Q
        inline = self.stripes == 1 or out_bytes < self.inline_output_bytes
        return self._stubs[0].Compute(pb.ComputeRequest(session_id=session_id, inline_output=inline),
                                      timeout=_left(deadline), metadata=self._metadata)

    def _download(self, stripe, session_id, tensor, offset, length, dest: memoryview, deadline) -> int:
        got = 0
        request = pb.DownloadRequest(session_id=session_id, tensor=tensor, offset=offset, length=length,
                                     chunk_bytes=self.chunk_bytes)
        for chunk in self._stubs[stripe].Download(request, timeout=_left(deadline), metadata=self._metadata):
            if chunk.tensor != tensor or chunk.offset < offset or chunk.offset + len(chunk.data) > offset + length:
                raise ValueError(f"server sent bytes outside the requested range: {chunk.offset}+{len(chunk.data)}")
            dest[chunk.offset:chunk.offset + len(chunk.data)] = chunk.data
            got += len(chunk.data)
        return got

    def _collect(self, session_id, response, kind, device, return_lse, deadline) -> AttentionResult:
        wanted = [("out", pb.TENSOR_OUT)] + ([("lse", pb.TENSOR_LSE)] if return_lse else [])
        if not response.out.data:  # striped output: fetch it
            jobs = []
            buffers = {}
            for name, tensor in wanted:
                meta = getattr(response, name)
                count = int(np.prod(list(meta.shape), dtype=np.int64))
                size = count * tensors.ITEMSIZE[tensors.NAME_OF_PROTO_DTYPE[meta.dtype]]
                buffers[name] = bytearray(size)
                parts = self.stripes if name == "out" else 1
                per = -(-size // parts)
                for s in range(parts):
                    offset, length = s * per, min(per, size - s * per)
                    if length > 0:
                        jobs.append((name, size, self._pool.submit(
                            self._download, s, session_id, tensor, offset, length,
                            memoryview(buffers[name]), deadline)))
            got = {name: 0 for name, _ in wanted}
            for name, _, f in jobs:
                got[name] += f.result()
            for name, _ in wanted:
                if got[name] != len(buffers[name]):
                    raise ValueError(f"{name}: downloaded {got[name]} of {len(buffers[name])} bytes")
                getattr(response, name).data = bytes(buffers[name])
        out = tensors.from_proto(response.out, kind, device)
        lse = tensors.from_proto(response.lse, kind, device) if return_lse else None
        return AttentionResult(out=out, lse=lse, timing=Timing.from_proto(response.timing),
                               kernel=response.kernel, request_id=response.request_id)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for c in self._channels:
            c.close()

    def __enter__(self) -> "StripedClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
