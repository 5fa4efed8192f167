"""Conversions between numpy arrays / torch tensors and the wire ``flashserve.v1.Tensor``.

Wire format: dtype enum, shape, and row-major little-endian bytes. Supported element types: float16, bfloat16
(numpy through ml_dtypes), float32. torch is never imported here: a torch tensor can only exist if the caller
already imported torch, so ``sys.modules`` tells us whether to look for one.
"""

from __future__ import annotations

import sys
from typing import Any, List, Sequence, Tuple

import numpy as np

from ._pb import attention_pb2 as pb
from .errors import InvalidArgumentError
import grpc

DTYPE_NAMES = ("float16", "bfloat16", "float32")
PROTO_DTYPE = {"float16": pb.FLOAT16, "bfloat16": pb.BFLOAT16, "float32": pb.FLOAT32}
NAME_OF_PROTO_DTYPE = {v: k for k, v in PROTO_DTYPE.items()}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, message)


def bfloat16_dtype() -> np.dtype:
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - ml_dtypes is a declared dependency
        raise ImportError("bfloat16 numpy arrays need ml_dtypes (pip install ml_dtypes)") from e
    return np.dtype(ml_dtypes.bfloat16)


def numpy_dtype(name: str) -> np.dtype:
    """Little-endian numpy dtype for a wire dtype name."""
    if name == "float16":
        return np.dtype("<f2")
    if name == "float32":
        return np.dtype("<f4")
    if name == "bfloat16":
        return bfloat16_dtype().newbyteorder("<")
    raise _invalid(f"unsupported dtype {name!r}; expected one of {DTYPE_NAMES}")


def _torch_module():
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_name(x: Any) -> str:
    """'float16' | 'bfloat16' | 'float32' for a numpy array or torch tensor; InvalidArgumentError otherwise."""
    if is_torch(x):
        torch = _torch_module()
        names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
        if x.dtype not in names:
            raise _invalid(f"unsupported torch dtype {x.dtype}; expected float16, bfloat16 or float32")
        return names[x.dtype]
    if isinstance(x, np.ndarray):
        name = x.dtype.name
        if name not in DTYPE_NAMES:
            raise _invalid(f"unsupported numpy dtype {x.dtype}; expected float16, bfloat16 (ml_dtypes) or float32")
        return name
    raise _invalid(f"expected a numpy array or torch tensor, got {type(x).__name__}")


def to_proto(x: Any, field: str) -> "pb.Tensor":
    """Encodes a 4-D numpy array or torch tensor (copied to host and made contiguous if needed)."""
    name, shape, data = _encode(x, field, "[batch, seqlen, heads, head_dim]")
    return pb.Tensor(dtype=PROTO_DTYPE[name], shape=shape, data=data)


def to_proto_rows(x: Any, field: str) -> "pb.Tensor":
    """Encodes a 3-D [rows, heads, head_dim] array or tensor (the Sequences API's q, k, v)."""
    name, shape, data = _encode(x, field, "[rows, heads, head_dim]")
    return pb.Tensor(dtype=PROTO_DTYPE[name], shape=shape, data=data)


