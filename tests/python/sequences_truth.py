"""The client-side truth for Sequences tests: every K/V row a test appended, and the fp64 check of an answer.

    truth = Truth(rng, heads_q=8, heads_kv=2, head_dim=64, dtype="float16")
    k, v = truth.rows(5)                      # fresh random rows [5, heads_kv, head_dim]
    truth.add(seq_key, layer, k, v)           # what the server should now hold
    truth.check(out, q, seq_key, layer)       # out against the fp64 reference over every row of that layer
    truth.keep(seq_key, layer, n)             # after a Truncate: only the first n rows stay
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from conftest import assert_matches_reference
from flashserve import tensors


class Truth:
    def __init__(self, rng, heads_q: int, heads_kv: int, head_dim: int, dtype: str, scale: float = 1.0):
        self.rng, self.heads_q, self.heads_kv, self.head_dim, self.dtype = rng, heads_q, heads_kv, head_dim, dtype
        self.scale = scale  # spread of the random values: larger -> peakier softmax
        self.k = defaultdict(list)
        self.v = defaultdict(list)

    def _random(self, shape) -> np.ndarray:
        return (self.scale * self.rng.standard_normal(shape)).astype(tensors.numpy_dtype(self.dtype))

    def rows(self, n: int):
        shape = (n, self.heads_kv, self.head_dim)
        return self._random(shape), self._random(shape)

    def query(self, rows_q: int = 1) -> np.ndarray:
        return self._random((rows_q, self.heads_q, self.head_dim))

    def add(self, key, layer: int, k, v) -> None:
        if k is not None and len(k):
            self.k[(key, layer)].append(np.asarray(k))
            self.v[(key, layer)].append(np.asarray(v))

    def keep(self, key, layer: int, n: int) -> None:
        """Only the first n rows of (key, layer) stay (a Truncate)."""
        k, v = self.kv(key, layer)
        self.k[(key, layer)], self.v[(key, layer)] = ([k[:n]], [v[:n]]) if n else ([], [])

    def create(self, client, prefixes) -> list:
        """One single-layer sequence per prefix length, created through `client` with fresh rows (kept here)."""
        seqs = []
        for n in prefixes:
            k, v = self.rows(n)
            seqs.append(client.create(num_layers=1, heads_q=self.heads_q, heads_kv=self.heads_kv,
                                      head_dim=self.head_dim, dtype=self.dtype, prefix={0: (k, v)}))
            self.add(seqs[-1].key, 0, k, v)
        return seqs

    def length(self, key, layer: int) -> int:
        return sum(len(k) for k in self.k[(key, layer)])

    def kv(self, key, layer: int):
        empty = np.zeros((0, self.heads_kv, self.head_dim), tensors.numpy_dtype(self.dtype))
        ks, vs = self.k[(key, layer)] or [empty], self.v[(key, layer)] or [empty]
        return np.concatenate(ks), np.concatenate(vs)

    def check(self, out, q, key, layer: int, causal: bool = False, lse=None, softmax_scale=None) -> None:
        """out [rows_q, heads_q, d] (numpy or torch) against fp64 attention over every row of (key, layer)."""
        k, v = self.kv(key, layer)
        out = out.detach().cpu().numpy() if hasattr(out, "detach") else out
        lse4 = None
        if lse is not None:
            lse4 = (lse.detach().cpu().numpy() if hasattr(lse, "detach") else lse)[None]
        assert_matches_reference(np.asarray(out)[None], lse4, np.asarray(q)[None], k[None], v[None], causal=causal,
                                 softmax_scale=softmax_scale)
