"""Protobuf wire bytes written by hand: varint (also for the health and KServe shared-memory messages, which are
not compiled into this package), and the Sequences requests whose size is their tensors (CreateSequence with a
prefix, Append, a packed DecodeStep), joined from the tensors' bytes instead of built as a message and serialized.

A 32 MiB prefix (8k tokens of a Llama-3-8B-like layer) took ~50 ms to copy into the request message and serialize
(upb, the 2-core build machine); joined here from HostRows (sequences.encode_prefix: the array's bytes), they are
copied once more, in the join. The bytes parse to exactly the
message the typed path builds (tests/python/test_sequences_client.py)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ._pb import attention_pb2 as pb
from ._pb import sequences_pb2 as spb

_LAYER_KV = spb.LayerKV.DESCRIPTOR.fields_by_name
_PREFIX_FIELD = spb.CreateSequenceRequest.DESCRIPTOR.fields_by_name["prefix"].number
_ROWS_FIELD = spb.AppendRequest.DESCRIPTOR.fields_by_name["rows"].number
_PACKED_FIELD = spb.DecodeStepRequest.DESCRIPTOR.fields_by_name["packed"].number
_PACKED_ROWS = spb.PackedDecodeRows.DESCRIPTOR.fields_by_name
_DATA_FIELD = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_LENGTH_DELIMITED = 2


def varint(n: int) -> bytes:
    """n (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, parts: List[bytes]) -> List[bytes]:
    """A length-delimited field whose payload is parts joined."""
    return [varint(number << 3 | _LENGTH_DELIMITED), varint(sum(map(len, parts)))] + parts


def _tensor(t) -> List[bytes]:
    """t's wire bytes (a pb.Tensor or tensors.HostRows): every field but data serialized, then data as it is (field
    order does not matter to a parser). A pb.Tensor's data is read once: each read copies it out of the message."""
    head = pb.Tensor(dtype=t.dtype, shape=t.shape)
    if isinstance(t, pb.Tensor) and t.HasField("shm"):
        head.shm.CopyFrom(t.shm)
    parts = [head.SerializeToString()]
    data = t.data
    if data:
        parts += _field(_DATA_FIELD, [data])
    return parts


def rows_tensor(pieces) -> List[bytes]:
    """One Tensor of the pieces' rows back to back (pb.Tensor or HostRows of one dtype and row shape): its header
    serialized, its data field written around the pieces' bytes, which the caller's join copies once."""
    first = pieces[0]
    rows = sum(int(t.shape[0]) for t in pieces)
    parts = [pb.Tensor(dtype=first.dtype, shape=[rows, *first.shape[1:]]).SerializeToString()]
    datas = [t.data for t in pieces]  # a pb.Tensor's data read once: each read copies it
    if any(map(len, datas)):
        parts += _field(_DATA_FIELD, datas)
    return parts


def _layer_kv(layer: int, k, v, expected_length=None) -> List[bytes]:
    head = spb.LayerKV(layer=layer)
    if expected_length is not None:
        head.expected_length = expected_length
    return ([head.SerializeToString()] + _field(_LAYER_KV["k"].number, _tensor(k))
            + _field(_LAYER_KV["v"].number, _tensor(v)))


def create_request_bytes(header: "spb.CreateSequenceRequest", prefix: Dict[int, Tuple[Any, Any]]) -> bytes:
    """header (a CreateSequenceRequest without prefix) with prefix {layer: (k, v)} appended, layers in order."""
    parts = [header.SerializeToString()]
    for layer, (k, v) in sorted(prefix.items()):
        parts += _field(_PREFIX_FIELD, _layer_kv(layer, k, v))
    return b"".join(parts)


def append_request_bytes(sequence_id: str, rows: Dict[int, Tuple[Any, Any]], expected: Dict[int, int]) -> bytes:
    """An AppendRequest of rows {layer: (k, v)} (layers in order), each with expected[layer] as expected_length."""
    parts = [spb.AppendRequest(sequence_id=sequence_id).SerializeToString()]
    for layer, (k, v) in sorted(rows.items()):
        parts += _field(_ROWS_FIELD, _layer_kv(layer, k, v, expected[layer]))
    return b"".join(parts)


def packed_step_bytes(header: "spb.DecodeStepRequest", rows: "spb.PackedDecodeRows", q, k, v) -> bytes:
    """header (a DecodeStepRequest without packed) with packed = rows (its rows_q / rows_kv) and the tensors joined
    from the pieces q, k and v (k and v may be empty lists: attend only)."""
    packed = [rows.SerializeToString()] + _field(_PACKED_ROWS["q"].number, rows_tensor(q))
    if k:
        packed += _field(_PACKED_ROWS["k"].number, rows_tensor(k)) + _field(_PACKED_ROWS["v"].number, rows_tensor(v))
    return b"".join([header.SerializeToString()] + _field(_PACKED_FIELD, packed))
