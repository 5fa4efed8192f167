"""Answers of the real server (CPU backend) against the fp64 reference, through the sync and async clients."""

import asyncio
import threading

import numpy as np
import pytest

import flashserve

pytestmark = pytest.mark.e2e

DTYPES = ["float32", "float16", "bfloat16"]

# batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, softmax_scale, return_lse
PROBLEMS = [
    pytest.param(1, 1, 1, 1, 1, 64, False, None, True, id="single"),
    pytest.param(2, 17, 17, 8, 2, 64, False, None, True, id="gqa8:2"),
    pytest.param(1, 97, 300, 6, 1, 128, True, None, True, id="mqa6:1-causal-sq<sk"),
    pytest.param(1, 300, 97, 4, 4, 40, True, None, True, id="causal-sq>sk-d40"),
    pytest.param(2, 64, 64, 4, 2, 128, True, 0.3, False, id="causal-scale0.3"),
    pytest.param(1, 33, 129, 2, 2, 32, False, 1.7, True, id="scale1.7-d32"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads_q,heads_kv,head_dim,causal,scale,return_lse", PROBLEMS)
def test_sync_client_matches_reference(client, rng, make_qkv, check_answer, dtype, batch, seqlen_q, seqlen_k,
                                       heads_q, heads_kv, head_dim, causal, scale, return_lse):
    q, k, v = make_qkv(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype)
    scale = None if scale is None else float(np.float32(scale))
    answer = client.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=return_lse)
    out, lse = answer if return_lse else (answer, None)
    check_answer(out, lse, q, k, v, causal=causal, softmax_scale=scale)
    if causal and seqlen_q > seqlen_k:  # rows that see no key: exactly 0 and -inf
        masked = seqlen_q - seqlen_k
        assert np.all(out[:, :masked].astype(np.float32) == 0)
        if lse is not None:
            assert np.all(np.isneginf(lse[:, :, :masked]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_async_client_matches_reference(server, rng, make_qkv, check_answer, dtype):
    problems = [(1, 17, 97, 8, 2, 64, True), (2, 5, 5, 3, 3, 128, False), (1, 129, 31, 6, 1, 64, True)]
    inputs = [make_qkv(rng, b, sq, sk, hq, hkv, d, dtype) for (b, sq, sk, hq, hkv, d, _) in problems]

    async def main():
        async with flashserve.AsyncClient(server.address, timeout=60) as c:
            return await asyncio.gather(*(
                c.attention(q, k, v, causal=p[-1], return_lse=True) for p, (q, k, v) in zip(problems, inputs)))

    for p, (q, k, v), (out, lse) in zip(problems, inputs, asyncio.run(main())):
        check_answer(out, lse, q, k, v, causal=p[-1])


def test_metadata(client, rng, make_qkv):
    q, k, v = make_qkv(rng, 1, 64, 64, 4, 4, 64, "float16")
    result = client.attention_with_metadata(q, k, v, request_id="e2e-meta-1")
    assert result.request_id == "e2e-meta-1"
    assert result.kernel, "server returned an empty kernel name"
    t = result.timing
    assert min(t.queue_us, t.h2d_us, t.compute_us, t.d2h_us, t.total_us) >= 0
    assert t.h2d_us == 0 and t.d2h_us == 0  # CPU backend
    assert t.total_us >= t.compute_us and t.total_us >= t.queue_us
    assert result.lse is None


def test_sixteen_concurrent_clients(server, check_answer, make_qkv, concurrently):
    barrier = threading.Barrier(16)

    def worker(i):
        rng = np.random.default_rng(1000 + i)
        dtype = DTYPES[i % 3]
        causal = bool(i % 2)
        q, k, v = make_qkv(rng, 1, 16 + 7 * i, 48 + 5 * i, 4, 2 if i % 4 else 1, 64, dtype)
        with flashserve.Client(server.address, timeout=120) as c:
            barrier.wait(timeout=30)
            for _ in range(3):
                out, lse = c.attention(q, k, v, causal=causal, return_lse=True, request_id=f"thread-{i}")
                check_answer(out, lse, q, k, v, causal=causal)

    concurrently(worker, 16)


def test_one_client_shared_by_threads(client, rng, make_qkv, check_answer):
    q, k, v = make_qkv(rng, 1, 40, 40, 2, 2, 64, "float32")
    results = [None] * 8

    def call(i):
        results[i] = client.attention(q, k, v, causal=True)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for out in results:
        check_answer(out, None, q, k, v, causal=True)


def test_torch_if_available(client):
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 17, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 33, 2, 64, dtype=torch.bfloat16)
    out = client.attention(q, k, k, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
