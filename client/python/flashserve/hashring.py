"""Consistent hashing of routing keys over a list of endpoints (which server holds a sequence).

Each endpoint owns ``vnodes`` points on a 64-bit ring (blake2b of "endpoint#i"); a key belongs to the first point at
or after its own hash. Removing an endpoint moves only the keys it owned (to the next endpoints on the ring), so a
server leaving costs a re-prefill of its own sequences only, and the others stay where their caches are.

    ring = HashRing(["10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"])
    ring.lookup("request-42")                              # same answer on every client with the same list
    ring.lookup("request-42", exclude={"10.0.0.2:8001"})   # the endpoint it moves to while 10.0.0.2 is down
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Collection, Iterable, List, Tuple

DEFAULT_VNODES = 160


def hash64(text: str) -> int:
    """Stable 64-bit hash (same in every process and Python version, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Immutable ring of endpoints; lookups are O(log(endpoints * vnodes))."""

    def __init__(self, endpoints: Iterable[str], vnodes: int = DEFAULT_VNODES):
        self.endpoints: Tuple[str, ...] = tuple(dict.fromkeys(endpoints))  # order kept, duplicates dropped
        if not self.endpoints:
            raise ValueError("HashRing needs at least one endpoint")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        points: List[Tuple[int, str]] = sorted(
            (hash64(f"{endpoint}#{i}"), endpoint) for endpoint in self.endpoints for i in range(vnodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [e for _, e in points]

    def lookup(self, key: str, exclude: Collection[str] = ()) -> str:
        """The endpoint that owns ``key``, skipping endpoints in ``exclude``; ValueError if all are excluded."""
        if all(e in exclude for e in self.endpoints):
            raise ValueError(f"every endpoint is excluded ({len(self.endpoints)} of {len(self.endpoints)})")
        start = bisect.bisect_left(self._hashes, hash64(key))
        n = len(self._owners)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in exclude:
                return owner
        raise AssertionError("unreachable: some endpoint is not excluded")
