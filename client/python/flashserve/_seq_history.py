"""What a client keeps of a sequence so it can re-create it on another server (re-prefill).

The server holds the K/V cache; when it loses a sequence (TTL eviction, restart, the server left) the client sends
the rows again as the new sequence's prefix. ``LayerHistory`` keeps the encoded rows that the server acknowledged,
per layer, as wire tensors (pb.Tensor from appends, tensors.HostRows from a prefix): re-sending them is a byte
concatenation, no re-encoding.
"""

from __future__ import annotations

from typing import Dict, List, Tuple, Union

from ._pb import attention_pb2 as pb
from .tensors import ITEMSIZE, NAME_OF_PROTO_DTYPE, HostRows

Rows = Union["pb.Tensor", HostRows]


class LayerHistory:
    """Acknowledged K/V rows of every layer, in append order. Not thread-safe: the owner's lock guards it."""

    def __init__(self, num_layers: int):
        self._k: List[List[Rows]] = [[] for _ in range(num_layers)]
        self._v: List[List[Rows]] = [[] for _ in range(num_layers)]
        self._rows = [0] * num_layers
        self.bytes = 0

    def add(self, layer: int, k: Rows, v: Rows) -> None:
        if not k.shape or k.shape[0] == 0:
            return
        self._k[layer].append(k)
        self._v[layer].append(v)
        self._rows[layer] += int(k.shape[0])
        self.bytes += _data_bytes(k) + _data_bytes(v)

    def take_back(self, layer: int, k: Rows) -> None:
        """Forgets the last add(layer, k, ...) (k: the same object)."""
        if self._k[layer] and self._k[layer][-1] is k:
            self._pop(layer)

    def keep(self, layer: int, rows: int) -> None:
        """Keeps the layer's first ``rows`` rows (a truncate): pieces go from the end, the last one kept is cut (only
        the tail is touched: a speculative step's drafts are the last pieces)."""
        while self._rows[layer] > rows:
            k, v = self._pop(layer)
            left = rows - self._rows[layer]  # of this piece's rows
            if left > 0:
                self.add(layer, _first_rows(k, left), _first_rows(v, left))

    def rows(self, layer: int) -> int:
        return self._rows[layer]

    def _pop(self, layer: int) -> Tuple[Rows, Rows]:
        k, v = self._k[layer].pop(), self._v[layer].pop()
        self._rows[layer] -= int(k.shape[0])
        self.bytes -= _data_bytes(k) + _data_bytes(v)
        return k, v

    def prefix(self) -> Dict[int, Tuple[Rows, Rows]]:
        """{layer: (k, v)} with every acknowledged row of each non-empty layer, as single wire tensors."""
        return {layer: (_concat(self._k[layer]), _concat(self._v[layer]))
                for layer in range(len(self._k)) if self._k[layer]}

    def replace(self, prefix: Dict[int, Tuple[Rows, Rows]]) -> None:
        """Forgets everything and keeps ``prefix`` (what a re-created sequence starts with)."""
        for layer in range(len(self._k)):
            self._k[layer], self._v[layer] = [], []
        self._rows = [0] * len(self._k)
        self.bytes = 0
        for layer, (k, v) in prefix.items():
            self.add(layer, k, v)


def _data_bytes(t: Rows) -> int:
    """The size of t's data: HostRows' own, a pb.Tensor's from its shape (reading its data copies it)."""
    if isinstance(t, HostRows):
        return len(t.data)  # bytes, or a memoryview of bytes
    count = 1
    for n in t.shape:
        count *= int(n)
    return count * ITEMSIZE.get(NAME_OF_PROTO_DTYPE.get(t.dtype, ""), 1)


def _first_rows(t: Rows, n: int) -> Rows:
    """The first n rows of a row-major [rows, heads, d] tensor."""
    row_bytes = _data_bytes(t) // int(t.shape[0])
    return HostRows(t.dtype, (n,) + tuple(t.shape[1:]), bytes(t.data[:n * row_bytes]))


def _concat(pieces: List[Rows]) -> Rows:
    """Row-major [rows, heads, d] tensors joined along rows: their bytes one after another."""
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    rows = sum(int(t.shape[0]) for t in pieces)
    return HostRows(first.dtype, (rows,) + tuple(first.shape[1:]), b"".join(t.data for t in pieces))
