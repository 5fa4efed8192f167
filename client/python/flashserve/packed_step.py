"""DecodeStepRequest.packed: a step's items as one q, one k and one v tensor (each item's rows back to back in item
order) instead of three tensors per item. The server parses and checks three tensors instead of 3n, which takes a
64-sequence step's preparation from 65-165 us to 25-53 us on an H100 host (SEQUENCES_API.md)."""

from __future__ import annotations

from typing import Optional, Sequence as Seq, Tuple

from ._pb import attention_pb2 as pb
from ._pb import sequences_pb2 as spb

# (sequence id, layer, q, k, v): encoded rows (attention_pb2.Tensor, [rows, heads, head_dim]); k/v may be None.
PackedInput = Tuple[str, int, "pb.Tensor", Optional["pb.Tensor"], Optional["pb.Tensor"]]


def _same_kind(t: "pb.Tensor", like: "pb.Tensor") -> bool:
    return t.dtype == like.dtype and list(t.shape[1:]) == list(like.shape[1:]) and len(t.shape) == 3


def _concat_into(field: "pb.Tensor", parts: Seq["pb.Tensor"]) -> None:
    """field = the parts' rows back to back (set in place: no intermediate message to copy from)."""
    field.dtype = parts[0].dtype
    field.shape.extend([sum(int(t.shape[0]) for t in parts), *parts[0].shape[1:]])
    field.data = b"".join(t.data for t in parts)


def packed_step_request(items: Seq[PackedInput]) -> Optional["spb.DecodeStepRequest"]:
    """The items as one packed DecodeStepRequest (causal, scale and return_lse left for the caller), or None when
    their tensors cannot share one -- mixed dtypes or head shapes, k and v of different shapes -- so that the
    per-item form lets the server name the item at fault."""
    q0 = items[0][2]
    kv0 = next((k for _, _, _, k, _ in items if k is not None), None)
    for _, _, q, k, v in items:
        if not _same_kind(q, q0):
            return None
        if k is not None and not (v is not None and _same_kind(k, kv0) and list(k.shape) == list(v.shape)):
            return None
    request = spb.DecodeStepRequest()
    for sid, layer, *_ in items:
        request.items.add(sequence_id=sid, layer=layer)
    packed = request.packed
    _concat_into(packed.q, [q for _, _, q, _, _ in items])
    packed.rows_q.extend(q.shape[0] for _, _, q, _, _ in items)
    if kv0 is not None:
        _concat_into(packed.k, [k for _, _, _, k, _ in items if k is not None])
        _concat_into(packed.v, [v for _, _, _, k, v in items if k is not None])
        packed.rows_kv.extend(k.shape[0] if k is not None else 0 for _, _, _, k, _ in items)
    return request
