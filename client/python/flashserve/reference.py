"""fp64 numpy reference for flashserve's attention, and the tolerances its answers are held to.

Semantics (same as the server):
  q: [batch, seqlen_q, heads_q, head_dim], k and v: [batch, seqlen_k, heads_kv, head_dim]
  out[b, i, h] = softmax_j(scale * q[b, i, h] . k[b, j, h // (heads_q // heads_kv)]) @ v[b, j, kv head]
  scale defaults to 1 / sqrt(head_dim); causal is bottom-right aligned (query i sees key j iff
  j <= i + seqlen_k - seqlen_q); a row that sees no key gets out = 0 and lse = -inf.
  lse[b, h, i] = log(sum_j exp(scale * q.k)), natural log, shape [batch, heads_q, seqlen_q].
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from . import tensors


def _to_float64(x: Any, field: str) -> np.ndarray:
    if tensors.is_torch(x):
        x = x.detach().to("cpu").double().numpy()
    arr = np.asarray(x)
    if arr.ndim != 4:
        raise ValueError(f"{field}: expected 4 dimensions [batch, seqlen, heads, head_dim], got shape {arr.shape}")
    return arr.astype(np.float64)


def causal_mask(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """[seqlen_q, seqlen_k] bool, True where query i may see key j (bottom-right aligned)."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def attention(q, k, v, causal: bool = False, softmax_scale: Optional[float] = None, return_lse: bool = False):
    """Exact attention in float64. Any float input (numpy incl. ml_dtypes bfloat16, or torch) is cast to float64.

    Returns out float64 [batch, seqlen_q, heads_q, head_dim], or (out, lse) with lse float64
    [batch, heads_q, seqlen_q] when return_lse.
    """
    q64, k64, v64 = _to_float64(q, "q"), _to_float64(k, "k"), _to_float64(v, "v")
    batch, seqlen_q, heads_q, head_dim = q64.shape
    if k64.shape[0] != batch or k64.shape[3] != head_dim or v64.shape != k64.shape:
        raise ValueError(f"incompatible shapes q={q64.shape} k={k64.shape} v={v64.shape}")
    seqlen_k, heads_kv = k64.shape[1], k64.shape[2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    group = heads_q // heads_kv
    mask = causal_mask(seqlen_q, seqlen_k) if causal else None

    out = np.zeros((batch, seqlen_q, heads_q, head_dim))
    lse = np.full((batch, heads_q, seqlen_q), -np.inf)
    for b in range(batch):
        qb = q64[b].transpose(1, 0, 2)  # [heads_q, seqlen_q, head_dim]
        # np.repeat along heads maps query head h to kv head h // group.
        kb = np.repeat(k64[b], group, axis=1).transpose(1, 0, 2)  # [heads_q, seqlen_k, head_dim]
        vb = np.repeat(v64[b], group, axis=1).transpose(1, 0, 2)
        scores = scale * (qb @ kb.transpose(0, 2, 1))  # [heads_q, seqlen_q, seqlen_k]
        if mask is not None:
            scores = np.where(mask[None], scores, -np.inf)
        row_max = scores.max(axis=-1, keepdims=True)
        # False for rows that see no key (max -inf); a NaN score makes the row NaN, as in the kernels (np.isfinite
        # took NaN rows for rows that see nothing: O = 0, LSE = -inf, hiding the NaN).
        seen = row_max != -np.inf
        p = np.exp(scores - np.where(seen, row_max, 0.0))
        row_sum = p.sum(axis=-1, keepdims=True)
        ob = (p @ vb) / np.where(seen, row_sum, 1.0)
        out[b] = ob.transpose(1, 0, 2)
        lse[b] = np.where(seen, row_max + np.log(np.where(seen, row_sum, 1.0)), -np.inf)[..., 0]
    return (out, lse) if return_lse else out


# --- tolerances ---------------------------------------------------------------------------------------------------

# Machine epsilon (spacing of numbers at 1.0) of each wire dtype.
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}
FP32_EPS = EPS["float32"]
# Slack for a backend that rounds P (the softmax weights) to the input dtype before the P @ V product, as
# FlashAttention-2 does: at most half an ulp per weight, i.e. about eps/2 * |out| when one key dominates and less
# when the weights spread (the errors have random signs). One eps covers that with a factor 2 to spare.
P_ROUNDING_FACTOR = 1.0
# Slack for fp32 logits and exp: an absolute logit error d scales a weight by ~(1 + d); d grows with |logit| (the
# scale rounded to fp32, exp/exp2 approximations of a few ulp, dot products over head_dim).
FP32_COMPUTE_FACTOR = 4.0


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to the wire dtype (round-to-nearest-even) and back to float64."""
    return np.asarray(x, dtype=np.float64).astype(tensors.numpy_dtype(dtype)).astype(np.float64)


def output_tolerance(ref: np.ndarray, dtype: str, max_abs_v: float, max_abs_logit: float) -> float:
    """Max abs error allowed for an output of ``dtype`` whose fp64 reference is ``ref``.

    tol = 2 * max|ref - round_to_dtype(ref)|                         the output's own rounding error, twice
        + P_ROUNDING_FACTOR * eps_dtype * max|ref|                   P rounded to dtype before P @ V
        + FP32_COMPUTE_FACTOR * eps_fp32 * (1 + max|logit|) * max|v|   fp32 logits and exp
    The first term is irreducible (an exact kernel still has to round its output to dtype); the others are the slack
    for computing in finite precision. For float16 / bfloat16 the first two dominate (about 2 eps * max|ref|, a
    few times what a correctly rounded answer shows); for float32 the third.
    """
    ref = np.asarray(ref, dtype=np.float64)
    if ref.size == 0:
        return 0.0
    max_ref = float(np.max(np.abs(ref)))
    rounding = float(np.max(np.abs(ref - round_to_dtype(ref, dtype))))
    return (
        2.0 * rounding
        + P_ROUNDING_FACTOR * EPS[dtype] * max_ref
        + FP32_COMPUTE_FACTOR * FP32_EPS * (1.0 + max_abs_logit) * max_abs_v
    )


def max_abs_logit(q, k, softmax_scale: Optional[float] = None) -> float:
    """max |scale * q . k| over every (query, key, head) pair, GQA mapping applied (mask ignored)."""
    q64, k64 = _to_float64(q, "q"), _to_float64(k, "k")
    scale = 1.0 / math.sqrt(q64.shape[-1]) if softmax_scale is None else abs(float(softmax_scale))
    group = q64.shape[2] // k64.shape[2]
    result = 0.0
    for b in range(q64.shape[0]):
        qb = q64[b].transpose(1, 0, 2)
        kb = np.repeat(k64[b], group, axis=1).transpose(1, 2, 0)
        result = max(result, float(np.abs(qb @ kb).max()))
    return scale * result


def lse_tolerance(ref_lse: np.ndarray) -> np.ndarray:
    """Elementwise abs tolerance for the float32 LSE: 1e-4 * max(1, |lse|) (fp32 log/exp over long rows)."""
    ref_lse = np.asarray(ref_lse, dtype=np.float64)
    return 1e-4 * np.maximum(1.0, np.abs(np.where(np.isfinite(ref_lse), ref_lse, 0.0)))


def compare_lse(lse: np.ndarray, ref_lse: np.ndarray):
    """Returns (max abs error over finite entries, ok). -inf entries must match exactly; NaN always fails."""
    lse = np.asarray(lse, dtype=np.float64)
    ref_lse = np.asarray(ref_lse, dtype=np.float64)
    if lse.shape != ref_lse.shape:
        return math.inf, False
    ref_masked = np.isneginf(ref_lse)
    if np.isnan(lse).any() or not np.array_equal(np.isneginf(lse), ref_masked):
        return math.inf, False
    finite = ~ref_masked
    if not finite.any():
        return 0.0, True
    err = np.abs(lse[finite] - ref_lse[finite])
    return float(err.max()), bool((err <= lse_tolerance(ref_lse)[finite]).all())
