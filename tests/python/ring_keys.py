"""Sequence keys chosen by where the client's ring places them. Servers listen on random ports and the ring hashes
the addresses, so a fixed key list can leave one server with no sequence at all (0.2-0.8% of runs for 12-18 keys
over three servers); tests that kill or lose one server pick their keys instead of hoping."""

from __future__ import annotations


def key_on(ring, endpoint, prefix: str = "k") -> str:
    """The first key `prefix`<n> the ring places on `endpoint`."""
    return next(f"{prefix}{i}" for i in range(100_000) if ring.lookup(f"{prefix}{i}") == endpoint)


def keys_spread_over(ring, endpoints, per_endpoint: int, prefix: str = "k"):
    """`per_endpoint` keys for each endpoint, in endpoint order."""
    chosen = {endpoint: [] for endpoint in endpoints}
    for i in range(100_000):
        bucket = chosen[ring.lookup(f"{prefix}{i}")]
        if len(bucket) < per_endpoint:
            bucket.append(f"{prefix}{i}")
        if all(len(b) == per_endpoint for b in chosen.values()):
            return [key for bucket in chosen.values() for key in bucket]
    raise AssertionError(f"the ring never filled every endpoint: {chosen}")
