"""End to end on the CUDA backend: the real server binary with --backend=cuda, driven by the Python client and
checked against the fp64 reference. Skips with a message on machines without a usable NVIDIA GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent import futures

import grpc
import ml_dtypes
import numpy as np
import pytest

import flashserve
from flashserve import reference, tensors

from conftest import ServerProcess, _stop_and_check

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    return subprocess.run([smi, "-L"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module")
def cuda_server(flashserve_bin, tmp_path_factory):
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA end-to-end tests skipped")
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("cuda_server"), ["--backend=cuda"],
                      name="cuda_server").start()
    yield s
    _stop_and_check(s)


def _problem(rng, dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, scale=1.0):
    np_dtype = DTYPES[dtype]
    q = (rng.standard_normal((batch, seqlen_q, heads_q, head_dim)) * scale).astype(np_dtype)
    k = (rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)) * scale).astype(np_dtype)
    v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim)).astype(np_dtype)
    return q, k, v


def _check(client, q, k, v, dtype, causal):
    result = client.attention_with_metadata(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    out = np.asarray(result.out, dtype=np.float64)
    assert np.isfinite(out).all(), "NaN/Inf in the output"
    tol = reference.output_tolerance(ref, dtype, float(np.abs(v.astype(np.float64)).max()),
                                     reference.max_abs_logit(q, k))
    err = float(np.abs(out - ref).max())
    assert err <= tol, f"max abs err {err:.3g} > tol {tol:.3g}"
    lse_err, lse_ok = reference.compare_lse(result.lse, ref_lse)
    assert lse_ok, f"LSE error {lse_err}"
    return result


def test_server_info_reports_the_gpu(cuda_server):
    with flashserve.Client(cuda_server.address) as c:
        info = c.server_info()
    assert info.backend == "cuda"
    assert len(info.devices) >= 1 and info.devices[0].compute_capability[0] >= 8
    assert set(info.head_dims) >= {64, 128}


# Odd sizes, GQA and causal with Sq != Sk, through the whole service.
SHAPES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal
    (1, 1, 1, 1, 1, 64, False),
    (2, 17, 17, 3, 3, 128, True),
    (1, 127, 1000, 8, 2, 64, True),    # Sq < Sk causal, GQA 4:1
    (1, 1025, 97, 6, 1, 128, True),    # Sq > Sk causal (rows with no key), MQA
    (5, 65, 4099, 4, 4, 128, False),
    (1, 4099, 4099, 2, 1, 64, True),
]


# Head dims 32, 96 and 256 (compiled by default since issue 19): odd sizes, GQA, causal Sq != Sk.
NEW_DIM_SHAPES = [
    (3, 33, 70, 4, 2, 32, True),
    (1, 200, 301, 3, 1, 96, False),
    (2, 129, 257, 2, 2, 256, True),
    (1, 700, 90, 4, 4, 256, False),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", NEW_DIM_SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}:{}_d{}_{}".format(*s[:6], "causal" if s[6] else "full"))
def test_new_head_dims_match_reference(cuda_server, rng, dtype, shape):
    batch, sq, sk, hq, hkv, d, causal = shape
    with flashserve.Client(cuda_server.address) as c:
        served = set(c.server_info().head_dims)
    if d not in served:
        pytest.skip(f"head_dim {d} not built into this server (FLASHSERVE_KERNEL_HEAD_DIMS): serves {sorted(served)}")
    q, k, v = _problem(rng, dtype, batch, sq, sk, hq, hkv, d)
    with flashserve.Client(cuda_server.address, timeout=120) as c:
        result = _check(c, q, k, v, dtype, causal)
    assert f"_d{d}" in result.kernel, result.kernel


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}:{}_d{}_{}".format(*s[:6], "causal" if s[6] else "full"))
def test_matches_reference(cuda_server, rng, dtype, shape):
    batch, sq, sk, hq, hkv, d, causal = shape
    q, k, v = _problem(rng, dtype, batch, sq, sk, hq, hkv, d)
    with flashserve.Client(cuda_server.address, timeout=120) as c:
        result = _check(c, q, k, v, dtype, causal)
    assert result.kernel.startswith(("sm80_fwd_", "sm90_fwd_")), result.kernel
    assert result.timing.compute_us > 0 and result.timing.h2d_us > 0


def test_large_logits_stay_finite(cuda_server, rng):
    q, k, v = _problem(rng, "bfloat16", 1, 300, 300, 4, 4, 128, scale=3.0)
    with flashserve.Client(cuda_server.address, timeout=60) as c:
        _check(c, q, k, v, "bfloat16", True)


def test_fp32_is_refused_with_a_clear_message(cuda_server, rng):
    q = rng.standard_normal((1, 4, 2, 64)).astype(np.float32)
    with flashserve.Client(cuda_server.address) as c:
        with pytest.raises(flashserve.InvalidArgumentError, match="FLOAT32 is not supported by the cuda backend"):
            c.attention(q, q, q)


def test_32_concurrent_clients_mixed_shapes(cuda_server, rng):
    seeds = rng.integers(0, 2**31, size=32)

    def one(i):
        r = np.random.default_rng(int(seeds[i]))
        dtype = ["float16", "bfloat16"][i % 2]
        d = [64, 128][(i // 2) % 2]
        sq, sk = int(r.integers(1, 600)), int(r.integers(1, 600))
        q, k, v = _problem(r, dtype, 1, sq, sk, 4, 2, d)
        with flashserve.Client(cuda_server.address, timeout=120) as c:
            _check(c, q, k, v, dtype, bool(i % 3 == 0))
        return i

    with futures.ThreadPoolExecutor(32) as pool:
        assert sorted(pool.map(one, range(32))) == list(range(32))


def test_check_cli_passes(cuda_server):
    proc = subprocess.run([sys.executable, "-m", "flashserve", "check", "--address", cuda_server.address, "--quick"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_background_autotune_then_cache_reused(flashserve_bin, tmp_path, rng):
    """--autotune=background serves at once with the default, tunes off the request path, then uses the winner;
    a restarted server with the cache uses it from the first request."""
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA end-to-end tests skipped")
    cache = tmp_path / "tune.json"
    q, k, v = _problem(rng, "bfloat16", 2, 1000, 1000, 8, 8, 128)
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--autotune=background", f"--tune_cache={cache}"],
                      name="autotune").start()
    try:
        with flashserve.Client(s.address, timeout=120) as c:
            start = time.monotonic()
            first = _check(c, q, k, v, "bfloat16", True)
            assert time.monotonic() - start < 30, "the first request waited for tuning"
            key = None
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                if cache.exists():
                    entries = json.loads(cache.read_text())["entries"]
                    key = next((k_ for k_ in entries if "|bf16|d128|causal|gqa1|q1024|k1024" in k_), None)
                    if key:
                        break
                time.sleep(0.5)
            assert key, f"class never tuned\n{s.logs()}"
            winner = entries[key]["config"]
            later = _check(c, q, k, v, "bfloat16", True)
            assert later.kernel.endswith(winner), (later.kernel, winner)
            assert first.kernel.startswith(("sm80_fwd_", "sm90_fwd_"))
    finally:
        _stop_and_check(s)
    s2 = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--autotune=off", f"--tune_cache={cache}"],
                       name="autotune_reuse").start()
    try:
        with flashserve.Client(s2.address, timeout=120) as c:
            again = _check(c, q, k, v, "bfloat16", True)
            assert again.kernel.endswith(winner), (again.kernel, winner)
    finally:
        _stop_and_check(s2)


def test_startup_autotune_tunes_before_ready(flashserve_bin, tmp_path, rng):
    """--autotune=startup: the configured grid is in the cache by the time the server reports ready."""
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA end-to-end tests skipped")
    cache = tmp_path / "startup.json"
    s = ServerProcess(flashserve_bin, tmp_path, [
        "--backend=cuda", "--autotune=startup", f"--tune_cache={cache}", "--tune_dtypes=fp16",
        "--tune_head_dims=64", "--tune_causal=both", "--tune_seqlens=256,2048"], name="startup").start()
    try:
        entries = json.loads(cache.read_text())["entries"]
        assert len(entries) == 4, entries.keys()
        assert all("|fp16|d64|" in key for key in entries)
        q, k, v = _problem(rng, "float16", 1, 2000, 2000, 4, 4, 64)
        with flashserve.Client(s.address, timeout=120) as c:
            result = _check(c, q, k, v, "float16", False)
        tuned = [e["config"] for key, e in entries.items() if key.endswith("|full|gqa1|q2048|k2048")]
        assert tuned and result.kernel.endswith(tuned[0]), (result.kernel, tuned)
    finally:
        _stop_and_check(s)


def test_a_cache_from_another_sm_count_is_ignored(flashserve_bin, tmp_path):
    """The cache records the GPU's SM count; a MIG slice keeps its GPU's name and compute capability, so a cache tuned
    on the whole GPU (split-KV plans, grids timed for its SMs) must not be used there: the server warns and tunes
    afresh, and its next save records its own count."""
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA end-to-end tests skipped")
    cache = tmp_path / "sm.json"
    grid = ["--tune_dtypes=fp16", "--tune_head_dims=64", "--tune_causal=false", "--tune_seqlens=256"]
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--autotune=startup", f"--tune_cache={cache}",
                                                 *grid], name="sm_count").start()
    _stop_and_check(s)
    saved = json.loads(cache.read_text())
    sms = saved["device"]["sm_count"]
    assert isinstance(sms, int) and sms > 0, saved["device"]
    assert len(saved["entries"]) == 1, saved["entries"].keys()
    saved["device"]["sm_count"] = sms + 1  # what the same GPU name with other SMs would have written
    cache.write_text(json.dumps(saved))
    s2 = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--autotune=startup", f"--tune_cache={cache}",
                                                  *grid], name="sm_count_other").start()
    _stop_and_check(s2)
    logs = s2.logs(limit=1 << 20)
    assert f"{sms + 1} SMs != this device's {sms}" in logs, logs[-3000:]
    assert json.loads(cache.read_text())["device"]["sm_count"] == sms  # retuned and saved as its own


def test_a_signal_during_startup_tuning_stops_it(flashserve_bin, tmp_path):
    """SIGTERM while --autotune=startup tunes its grid: the server stops tuning within a second or so and exits 0. The
    signals were only taken once serving began, so the whole grid (minutes) ran first, past a startupProbe's patience
    (the kubelet then killed it mid-tune). The startup's signal watch (config/serve_loop.h) takes the signal: the
    tuning stops after the class in progress, or, if that takes over 0.5 s, the process exits 0 at once."""
    import signal

    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA end-to-end tests skipped")
    log = tmp_path / "startup_signal.log"
    args = [str(flashserve_bin), "--backend=cuda", "--autotune=startup", f"--tune_cache={tmp_path}/grid.json",
            "--tune_dtypes=fp16,bf16", "--tune_head_dims=32,64,96,128,256", "--tune_causal=both",
            "--tune_seqlens=128,256,512,1024,2048,4096,8192,16384,32768", "--grpc_port=0", "--http_port=0",
            "--metrics_port=0"]  # 180 classes: longer than a few seconds on any GPU
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while b"before reporting ready" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # while it tunes
        sent = time.monotonic()
        code = proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "startup tuning done" not in text, "the grid was tuned before the signal: make it bigger"
    assert code == 0, (code, text[-3000:])
    assert "SIGTERM received during startup" in text, text[-3000:]
    unwound = "stopped before serving" in text and "startup tuning stopped" in text
    assert unwound or "startup still running" in text, text[-3000:]
    assert took < 5, f"exited {took:.1f} s after SIGTERM"


def test_device_memory_pool_metrics(cuda_server, rng):
    import urllib.request

    q, k, v = _problem(rng, "bfloat16", 1, 512, 512, 4, 4, 128)
    with flashserve.Client(cuda_server.address, timeout=60) as c:
        c.attention(q, k, v)
    text = urllib.request.urlopen(f"http://127.0.0.1:{cuda_server.metrics_port}/metrics", timeout=5).read().decode()
    reserved = [line for line in text.splitlines()
                if line.startswith("flashserve_device_memory_pool_bytes{") and 'state="reserved"' in line]
    assert reserved and float(reserved[0].rsplit(" ", 1)[1]) > 0, reserved


# --- issue 9: the GPU serving runtime --------------------------------------------------------------------------------


def _gpu_count() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    return sum(1 for line in proc.stdout.splitlines() if line.startswith("GPU ")) if proc.returncode == 0 else 0


def _require_gpu():
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA end-to-end tests skipped")


def _metric_values(server, name: str) -> dict:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def _big_request(rng, seqlen=8192, batch=2, heads=16):
    """About 3 x 64 MiB of bf16 tensors: long enough on the wire and on the GPU to be interrupted."""
    from flashserve.client import _Prepared

    q, k, v = _problem(rng, "bfloat16", batch, seqlen, seqlen, heads, heads, 128)
    return _Prepared(q, k, v, False, None, False, "big").request


def _healthy_and_correct(server, rng):
    with flashserve.Client(server.address, timeout=120) as c:
        assert c.health_status() == "SERVING"
        assert c.health_status("flashserve.v1.AttentionService") == "SERVING"
        q, k, v = _problem(rng, "bfloat16", 2, 333, 517, 8, 2, 128)
        _check(c, q, k, v, "bfloat16", True)


def test_pinned_pool_metrics(cuda_server, rng):
    q, k, v = _problem(rng, "bfloat16", 1, 512, 512, 4, 4, 128)
    with flashserve.Client(cuda_server.address, timeout=60) as c:
        c.attention(q, k, v)
    values = _metric_values(cuda_server, "flashserve_pinned_memory_pool_bytes")
    reserved = [v for k_, v in values.items() if 'state="reserved"' in k_]
    # At least O's buffer (q's size); the inputs come from the receive arena, not from this pool.
    assert reserved and reserved[0] >= q.nbytes, values


def _input_paths(server):
    values = _metric_values(server, "flashserve_request_inputs_total")
    return {path: sum(v for k_, v in values.items() if f'path="{path}"' in k_) for path in ("in_place", "copied")}


def test_inputs_are_read_in_place_from_the_receive_arena(cuda_server, rng):
    """By default (a 1 GiB receive arena) the tensors go to the GPU from the read buffers they arrived in."""
    before = _input_paths(cuda_server)
    with flashserve.Client(cuda_server.address, timeout=120) as c:
        for _ in range(6):  # 12 MiB each, ~190 read buffers of 64 KiB
            q, k, v = _problem(rng, "bfloat16", 1, 2048, 2048, 8, 8, 128)
            _check(c, q, k, v, "bfloat16", True)
    after = _input_paths(cuda_server)
    in_place = after["in_place"] - before["in_place"]
    copied = after["copied"] - before["copied"]
    assert in_place + copied == 6
    # A connection's first reads may be small heap buffers (gRPC sizes reads by what it expects), so a
    # request can be copied now and then; most must not be.
    assert in_place >= 4, (in_place, copied)


def test_client_deadline_mid_flight_leaves_server_healthy(cuda_server, rng):
    request = _big_request(rng)
    with flashserve.Client(cuda_server.address) as c:
        for timeout in (0.05, 0.15, 0.3):  # 192 MiB cannot even be uploaded in 0.3 s (~0.5 GB/s per channel)
            with pytest.raises(grpc.RpcError) as info:
                c.stub.Attention(request, timeout=timeout)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Calibrated: a deadline just short of the whole call usually expires while the server has the job on
        # the GPU or is sending the answer. Either outcome is fine; the server must stay healthy.
        start = time.monotonic()
        c.stub.Attention(request, timeout=120)
        elapsed = time.monotonic() - start
        for fraction in (0.6, 0.8, 0.95):
            try:
                c.stub.Attention(request, timeout=elapsed * fraction)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
    _healthy_and_correct(cuda_server, rng)


def test_client_cancellation_mid_flight_leaves_server_healthy(cuda_server, rng):
    request = _big_request(rng)
    with flashserve.Client(cuda_server.address) as c:
        calls = [c.stub.Attention.future(request, timeout=120) for _ in range(6)]
        time.sleep(0.3)
        for call in calls:
            call.cancel()
        for call in calls:
            # Cancelled (most), or finished before the cancel arrived: never another error.
            if not call.cancelled():
                assert call.exception() is None, call.exception()
    _healthy_and_correct(cuda_server, rng)


def test_concurrent_cancellations_and_normal_requests(cuda_server, rng):
    """Cancelled big requests and normal ones interleaved on one server: every normal one is correct."""
    big = _big_request(rng, seqlen=4096)
    seeds = rng.integers(0, 2**31, size=12)

    def normal(i):
        r = np.random.default_rng(int(seeds[i]))
        q, k, v = _problem(r, "float16", 1, int(r.integers(1, 900)), int(r.integers(1, 900)), 6, 3, 128)
        with flashserve.Client(cuda_server.address, timeout=120) as c:
            _check(c, q, k, v, "float16", bool(i % 2))

    with flashserve.Client(cuda_server.address) as c, futures.ThreadPoolExecutor(12) as pool:
        calls = [c.stub.Attention.future(big, timeout=120) for _ in range(4)]
        done = [pool.submit(normal, i) for i in range(12)]
        time.sleep(0.1)
        for call in calls:
            call.cancel()
        for f in done:
            f.result()
    _healthy_and_correct(cuda_server, rng)


def test_oversized_request_then_normal_ones(flashserve_bin, tmp_path, rng):
    """A request over the device-memory budget gets RESOURCE_EXHAUSTED before any allocation; the next ones succeed."""
    _require_gpu()
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", f"--max_device_bytes_per_request={64 << 20}"],
                      name="oversized").start()
    try:
        with flashserve.Client(s.address, timeout=120) as c:
            q, k, v = _problem(rng, "bfloat16", 1, 8192, 8192, 16, 16, 128)  # 4 x 32 MiB on the device
            with pytest.raises(flashserve.ResourceExhaustedError, match="max_device_bytes_per_request"):
                c.attention(q, k, v)
            for _ in range(3):
                q, k, v = _problem(rng, "bfloat16", 1, 1000, 1200, 8, 4, 128)
                _check(c, q, k, v, "bfloat16", True)
            assert c.health_status() == "SERVING"
    finally:
        _stop_and_check(s)


@pytest.mark.parametrize("flags", [
    ["--pinned_pool_bytes=0", "--receive_arena_bytes=0"],
    [f"--pinned_pool_bytes={1 << 20}", "--receive_arena_bytes=0"],
    ["--receive_arena_bytes=0"],
    ["--receive_arena_bytes=300000"],
    ["--pinned_pool_bytes=0"],
], ids=["pageable", "pinned_pool_too_small", "staged", "arena_too_small", "in_place_pageable_out"])
def test_every_input_path_is_correct(flashserve_bin, tmp_path, rng, flags):
    """Whichever way the tensors travel -- copied into pinned staging, copied by the driver from pageable memory
    (no pool, or one too small), read in place from the receive arena with O going to pageable memory, or
    mostly copied because the arena is too small -- the answers are right."""
    _require_gpu()
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", *flags], name="paths").start()
    try:
        with flashserve.Client(s.address, timeout=120) as c:
            for shape in [(1, 17, 33, 3, 1, 128), (2, 700, 900, 8, 8, 128)] * 2:  # under and over 1 MiB
                q, k, v = _problem(rng, "bfloat16", *shape)
                _check(c, q, k, v, "bfloat16", False)
        paths = _input_paths(s)
        assert paths["in_place"] + paths["copied"] == 4
        if "--receive_arena_bytes=0" in flags:
            assert paths["in_place"] == 0, paths
    finally:
        _stop_and_check(s)


@pytest.mark.parametrize("shape", [
    (2, 1000, 1000, 12, 6, 128, False),  # GQA 2, 6 KV heads in 4 uneven chunks (1, 2, 1, 2)
    (1, 3000, 3000, 5, 5, 128, True),    # MHA, odd head count
    (3, 1400, 1400, 16, 2, 64, True),    # 2 KV heads: 2 chunks of 8 query heads
], ids=["gqa_uneven", "mha_odd_causal", "two_kv_heads_b3"])
def test_pipelined_copies_match_reference(flashserve_bin, tmp_path, rng, shape):
    """By default (--copy_pipeline_chunks=4) a staged request of >= 8 MiB is cut into head chunks whose copies overlap
    the other chunks' kernels; O and the LSE (written per chunk, then copied into its heads' rows) match the fp64
    reference, and the kernel name says how many chunks ran."""
    _require_gpu()
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--receive_arena_bytes=0"],
                      name="pipelined").start()
    try:
        with flashserve.Client(s.address, timeout=120) as c:
            for _ in range(2):  # the second on the slot's existing pipeline
                q, k, v = _problem(rng, "bfloat16", *shape[:6])
                result = _check(c, q, k, v, "bfloat16", shape[6])
                assert result.kernel.endswith(f"_chunks{min(4, shape[4])}"), result.kernel
            q, k, v = _problem(rng, "bfloat16", 1, 17, 33, 3, 1, 128)  # small: not pipelined
            assert "_chunks" not in _check(c, q, k, v, "bfloat16", False).kernel
    finally:
        _stop_and_check(s)


def test_pipelined_only_when_alone_on_the_gpu(flashserve_bin, tmp_path, rng):
    """A large request is cut into chunks only when no other job is on its GPU (with others in flight the copy
    engines are busy anyway, and the chunks' narrower copies cost throughput). Sixteen clients each write one 12 MiB
    request into a system region once and send it back to back (no client-side work between calls, so the GPU has
    several jobs in flight): some run uncut, and every client's last O and LSE match the fp64 reference. One request
    sent alone afterwards is cut."""
    _require_gpu()
    from flashserve import attention_pb2 as apb
    from flashserve import attention_pb2_grpc
    from flashserve.shm import SystemRegion

    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--allow_client_shm"], name="alone").start()
    q, k, v = _problem(rng, "bfloat16", 1, 1024, 1024, 16, 16, 128)
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    tol = reference.output_tolerance(ref, "bfloat16", float(np.abs(v.astype(np.float64)).max()),
                                     reference.max_abs_logit(q, k))

    def calls(i, n):
        """n calls of one request placed in a region once; the kernel names, and the last O and LSE checked."""
        with flashserve.Client(s.address, timeout=120) as c, \
                SystemRegion(c, f"alone-{i}", SystemRegion.bytes_for(q, k, v)) as region, \
                grpc.insecure_channel(s.address) as channel:
            request = apb.AttentionRequest(q=tensors.to_proto(q, "q"), k=tensors.to_proto(k, "k"),
                                           v=tensors.to_proto(v, "v"), causal=True, return_lse=True)
            (_, out_at, out_bytes), (_, lse_at, lse_bytes) = region.place(request, return_lse=True)
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            kernels = [stub.Attention(request, timeout=120).kernel for _ in range(n)]
            out = np.frombuffer(region.read(out_at, out_bytes), ml_dtypes.bfloat16).astype(np.float64)
            assert np.isfinite(out).all() and float(np.abs(out.reshape(ref.shape) - ref).max()) <= tol
            lse = np.frombuffer(region.read(lse_at, lse_bytes), np.float32).reshape(ref_lse.shape)
            assert reference.compare_lse(lse, ref_lse)[1]
        return kernels

    try:
        with futures.ThreadPoolExecutor(16) as pool:
            together = [kern for f in [pool.submit(calls, i, 20) for i in range(16)] for kern in f.result()]
        assert any("_chunks" not in kern for kern in together), together[:4]
        assert calls(16, 2)[-1].endswith("_chunks4")  # the second: the first may meet the last completions
    finally:
        _stop_and_check(s)


def test_one_stream_per_device_serves_concurrent_clients(flashserve_bin, tmp_path, rng):
    """--streams_per_device=1: jobs wait for the single slot; all 16 concurrent requests are still correct."""
    _require_gpu()
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--streams_per_device=1"], name="one_stream").start()
    seeds = rng.integers(0, 2**31, size=16)

    def one(i):
        r = np.random.default_rng(int(seeds[i]))
        q, k, v = _problem(r, "bfloat16", 1, int(r.integers(1, 1500)), int(r.integers(1, 1500)), 4, 4, 128)
        with flashserve.Client(s.address, timeout=120) as c:
            _check(c, q, k, v, "bfloat16", bool(i % 2))

    try:
        with futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(16)))
    finally:
        _stop_and_check(s)


def test_two_devices_share_the_load(flashserve_bin, tmp_path, rng):
    _require_gpu()
    n = _gpu_count()
    if n < 2:
        pytest.skip(f"this machine has {n} GPU(s): the two-device test needs two")
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--devices=0,1"], name="two_devices").start()
    seeds = rng.integers(0, 2**31, size=24)

    def one(i):
        r = np.random.default_rng(int(seeds[i]))
        q, k, v = _problem(r, "bfloat16", 2, int(r.integers(500, 3000)), int(r.integers(500, 3000)), 8, 8, 128)
        with flashserve.Client(s.address, timeout=120) as c:
            _check(c, q, k, v, "bfloat16", bool(i % 2))

    try:
        with flashserve.Client(s.address) as c:
            assert [d.index for d in c.server_info().devices] == [0, 1]
        with futures.ThreadPoolExecutor(24) as pool:
            list(pool.map(one, range(24)))
        reserved = {k_: v for k_, v in _metric_values(s, "flashserve_device_memory_pool_bytes").items()
                    if 'state="reserved"' in k_}
        assert len(reserved) == 2 and all(v > 0 for v in reserved.values()), f"one device never used: {reserved}"
    finally:
        _stop_and_check(s)


@pytest.mark.parametrize("spin", ["--completion_spin_us=0", "--completion_spin_us=200"])
def test_a_refused_cuda_call_fails_only_its_own_request(flashserve_bin, tmp_path, rng, spin):
    """A CUDA call refused while a job is queued (not sticky: through the --enable_fault_injection hook, an invalid
    copy) fails that request with INTERNAL and nothing else. It was cleared on the completion thread, not the one
    that queued it, so the next kernel launch from that thread read it back as its own error (its request failed
    with INTERNAL although the kernel ran). One stream: every job is queued from the same thread; without the
    completion spin every job completes on the stream's completion thread (with it, small jobs complete inline)."""
    _require_gpu()
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--streams_per_device=1", "--enable_fault_injection",
                                                 spin], name="launch_error").start()
    try:
        with flashserve.Client(s.address, timeout=120) as c:
            q, k, v = _problem(rng, "bfloat16", 1, 129, 333, 4, 2, 128)
            _check(c, q, k, v, "bfloat16", False)
            for round_ in range(3):
                with pytest.raises(flashserve.FlashserveError, match="invalid argument") as refused:
                    c.attention(q, k, v, request_id="flashserve-test:inject-launch-error")
                assert refused.value.code == grpc.StatusCode.INTERNAL
                for i in range(4):
                    _check(c, q, k, v, "bfloat16", bool(i % 2))
            assert c.health_status() == "SERVING"
    finally:
        _stop_and_check(s)


