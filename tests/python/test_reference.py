"""flashserve.reference against a direct loop, and the tolerance helpers."""

import math

import ml_dtypes
import numpy as np
import pytest

from flashserve import reference


def naive_attention(q, k, v, causal=False, softmax_scale=None):
    """Element by element, straight from the definition (Python floats)."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    out = np.zeros(q.shape)
    lse = np.full((batch, heads_q, seqlen_q), -math.inf)
    for b in range(batch):
        for h in range(heads_q):
            kv_head = h // (heads_q // heads_kv)
            for i in range(seqlen_q):
                keys = [j for j in range(seqlen_k) if not causal or j <= i + seqlen_k - seqlen_q]
                if not keys:
                    continue
                logits = [scale * float(np.dot(q[b, i, h], k[b, j, kv_head])) for j in keys]
                m = max(logits)
                weights = [math.exp(s - m) for s in logits]
                total = sum(weights)
                lse[b, h, i] = m + math.log(total)
                for w, j in zip(weights, keys):
                    out[b, i, h] += w / total * v[b, j, kv_head]
    return out, lse


CASES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, scale
    (1, 1, 1, 1, 1, 8, False, None),
    (2, 5, 7, 4, 4, 8, False, None),
    (1, 6, 6, 8, 2, 16, True, None),  # GQA 8:2, causal square
    (1, 3, 9, 6, 1, 4, True, None),  # MQA 6:1, causal seqlen_q < seqlen_k
    (2, 9, 3, 2, 1, 4, True, None),  # causal seqlen_q > seqlen_k: first 6 rows fully masked
    (1, 4, 5, 2, 2, 40, False, 0.37),
]


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads_q,heads_kv,head_dim,causal,scale", CASES)
def test_reference_matches_naive_loop(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, scale):
    q = rng.standard_normal((batch, seqlen_q, heads_q, head_dim))
    k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
    out, lse = reference.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    want_out, want_lse = naive_attention(q, k, v, causal, scale)
    assert out.dtype == np.float64 and out.shape == q.shape
    assert lse.shape == (batch, heads_q, seqlen_q)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12)
    out_only = reference.attention(q, k, v, causal=causal, softmax_scale=scale)
    assert isinstance(out_only, np.ndarray) and np.array_equal(out_only, out)


def test_fully_masked_rows_are_zero_and_neg_inf(rng):
    q = rng.standard_normal((1, 5, 2, 4))
    k = rng.standard_normal((1, 2, 2, 4))
    out, lse = reference.attention(q, k, k, causal=True, return_lse=True)
    # query i sees key j iff j <= i + 2 - 5: rows 0..2 see nothing, row 3 sees key 0, row 4 keys 0..1.
    assert np.all(out[0, :3] == 0.0)
    assert np.all(np.isneginf(lse[0, :, :3]))
    np.testing.assert_allclose(out[0, 3], k[0, 0])  # one visible key: out = v
    assert np.all(np.isfinite(lse[0, :, 3:]))


def test_gqa_uses_head_over_group(rng):
    q = rng.standard_normal((1, 3, 4, 8))
    k = rng.standard_normal((1, 5, 2, 8))
    v = rng.standard_normal((1, 5, 2, 8))
    out = reference.attention(q, k, v)
    for h in range(4):
        single = reference.attention(q[:, :, h:h + 1], k[:, :, h // 2:h // 2 + 1], v[:, :, h // 2:h // 2 + 1])
        np.testing.assert_allclose(out[:, :, h:h + 1], single, rtol=1e-13)


def test_default_scale_is_inverse_sqrt_head_dim(rng):
    q, k, v = (rng.standard_normal((1, 4, 1, 16)) for _ in range(3))
    np.testing.assert_allclose(reference.attention(q, k, v), reference.attention(q, k, v, softmax_scale=0.25))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16])
def test_low_precision_inputs_are_cast_to_float64(rng, dtype):
    q, k, v = (rng.standard_normal((1, 3, 2, 8)).astype(dtype) for _ in range(3))
    out = reference.attention(q, k, v)
    assert out.dtype == np.float64
    want, _ = naive_attention(*(t.astype(np.float64) for t in (q, k, v)))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        reference.attention(np.zeros((1, 2, 3)), np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 3, 4)))
    with pytest.raises(ValueError):
        reference.attention(np.zeros((1, 2, 6, 4)), np.zeros((1, 2, 4, 4)), np.zeros((1, 2, 4, 4)))


def test_torch_inputs_if_available(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 3, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    out = reference.attention(q, k, v, causal=True)
    want, _ = naive_attention(*(t.float().numpy() for t in (q, k, v)), causal=True)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,eps", [("float16", 2**-10), ("bfloat16", 2**-7), ("float32", 2**-23)])
def test_round_to_dtype_error_is_half_ulp(rng, dtype, eps):
    x = rng.standard_normal(10000)
    err = np.abs(reference.round_to_dtype(x, dtype) - x)
    assert 0 < err.max() <= eps / 2 * np.abs(x).max() * (1 + 1e-9)


def test_output_tolerance_accepts_correct_rounding_and_rejects_a_one_percent_error(rng):
    q, k, v = (rng.standard_normal((1, 64, 4, 32)).astype(np.float16) for _ in range(3))
    ref = reference.attention(q, k, v)
    tol = reference.output_tolerance(ref, "float16", float(np.abs(v.astype(np.float64)).max()),
                                     reference.max_abs_logit(q, k))
    rounded = reference.round_to_dtype(ref, "float16")
    assert np.abs(rounded - ref).max() <= tol
    # An error of 1% of the output's scale must fail.
    assert tol < 0.01 * np.abs(ref).max()


def test_max_abs_logit_bounds_the_logits(rng):
    q, k = rng.standard_normal((2, 7, 3, 16)), rng.standard_normal((2, 9, 3, 16))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    assert np.abs(logits).max() <= reference.max_abs_logit(q, k)


def test_compare_lse():
    ref = np.array([[[-np.inf, 1.0, 100.0]]])
    assert reference.compare_lse(ref.astype(np.float32), ref)[1]
    assert reference.compare_lse(ref + np.array([0, 5e-5, 5e-3]), ref)[1]
    assert not reference.compare_lse(ref + np.array([0, 5e-4, 0]), ref)[1]
    assert not reference.compare_lse(np.array([[[0.0, 1.0, 100.0]]]), ref)[1]  # -inf row must be -inf
    assert not reference.compare_lse(np.array([[[-np.inf, np.nan, 100.0]]]), ref)[1]
    assert not reference.compare_lse(ref[..., :2], ref)[1]


def test_nan_in_a_seen_key_makes_the_row_nan_and_an_unseen_one_does_not():
    """A NaN score propagates to O and LSE (the kernels do so): the reference took a NaN row max for "sees no key" and
    answered O = 0, LSE = -inf, so a server hiding NaN would have matched it. A NaN key the causal mask hides changes
    nothing."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 4, 2, 8)) for _ in range(3))
    k[0, 2, 0, 3] = np.nan  # key 2 of head 0
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert np.isnan(lse[0, 0, 2:]).all() and np.isnan(out[0, 2:, 0]).all()  # rows 2, 3 see key 2
    assert np.isfinite(lse[0, 0, :2]).all() and np.isfinite(out[0, :2, 0]).all()  # rows 0, 1 do not
    assert np.isfinite(lse[0, 1]).all() and np.isfinite(out[0, :, 1]).all()  # the other head
