"""Shared memory with a flashserve server on the same host (Triton's shared-memory extension; the server needs
--allow_client_shm).

``SystemRegion`` is a POSIX shared-memory region of this process, registered with the server. Passed as
``Client.attention(..., region=r)``, Q, K and V are written into it and O (and LSE) read back from it: no tensor
byte crosses the socket. Regions are registered over the KServe gRPC service on the same port.

    with flashserve.Client("127.0.0.1:8001") as c, SystemRegion(c, "mine", SystemRegion.bytes_for(q, k, v)) as r:
        out = c.attention(q, k, v, region=r)
"""

from __future__ import annotations

import collections
import threading
from multiprocessing import shared_memory
from typing import Any, List, Optional, Tuple

import numpy as np

from ._pb import attention_pb2 as pb
from ._wire import varint
from .errors import FlashserveError, ResourceExhaustedError

_REGISTER = "/inference.GRPCInferenceService/SystemSharedMemoryRegister"
_UNREGISTER = "/inference.GRPCInferenceService/SystemSharedMemoryUnregister"
ALIGN = 64  # tensors start 64-byte aligned: the server's backends read aligned memory in place


def _field(number: int, value) -> bytes:
    """One protobuf field (the KServe messages are not compiled into this package): str, bytes or unsigned int."""
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    data = value.encode() if isinstance(value, str) else bytes(value)
    return varint(number << 3 | 2) + varint(len(data)) + data


def _call(client, method: str, body: bytes) -> None:
    """A KServe shared-memory call on the client's channel, with its token."""
    import grpc

    from .errors import from_rpc_error

    rpc = client.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        rpc(body, timeout=30, metadata=client._metadata)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SystemRegion:
    """A POSIX shared-memory region of ``byte_size`` bytes, registered with the server of ``client`` as ``name``.
    Close it (or use it as a context manager) to unregister and free it."""

    def __init__(self, client, name: str, byte_size: int):
        self.name = name
        self.byte_size = int(byte_size)
        self._client = client
        self._shm = shared_memory.SharedMemory(create=True, size=self.byte_size)
        self._buffer = np.frombuffer(self._shm.buf, np.uint8)
        body = _field(1, name) + _field(2, "/" + self._shm.name) + _field(4, self.byte_size)
        try:
            self._call(_REGISTER, body)
        except Exception:
            self._free()
            raise

    @staticmethod
    def bytes_for(q, k, v, return_lse: bool = True) -> int:
        """Bytes a region needs for one call of these tensors (Q, K, V, O and LSE, each 64-byte aligned)."""
        lse = 4 * int(q.shape[0]) * int(q.shape[2]) * int(q.shape[1]) if return_lse else 0
        return sum(_aligned(_nbytes(x)) for x in (q, k, v, q)) + lse

    def _call(self, method: str, body: bytes) -> None:
        _call(self._client, method, body)

    def write(self, data: bytes, offset: int) -> "pb.SharedMemoryRef":
        """Copies ``data`` into the region at ``offset``; the reference to it."""
        self._check(offset, len(data))
        self._buffer[offset:offset + len(data)] = np.frombuffer(data, np.uint8)
        return self.ref(offset, len(data))

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check(offset, nbytes)
        return self._buffer[offset:offset + nbytes].tobytes()

    def ref(self, offset: int, nbytes: int) -> "pb.SharedMemoryRef":
        return pb.SharedMemoryRef(region=self.name, offset=int(offset), byte_size=int(nbytes))

    def _check(self, offset: int, nbytes: int) -> None:
        import grpc

        from .errors import InvalidArgumentError

        if offset < 0 or nbytes < 0 or offset + nbytes > self.byte_size:
            raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT,
                f"region {self.name!r}: {nbytes} bytes at offset {offset} do not fit its {self.byte_size} bytes "
                "(SystemRegion.bytes_for gives the size a call needs)")

    def place(self, request: "pb.AttentionRequest", return_lse: bool) -> List[Tuple[str, int, int]]:
        """Moves the request's Q, K, V data into the region and names O (and LSE) there; returns where the outputs
        will be: [(field, offset, bytes)]."""
        at = 0
        for field in ("q", "k", "v"):
            tensor = getattr(request, field)
            ref = self.write(tensor.data, at)
            at = _aligned(at + len(tensor.data))
            tensor.ClearField("data")
            tensor.shm.CopyFrom(ref)
        outputs = [("out", at, _nbytes_of(request.q))]
        request.out_shm.CopyFrom(self.ref(at, outputs[0][2]))
        self._check(at, outputs[0][2])
        if return_lse:
            at = _aligned(at + outputs[0][2])
            shape = list(request.q.shape)
            lse_bytes = 4 * shape[0] * shape[2] * shape[1]
            self._check(at, lse_bytes)
            request.lse_shm.CopyFrom(self.ref(at, lse_bytes))
            outputs.append(("lse", at, lse_bytes))
        return outputs

    def _free(self) -> None:
        del self._buffer
        self._shm.close()
        self._shm.unlink()

    def close(self) -> None:
        if self._shm is None:
            return
        try:
            self._call(_UNREGISTER, _field(1, self.name))
        finally:
            self._free()
            self._shm = None

    def __enter__(self) -> "SystemRegion":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _nbytes(x) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * (x.element_size() if hasattr(x, "element_size") else x.itemsize)