class HostRows:
    """A [rows, heads, head_dim] tensor in wire form outside a protobuf message: the proto dtype, the shape and the
    row-major little-endian bytes, copied once from the array (or a view of it: to_host_rows(copy=False)). Reads like
    a pb.Tensor (dtype, shape, data). A CreateSequence prefix (32 MiB for 8k tokens of a Llama-3-8B-like layer) is
    joined from these into the request's wire bytes (_wire.py); in a pb.Tensor its bytes were copied twice more (into
    the message, and out of it).

    Treated as immutable, but a plain slotted class: a 64-sequence decode_step_batch makes 192 of them per call,
    and a frozen dataclass's __init__ took 3x as long (0.11 ms of the call on the 2-core build machine)."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: int, shape: Tuple[int, ...], data):
        self.dtype = dtype
        self.shape = shape
        self.data = data  # bytes, or a memoryview of bytes (a block of a batch's tensor: decode_step_batch)

    def __repr__(self) -> str:
        return f"HostRows(dtype={self.dtype}, shape={self.shape}, {len(self.data)} bytes)"


def to_host_rows(x: Any, field: str, copy: bool = True) -> HostRows:
    """Like to_proto_rows, as HostRows. ``copy=False``: the data may be a view of x's own memory (a contiguous
    little-endian array or CPU tensor), valid while x is unchanged -- for rows sent at once and not kept (a
    step's q), not for rows a history keeps."""
    name, shape, data = _encode(x, field, "[rows, heads, head_dim]", copy)
    return HostRows(PROTO_DTYPE[name], tuple(shape), data)


def _bytes_of(arr: "np.ndarray", copy: bool):
    """A C-contiguous array's bytes: copied, or a flat byte view of its memory."""
    return arr.tobytes() if copy else memoryview(arr.reshape(-1).view(np.uint8))


def _encode(x: Any, field: str, dims: str, copy: bool = True) -> Tuple[str, List[int], bytes]:
    """(dtype name, shape, bytes) of an array or tensor with the dimensions `dims` names (see to_host_rows for
    ``copy``)."""
    name = dtype_name(x)
    if x.ndim != dims.count(",") + 1:
        raise _invalid(f"{field}: expected {dims.count(',') + 1} dimensions {dims}, got shape {tuple(x.shape)}")
    if is_torch(x):
        torch = _torch_module()
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        as_int = t.view(torch.int16 if ITEMSIZE[name] == 2 else torch.int32).numpy()
        if sys.byteorder != "little":  # pragma: no cover
            as_int = as_int.byteswap()
        data = _bytes_of(as_int, copy)
    else:
        data = _bytes_of(np.ascontiguousarray(little_endian(x)), copy)
    return name, [int(s) for s in x.shape], data


def little_endian(arr: "np.ndarray") -> "np.ndarray":
    """arr itself when its bytes are little-endian already, else a little-endian copy (bfloat16 included: the
    wire is little-endian whatever the array's byte order or the host's)."""
    order = arr.dtype.byteorder
    if order == ">" or (order == "=" and sys.byteorder == "big"):
        return arr.astype(arr.dtype.newbyteorder("<"))
    return arr


def check_inputs(q: Any, k: Any, v: Any) -> Tuple[str, str]:
    """Light client-side validation; the server is the authority. Returns (kind, dtype name)."""
    kinds = ["torch" if is_torch(t) else "numpy" for t in (q, k, v)]
    if len(set(kinds)) != 1:
        raise _invalid(f"q, k, v must all be numpy arrays or all torch tensors, got {kinds}")
    names = [dtype_name(t) for t in (q, k, v)]
    if len(set(names)) != 1:
        raise _invalid(f"q, k, v must have the same dtype, got q={names[0]} k={names[1]} v={names[2]}")
    for field, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise _invalid(
                f"{field}: expected 4 dimensions [batch, seqlen, heads, head_dim], got shape {tuple(t.shape)}"
            )
    return kinds[0], names[0]


def from_proto(t: "pb.Tensor", kind: str = "numpy", device: Any = None):
    """Decodes a wire tensor (or HostRows) into a (writable) numpy array, or a torch tensor on ``device`` when
    kind == 'torch'. Data in a bytearray is used in place (the caller gives it up), other data is copied."""
    if t.dtype not in NAME_OF_PROTO_DTYPE:
        raise _invalid(f"server returned a tensor with unknown dtype {t.dtype}")
    name = NAME_OF_PROTO_DTYPE[t.dtype]
    shape = tuple(int(s) for s in t.shape)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 0
    if len(t.data) != count * ITEMSIZE[name]:
        raise _invalid(f"server returned {len(t.data)} bytes for shape {list(shape)} of {name}")
    if kind == "torch":
        torch = _torch_module()
        torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]
        if count == 0:
            out = torch.empty(shape, dtype=torch_dtype)
        else:
            data = t.data if isinstance(t.data, bytearray) else bytearray(t.data)
            out = torch.frombuffer(data, dtype=torch_dtype).reshape(shape)
        return out.to(device) if device is not None else out
    out = np.frombuffer(t.data, dtype=numpy_dtype(name)).reshape(shape)
    return out if isinstance(t.data, bytearray) else out.copy()


def shape_of(x: Any) -> Sequence[int]:
    return tuple(int(s) for s in x.shape)
