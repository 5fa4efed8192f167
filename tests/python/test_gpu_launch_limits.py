"""The CUDA backend's grid limits reach validation (skipped without a GPU): a batch or heads_q past 65535 (a grid
dimension of the kernels) is INVALID_ARGUMENT naming the limit, before any device memory is allocated; 65535 runs.
validation_test sets the limit by hand; this is the wiring from the backend's capabilities in server.cc."""
from __future__ import annotations

import numpy as np
import pytest

import flashserve
from conftest import ServerProcess, _stop_and_check
from test_gpu_e2e import _gpu_present


@pytest.fixture(scope="module")
def server(flashserve_bin, tmp_path_factory):
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA end-to-end tests skipped")
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("limits"), ["--backend=cuda"], name="limits").start()
    yield s
    _stop_and_check(s)


@pytest.mark.parametrize("what,q_shape,kv_shape", [
    ("batch", (65536, 1, 1, 32), (65536, 1, 1, 32)),
    ("heads_q", (1, 1, 65536, 32), (1, 1, 1, 32)),
])
def test_past_the_grid_limit_is_invalid_argument(server, what, q_shape, kv_shape):
    q, kv = np.zeros(q_shape, np.float16), np.zeros(kv_shape, np.float16)
    with flashserve.Client(server.address, timeout=60) as c:
        with pytest.raises(flashserve.FlashserveError) as e:
            c.attention(q, kv, kv)
    assert e.value.code.name == "INVALID_ARGUMENT", e.value
    assert "65535" in str(e.value) and what.split("_")[0] in str(e.value), e.value


def test_at_the_grid_limit_runs(server):
    rng = np.random.default_rng()
    q = rng.standard_normal((65535, 1, 1, 32)).astype(np.float16)
    k = rng.standard_normal((65535, 3, 1, 32)).astype(np.float16)
    v = rng.standard_normal((65535, 3, 1, 32)).astype(np.float16)
    with flashserve.Client(server.address, timeout=60) as c:
        out = np.asarray(c.attention(q, k, v), np.float64)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(32)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() < 2e-2