@pytest.mark.parametrize("devices", ["0", "0,1"])
def test_sticky_device_fault_stops_the_server(flashserve_bin, tmp_path, rng, devices):
    """A sticky CUDA error (a trap kernel, through the --enable_fault_injection test hook) fails that request with
    INTERNAL, turns gRPC health NOT_SERVING and HTTP ready 503 within ~1 s, and later requests get UNAVAILABLE at once
    instead of running on a dead context. With two devices the other one is not used either: a sticky error makes CUDA
    unusable in the whole process (every call on the other device failed too on two H200s; see
    bench/service/sticky_error_probe.cu), so it must not produce INTERNAL errors from a device that looks healthy.
    /v2/health/live answers 503 too, and after --shutdown_grace_seconds the process exits by itself with code 3 (so that
    its supervisor restarts it with a fresh CUDA context) instead of holding the GPU forever."""
    import urllib.error
    import urllib.request

    _require_gpu()
    wanted = len(devices.split(","))
    if _gpu_count() < wanted:
        pytest.skip(f"this machine has {_gpu_count()} GPU(s): the fault test with --devices={devices} needs {wanted}")
    grace_s = 6
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", f"--devices={devices}", "--enable_fault_injection",
                                                 f"--shutdown_grace_seconds={grace_s}"], name="fault").start()
    try:
        with flashserve.Client(s.address, timeout=120) as c:
            q, k, v = _problem(rng, "bfloat16", 1, 333, 517, 4, 2, 128)
            _check(c, q, k, v, "bfloat16", False)  # healthy first
            with pytest.raises(flashserve.FlashserveError, match="CUDA fault") as fault:
                c.attention(q, k, v, request_id="flashserve-test:inject-device-fault")
            assert fault.value.code == grpc.StatusCode.INTERNAL
            deadline = time.monotonic() + 10
            while c.health_status() == "SERVING" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.health_status() == "NOT_SERVING"
            with pytest.raises(urllib.error.HTTPError) as ready:
                urllib.request.urlopen(f"{s.http}/v2/health/ready", timeout=5)
            assert ready.value.code == 503
            text = urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=5).read().decode()
            assert "\nflashserve_backend_healthy 0\n" in text, "the metric an alert watches still says healthy"
            for _ in range(4):  # whichever device the load balancer would have picked
                with pytest.raises(flashserve.UnavailableError, match=r"faulted in .*\(.*\)"):
                    c.attention(q, k, v)
            with pytest.raises(urllib.error.HTTPError) as live:
                urllib.request.urlopen(f"{s.http}/v2/health/live", timeout=5)
            assert live.value.code == 503
        try:  # no signal: the process ends itself once the grace period is over
            code = s.proc.wait(timeout=grace_s + 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the faulted server still runs {grace_s + 20} s after its fault\n{s.logs()}")
        logs = s.logs(limit=20000)
        assert code == 3, f"exit code {code}, expected 3 (backend unhealthy)\n{logs}"
        # The fault is logged critical once (each refused request's message names it too, at warning).
        assert logs.count("reporting not ready, further requests get UNAVAILABLE") == 1, logs
    finally:
        s.stop()


def test_real_device_out_of_memory_then_normal_service(flashserve_bin, tmp_path, rng):
    """A real cudaMallocAsync failure, not a configured limit: another process (this test, through torch) takes all but
    ~64 MiB of the GPU, a ~600 MB request gets RESOURCE_EXHAUSTED "out of memory", the server stays ready, and once the
    memory is given back the same request is answered correctly."""
    _require_gpu()
    torch = pytest.importorskip("torch", reason="torch is needed to take the GPU's memory from another process")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--devices=0"], name="oom").start()
    hog = []
    try:
        with flashserve.Client(s.address, timeout=120) as c:
            small = _problem(rng, "bfloat16", 1, 64, 64, 2, 2, 128)
            _check(c, *small, "bfloat16", False)  # context and memory pool exist before the squeeze
            q, k, v = _problem(rng, "bfloat16", 1, 16384, 16384, 32, 8, 128)  # ~0.6 GB on the device
            free, _ = torch.cuda.mem_get_info(0)
            while free > (64 << 20):
                chunk = min(free - (48 << 20), 4 << 30)
                if chunk <= 0:
                    break
                hog.append(torch.empty(chunk, dtype=torch.uint8, device="cuda:0"))
                free, _ = torch.cuda.mem_get_info(0)
            with pytest.raises(flashserve.ResourceExhaustedError, match="out of memory"):
                c.attention(q, k, v)
            assert c.health_status() == "SERVING"
            hog.clear()
            torch.cuda.empty_cache()
            out = np.asarray(c.attention(q, k, v), dtype=np.float64)[:, :256]  # rows are independent: check a few
            ref = reference.attention(q[:, :256], k, v)
            assert np.isfinite(out).all()
            tol = reference.output_tolerance(ref, "bfloat16", float(np.abs(v.astype(np.float64)).max()),
                                             reference.max_abs_logit(q[:, :256], k))
            assert float(np.abs(out - ref).max()) <= tol
            _check(c, *small, "bfloat16", False)
    finally:
        hog.clear()
        _stop_and_check(s)


def test_tune_cache_that_becomes_unwritable_or_corrupt_at_runtime(flashserve_bin, tmp_path, rng):
    """--autotune=background with a cache whose directory is replaced by a plain file after startup (so no save can
    succeed, even as root): tuning results cannot be written, the server warns and keeps serving correct answers;
    a cache file corrupted while a server runs is ignored (with a warning) by the next one."""
    _require_gpu()
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    cache = cache_dir / "tune.json"
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--autotune=background", f"--tune_cache={cache}"],
                      name="unwritable_cache").start()
    try:
        shutil.rmtree(cache_dir)
        cache_dir.write_text("not a directory")  # every save into cache_dir/ now fails (ENOTDIR)
        with flashserve.Client(s.address, timeout=120) as c:
            for seqlen in (700, 1500, 3000):  # new classes: each queues a background tuning and a save
                _check(c, *_problem(rng, "bfloat16", 1, seqlen, seqlen, 8, 8, 128), "bfloat16", False)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and "cannot save the cache" not in s.logs(limit=50000):
                time.sleep(0.5)
            assert "autotune: cannot save the cache" in s.logs(limit=50000), s.logs()
            for seqlen in (700, 1500, 3000):  # still serving, now with the tuned kernels kept in memory
                _check(c, *_problem(rng, "bfloat16", 1, seqlen, seqlen, 8, 8, 128), "bfloat16", False)
            assert c.health_status() == "SERVING"
    finally:
        _stop_and_check(s)
    # Corrupted while no server could fix it: the next server ignores it and serves.
    cache_dir.unlink()
    cache_dir.mkdir()
    cache.write_text('{"version": 1, "device": {"name": "')  # truncated JSON
    s2 = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--autotune=off", f"--tune_cache={cache}"],
                       name="corrupt_cache").start()
    try:
        with flashserve.Client(s2.address, timeout=120) as c:
            _check(c, *_problem(rng, "bfloat16", 1, 500, 600, 8, 8, 128), "bfloat16", True)
        assert "ignoring the tuning cache" in s2.logs(limit=20000)
    finally:
        _stop_and_check(s2)
