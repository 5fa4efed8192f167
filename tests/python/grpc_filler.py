"""Protobuf bytes any of our messages parses: one unknown length-delimited field (number 2047, which no message of
ours has) of zeros, so a test can make a message of exactly `size` bytes without building a real one (hostile
clients, compression bombs). No dependency beyond the standard library."""

from __future__ import annotations


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def filler_head(size: int) -> tuple[bytes, int]:
    """(the field's tag and length, the number of zero bytes that follow) for a message of `size` bytes in all."""
    tag = varint((2047 << 3) | 2)
    length = next(size - len(tag) - n for n in range(1, 11) if len(varint(size - len(tag) - n)) == n)
    return tag + varint(length), length