def _nbytes_of(t: "pb.Tensor") -> int:
    itemsize = {pb.FLOAT16: 2, pb.BFLOAT16: 2, pb.FLOAT32: 4}[t.dtype]
    return int(np.prod(list(t.shape), dtype=np.int64)) * itemsize


_CUDA_REGISTER = "/inference.GRPCInferenceService/CudaSharedMemoryRegister"
_CUDA_UNREGISTER = "/inference.GRPCInferenceService/CudaSharedMemoryUnregister"


class TorchCudaIpc:
    """torch CUDA tensors by CUDA IPC (a server on this host with --allow_client_shm): the device allocation holding
    each tensor (found with the driver's cuMemGetAddressRange, shared with cuIpcGetMemHandle: torch's own storage
    sharing is not used, its reference counting would keep every shared block alive) is registered once as a CUDA
    region and the request names the tensor inside it; O and LSE are allocated on q's device and written there by
    the server. Nothing is copied to the host. Client.attention uses it for CUDA tensors unless cuda_ipc=False."""

    def __init__(self, client):
        self._client = client
        # IPC handle bytes -> region name, least recently used first. Guarded by _lock: a Client is shared by
        # threads, and two registering one allocation would take one name twice (ALREADY_EXISTS).
        self._regions: "collections.OrderedDict[bytes, str]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._driver = None

    def _cuda(self):
        if self._driver is None:
            import ctypes

            self._driver = ctypes.CDLL("libcuda.so.1")
        return self._driver

    def _allocation(self, ptr: int) -> Tuple[int, int, bytes]:
        """(base, size, IPC handle) of the device allocation holding ``ptr``."""
        import ctypes

        cuda = self._cuda()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
            raise RuntimeError("cuMemGetAddressRange failed")
        handle = (ctypes.c_char * 64)()
        if cuda.cuIpcGetMemHandle(handle, base) != 0:
            raise RuntimeError("cuIpcGetMemHandle failed (memory not shareable by CUDA IPC)")
        return base.value, size.value, bytes(handle)

    def _region(self, tensor, keep: Optional[set] = None) -> Tuple[str, int]:
        """(region name, byte offset of the tensor in it), registering its allocation the first time. The server
        holds a client's regions up to --shm_max_regions: when it is full, the least recently used ones not in
        ``keep`` (this call's) are unregistered to make room (one still leased by a call in flight stays)."""
        keep = set() if keep is None else keep
        base, size, handle = self._allocation(tensor.data_ptr())
        with self._lock:
            name = self._regions.get(handle)
            if name is not None:
                self._regions.move_to_end(handle)
                keep.add(name)
                return name, tensor.data_ptr() - base
            import hashlib
            import os

            name = f"torch-{os.getpid()}-{hashlib.sha1(handle).hexdigest()[:16]}"
            body = _field(1, name) + _field(2, handle) + _field(3, tensor.device.index or 0) + _field(4, size)
            while True:
                try:
                    _call(self._client, _CUDA_REGISTER, body)
                    break
                except ResourceExhaustedError:
                    if not self._evict_one(keep):
                        raise
            self._regions[handle] = name
            keep.add(name)
        return name, tensor.data_ptr() - base

    def _evict_one(self, keep: set) -> bool:
        """Under _lock: unregisters the least recently used region not in ``keep``; False when none could go."""
        for handle, name in list(self._regions.items()):
            if name in keep:
                continue
            try:
                _call(self._client, _CUDA_UNREGISTER, _field(1, name))
            except FlashserveError:
                continue  # leased by a call in flight: another one may go
            del self._regions[handle]
            return True
        return False

    def _name(self, tensor, keep: Optional[set] = None) -> "pb.SharedMemoryRef":
        name, offset = self._region(tensor, keep)
        return pb.SharedMemoryRef(region=name, offset=offset, byte_size=tensor.numel() * tensor.element_size())

    def place(self, request: "pb.AttentionRequest", q, k, v, return_lse: bool):
        """Names q, k, v (made contiguous on their device) and fresh O (and LSE) tensors on q's device in their
        regions; returns (inputs kept alive, out, lse or None): out and lse hold the result once the call is answered."""
        import torch

        inputs = [t.contiguous() for t in (q, k, v)]
        out = torch.empty_like(inputs[0])
        lse = None
        if return_lse:
            lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
        torch.cuda.synchronize(q.device)  # the server's stream must see the caller's writes
        keep: set = set()  # this call's regions: not evicted to make room for one another
        for field, t in zip(("q", "k", "v"), inputs):
            msg = getattr(request, field)
            msg.ClearField("data")
            msg.shm.CopyFrom(self._name(t, keep))
        request.out_shm.CopyFrom(self._name(out, keep))
        if lse is not None:
            request.lse_shm.CopyFrom(self._name(lse, keep))
        return inputs, out, lse

    def close(self) -> None:
        with self._lock:
            for name in self._regions.values():
                try:
                    _call(self._client, _CUDA_UNREGISTER, _field(1, name))
                except Exception:  # the server may be gone: nothing to give back then
                    pass
            self._regions.clear()
