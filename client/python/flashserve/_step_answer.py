"""A DecodeStep's answer read from its wire bytes, a packed answer's O and LSE as views of those bytes.

Parsed as a message, a packed answer's O was copied three times before the caller saw it: into the message, out of
it (each read of a bytes field copies), and into the caller's array (2 MiB each for a 64-sequence step at rows_q 4).
The server writes DecodeStepResponse.packed first (server/edge/sequences/answer_buffer.cc), so its data is found
without walking the results; the rest of the answer (results, timing) is parsed as a message. Anything else -- no
packed field first, a field repeated, a tensor in a region -- is parsed whole, as before."""

from __future__ import annotations

from typing import Optional, Tuple

from ._pb import attention_pb2 as pb
from ._pb import sequences_pb2 as spb
from .tensors import HostRows

_LENGTH_DELIMITED = 2
_PACKED_TAG = spb.DecodeStepResponse.DESCRIPTOR.fields_by_name["packed"].number << 3 | _LENGTH_DELIMITED
_OUT = spb.PackedDecodeAnswer.DESCRIPTOR.fields_by_name["out"].number
_LSE = spb.PackedDecodeAnswer.DESCRIPTOR.fields_by_name["lse"].number
_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number


class DecodeStepAnswer:
    """``response`` (a DecodeStepResponse), and with a packed answer ``out`` / ``lse`` as HostRows whose data is a
    view of the answer's bytes (None where the answer has none). ``response.packed`` is not to be read."""

    __slots__ = ("response", "out", "lse")

    def __init__(self, response, out: Optional[HostRows] = None, lse: Optional[HostRows] = None):
        self.response, self.out, self.lse = response, out, lse

    @classmethod
    def of(cls, response) -> "DecodeStepAnswer":
        """From a parsed message (its packed tensors' data copied out once)."""
        if not response.HasField("packed"):
            return cls(response)
        packed = response.packed
        tensors = [HostRows(t.dtype, tuple(t.shape), t.data) if packed.HasField(name) else None
                   for name, t in (("out", packed.out), ("lse", packed.lse))]
        return cls(response, *tensors)

    @classmethod
    def parse(cls, raw: bytes) -> "DecodeStepAnswer":
        """From the answer's wire bytes (a gRPC deserializer, or a local-socket reply)."""
        found = _leading_packed(raw)
        if found is not None:
            end, out, lse = found
            response = spb.DecodeStepResponse.FromString(raw[end:])
            if not response.HasField("packed"):  # else a second packed field merges into the first: parse whole
                return cls(response, out, lse)
        return cls.of(spb.DecodeStepResponse.FromString(raw))


def _varint(raw, at: int) -> Tuple[int, int]:
    """(value, position after it) of the varint at ``at``; ValueError past the end."""
    value = shift = 0
    while True:
        if at >= len(raw) or shift > 63:
            raise ValueError("truncated varint")
        byte = raw[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return value, at


def _fields(payload: memoryview):
    """(field number, wire type, field start, value start, end) of each field in a message's bytes; ValueError on
    anything malformed."""
    at = 0
    while at < len(payload):
        begin = at
        tag, at = _varint(payload, at)
        kind = tag & 7
        if kind == _LENGTH_DELIMITED:
            size, at = _varint(payload, at)
            start, at = at, at + size
        elif kind == 0:
            start = at
            _, at = _varint(payload, at)
        elif kind in (1, 5):
            start, at = at, at + (8 if kind == 1 else 4)
        else:
            raise ValueError(f"wire type {kind}")
        if at > len(payload):
            raise ValueError("field past the end")
        yield tag >> 3, kind, begin, start, at


def _leading_packed(raw: bytes) -> Optional[Tuple[int, Optional[HostRows], Optional[HostRows]]]:
    """(end of the packed field, out, lse) when the answer starts with DecodeStepResponse.packed whose tensors each
    hold their data once; else None."""
    if not raw or raw[0] != _PACKED_TAG:
        return None
    view = memoryview(raw)
    try:
        size, start = _varint(view, 1)
        end = start + size
        if end > len(raw):
            return None
        found = {}
        for number, kind, _, value, stop in _fields(view[start:end]):
            if number in (_OUT, _LSE):
                if kind != _LENGTH_DELIMITED or number in found:
                    return None
                found[number] = _tensor(view[start + value:start + stop])
        if any(t is None for t in found.values()):
            return None
        return end, found.get(_OUT), found.get(_LSE)
    except ValueError:
        return None


def _tensor(payload: memoryview) -> Optional[HostRows]:
    """A Tensor's dtype and shape parsed, its data a view of ``payload``; None unless data is there exactly once and
    no region is named."""
    data, header = None, []
    for number, kind, begin, value, stop in _fields(payload):
        if number == _DATA:
            if kind != _LENGTH_DELIMITED or data is not None:
                return None
            data = payload[value:stop]
        else:
            header.append(payload[begin:stop])
    if data is None:
        return None
    parsed = pb.Tensor.FromString(b"".join(header))
    if parsed.HasField("shm"):
        return None
    return HostRows(parsed.dtype, tuple(parsed.shape), data)
