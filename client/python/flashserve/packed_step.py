"""DecodeStepRequest.packed: a step's items as one q, one k and one v tensor (each item's rows back to back in item
order) instead of three tensors per item. The server parses and checks three tensors instead of 3n, which takes a
64-sequence step's preparation from 65-165 us to 25-53 us on an H100 host (SEQUENCES_API.md)."""

from __future__ import annotations

from typing import Optional, Sequence as Seq, Tuple

from ._pb import attention_pb2 as pb
from ._pb import sequences_pb2 as spb
from ._wire import packed_step_bytes

# (sequence id, layer, q, k, v): encoded rows (attention_pb2.Tensor or tensors.HostRows, [rows, heads, head_dim]); k/v
# may be None.
PackedInput = Tuple[str, int, "pb.Tensor", Optional["pb.Tensor"], Optional["pb.Tensor"]]


def _same_kind(t: "pb.Tensor", like: "pb.Tensor") -> bool:
    return t.dtype == like.dtype and list(t.shape[1:]) == list(like.shape[1:]) and len(t.shape) == 3


def packed_step_request(items: Seq[PackedInput], expected: Seq[Optional[int]], options) -> Optional[bytes]:
    """The items as one packed DecodeStepRequest's wire bytes (expected[i]: item i's expected_length or None;
    options: causal, softmax_scale, return_lse), or None when their tensors cannot share one -- mixed dtypes or head
    shapes (of q, k or v), k and v of different shapes -- so that the per-item form lets the server name the item at
    fault. The tensors' bytes are copied once, into the request (_wire.packed_step_bytes), not into a message first."""
    q0 = items[0][2]
    kv0 = next((k for _, _, _, k, _ in items if k is not None), None)
    for _, _, q, k, v in items:
        if not _same_kind(q, q0):
            return None
        if k is not None and not (v is not None and _same_kind(k, kv0) and _same_kind(v, kv0) and
                                  list(k.shape) == list(v.shape)):
            return None
    causal, softmax_scale, return_lse = options
    header = spb.DecodeStepRequest(causal=causal, return_lse=return_lse)
    if softmax_scale is not None:
        header.softmax_scale = float(softmax_scale)
    for (sid, layer, *_), length in zip(items, expected):
        entry = header.items.add(sequence_id=sid, layer=layer)
        if length is not None:
            entry.expected_length = length
    # answer_packed: O / LSE come back as one tensor each (a server that predates it answers per result).
    rows = spb.PackedDecodeRows(rows_q=[int(q.shape[0]) for _, _, q, _, _ in items], answer_packed=True)
    if kv0 is not None:
        rows.rows_kv.extend(int(k.shape[0]) if k is not None else 0 for _, _, _, k, _ in items)
    return packed_step_bytes(header, rows, [q for _, _, q, _, _ in items],
                             [k for _, _, _, k, _ in items if k is not None],
                             [v for _, _, _, k, v in items if k is not None])
