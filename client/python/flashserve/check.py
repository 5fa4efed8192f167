"""Checks a running server's answers against the fp64 reference over a grid of problems.

Used by ``python -m flashserve check``. The grid covers odd sequence lengths (1, 17, 97, 300), GQA 8:2 and MQA 6:1,
causal with seqlen_q < seqlen_k and seqlen_q > seqlen_k (rows that see no key), a non-default softmax_scale, every
head_dim and dtype the server reports. Every problem asks for the LSE too. Fresh random inputs from ``seed``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Iterable, List, Optional, TextIO

import numpy as np

from . import reference, tensors
from .client import Client, ServerInfo
from .errors import FlashserveError


@dataclasses.dataclass(frozen=True)
class Problem:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str
    softmax_scale: Optional[float] = None

    def shape_label(self) -> str:
        return f"{self.batch}x{self.seqlen_q}x{self.seqlen_k} h{self.heads_q}:{self.heads_kv} d{self.head_dim}"


@dataclasses.dataclass
class Outcome:
    problem: Problem
    max_abs_err: float = math.nan
    rel_err: float = math.nan
    tol: float = math.nan
    lse_err: float = math.nan
    passed: bool = False
    error: str = ""


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, softmax_scale); the first QUICK_SHAPES are the quick grid.
SHAPES = [
    (1, 1, 1, 1, 1, False, None),
    (2, 17, 17, 8, 2, False, None),  # GQA 8:2
    (1, 97, 300, 6, 1, True, None),  # MQA 6:1, causal, seqlen_q < seqlen_k
    (1, 300, 97, 4, 4, True, None),  # causal, seqlen_q > seqlen_k: the first 203 rows see no key
    (2, 128, 128, 4, 2, True, None),
    (1, 17, 97, 8, 2, False, 0.5),  # explicit softmax_scale
    (1, 1, 300, 6, 1, True, None),  # decode-like: one query, causal sees every key
    (1, 256, 256, 2, 1, False, None),
]
QUICK_SHAPES = 4
# Used when the server lists no head_dims (CPU backend: any head_dim up to max_head_dim): the common sizes and an
# odd one.
FALLBACK_HEAD_DIMS = [64, 128, 40]


def head_dims_for(info: ServerInfo) -> List[int]:
    if info.head_dims:
        return sorted(info.head_dims)
    return [d for d in FALLBACK_HEAD_DIMS if info.supports_head_dim(d)]


def problems_for(info: ServerInfo, quick: bool = False) -> List[Problem]:
    dtypes = [d for d in info.dtypes if d in tensors.DTYPE_NAMES]
    head_dims = head_dims_for(info)
    shapes = SHAPES[:QUICK_SHAPES] if quick else SHAPES
    if quick:
        head_dims = head_dims[:2]
    return [
        Problem(b, sq, sk, hq, hkv, d, causal, dtype, scale)
        for dtype in dtypes
        for d in head_dims
        for (b, sq, sk, hq, hkv, causal, scale) in shapes
    ]


def make_inputs(problem: Problem, rng: np.random.Generator):
    dt = tensors.numpy_dtype(problem.dtype)
    q = rng.standard_normal((problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim)).astype(dt)
    k = rng.standard_normal((problem.batch, problem.seqlen_k, problem.heads_kv, problem.head_dim)).astype(dt)
    v = rng.standard_normal((problem.batch, problem.seqlen_k, problem.heads_kv, problem.head_dim)).astype(dt)
    return q, k, v


def run_problem(client: Client, problem: Problem, rng: np.random.Generator, timeout: Optional[float]) -> Outcome:
    outcome = Outcome(problem)
    q, k, v = make_inputs(problem, rng)
    # The wire carries softmax_scale as float32; the reference uses the same value.
    scale = None if problem.softmax_scale is None else float(np.float32(problem.softmax_scale))
    try:
        out, lse = client.attention(q, k, v, causal=problem.causal, softmax_scale=scale, return_lse=True,
                                    timeout=timeout)
    except FlashserveError as e:
        outcome.error = str(e)
        return outcome
    ref, ref_lse = reference.attention(q, k, v, causal=problem.causal, softmax_scale=scale, return_lse=True)
    if out.shape != ref.shape:
        outcome.error = f"out shape {out.shape} != {ref.shape}"
        return outcome
    # O is like Q and LSE float32 (the contract; compare_lse checks LSE's shape): read as Q's dtype, as other clients
    # do, O of another dtype is garbage, though compared by value it passed.
    if out.dtype != q.dtype or lse.dtype != np.float32:
        outcome.error = f"out {out.dtype} for q {q.dtype}, lse {lse.dtype}: expected q's dtype and float32"
        return outcome
    out64 = out.astype(np.float64)
    max_ref = float(np.abs(ref).max())
    outcome.tol = reference.output_tolerance(
        ref, problem.dtype, float(np.abs(v.astype(np.float64)).max()), reference.max_abs_logit(q, k, scale)
    )
    if np.isnan(out64).any():
        outcome.max_abs_err = math.nan
        outcome.error = "NaN in output"
        return outcome
    outcome.max_abs_err = float(np.abs(out64 - ref).max())
    outcome.rel_err = outcome.max_abs_err / max_ref if max_ref > 0 else outcome.max_abs_err
    outcome.lse_err, lse_ok = reference.compare_lse(lse, ref_lse)
    outcome.passed = outcome.max_abs_err <= outcome.tol and lse_ok
    if not lse_ok:
        outcome.error = "LSE mismatch"
    return outcome


HEADER = ("shape (BxSqxSk heads d)", "dtype", "causal", "scale", "max_abs_err", "rel_err", "tol", "lse_err", "result")


def format_row(o: Outcome) -> List[str]:
    p = o.problem
    result = "PASS" if o.passed else "FAIL" + (f" ({o.error})" if o.error else "")
    return [
        p.shape_label(),
        p.dtype,
        "yes" if p.causal else "no",
        "default" if p.softmax_scale is None else f"{p.softmax_scale:g}",
        f"{o.max_abs_err:.3e}",
        f"{o.rel_err:.3e}",
        f"{o.tol:.3e}",
        f"{o.lse_err:.2e}",
        result,
    ]


def print_table(outcomes: Iterable[Outcome], stream: TextIO) -> None:
    rows = [list(HEADER)] + [format_row(o) for o in outcomes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    for n, row in enumerate(rows):
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths)] + [row[-1]]
        stream.write("  ".join(cells).rstrip() + "\n")
        if n == 0:
            stream.write("  ".join("-" * w for w in widths) + "  ------\n")


def run_check(address: str, seed: int = 0, quick: bool = False, timeout: Optional[float] = 120.0,
              stream: Optional[TextIO] = None, client_kwargs: Optional[dict] = None) -> int:
    """Runs the grid against ``address``; prints the table; returns 0 when every problem passed, else 1."""
    stream = stream if stream is not None else sys.stdout
    rng = np.random.default_rng(seed)
    with Client(address, timeout=timeout, **(client_kwargs or {})) as client:
        info = client.server_info()
        problems = problems_for(info, quick)
        stream.write(
            f"flashserve check: {address} backend={info.backend} version={info.version} dtypes={','.join(info.dtypes)} "
            f"head_dims={','.join(map(str, head_dims_for(info)))} seed={seed} problems={len(problems)}\n"
        )
        outcomes = []
        for problem in problems:
            outcome = run_problem(client, problem, rng, timeout)
            outcomes.append(outcome)
    print_table(outcomes, stream)
    failed = sum(not o.passed for o in outcomes)
    stream.write(f"{len(outcomes) - failed}/{len(outcomes)} passed\n")
    if not outcomes:
        stream.write("FAIL: the server reports no dtype/head_dim this client can check\n")
        return 1
    return 1 if failed else 0
