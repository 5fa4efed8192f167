"""A create's prefix cut to fit requests: one CreateSequence, then Appends. A sequence of many layers outgrows one
request long before the server holds too much of it (32 layers of a Llama-3-8B-like model: 128 KiB per token, so
8k tokens fill the server's default --max_request_bytes of 1 GiB and 16k gRPC's own 2 GiB); a re-prefill sends all
of it again."""

from __future__ import annotations

from typing import Dict, List, Tuple

from ._seq_history import _data_bytes
from .tensors import HostRows

Rows = object  # tensors.HostRows or attention_pb2.Tensor, [rows, heads, head_dim]
Prefix = Dict[int, Tuple[Rows, Rows]]

# The most bytes of K and V rows one request of a (re-)create carries by default.
CREATE_CHUNK_BYTES = 256 << 20


def split_prefix(prefix: Prefix, chunk_bytes: int) -> Tuple[Prefix, List[Prefix]]:
    """(the CreateSequence's prefix, the Appends' rows in order): every layer's rows in order, each request at most
    chunk_bytes of K and V (but at least one row) and a layer at most once per request. A prefix that fits is
    returned whole, with no appends."""
    if sum(2 * _data_bytes(k) for k, _ in prefix.values()) <= chunk_bytes:
        return prefix, []
    requests: List[Prefix] = [{}]
    size = 0
    for layer in sorted(prefix):
        k, v = (_as_host_rows(t) for t in prefix[layer])
        rows = int(k.shape[0])
        row_bytes = 2 * len(k.data) // rows if rows else 0
        per_piece = max(1, chunk_bytes // row_bytes) if row_bytes else 1
        for start in range(0, max(rows, 1), per_piece):
            end = min(rows, start + per_piece)
            piece = (end - start) * row_bytes
            if requests[-1] and (layer in requests[-1] or size + piece > chunk_bytes):
                requests.append({})
                size = 0
            requests[-1][layer] = (_row_range(k, start, end), _row_range(v, start, end))
            size += piece
    return requests[0], requests[1:]


def _as_host_rows(t: Rows) -> HostRows:
    """t's bytes read once (each read of a pb.Tensor's data copies it)."""
    return t if isinstance(t, HostRows) else HostRows(t.dtype, tuple(t.shape), t.data)


def _row_range(t: HostRows, start: int, end: int) -> HostRows:
    """Rows [start, end) of a row-major [rows, heads, d] tensor, as a view."""
    rows = int(t.shape[0])
    row_bytes = len(t.data) // rows if rows else 0
    return HostRows(t.dtype, (end - start,) + tuple(t.shape[1:]),
                    memoryview(t.data)[start * row_bytes:end * row_bytes])
