"""The background tuner's bounds on the real CUDA tuner (skipped without a GPU).

--tune_max_classes caps the classes a server tunes and stores (clients choose the shapes that make classes), and a
malformed entry in the cache file costs that entry alone, not the file's other classes."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

import flashserve
from conftest import ServerProcess, _stop_and_check
from metrics_helpers import scrape
from test_gpu_e2e import _check, _gpu_present, _problem

# Three attention classes (their lengths fall in three buckets); the cap lets two be tuned.
SEQLENS = (200, 600, 1500)


def _entries(cache) -> dict:
    return json.loads(cache.read_text())["entries"] if cache.exists() else {}


def _wait_for(predicate, what: str, server, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    pytest.fail(f"{what}\n{server.logs()}")


def test_tuner_holds_at_most_max_classes_and_skips_malformed_entries(flashserve_bin, tmp_path):
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA end-to-end tests skipped")
    rng = np.random.default_rng()
    cache = tmp_path / "tune.json"
    problems = [_problem(rng, "float16", 1, n, n, 4, 4, 64) for n in SEQLENS]
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--autotune=background", f"--tune_cache={cache}",
                                                 "--tune_max_classes=2"], name="capped").start()
    try:
        metrics = f"http://127.0.0.1:{s.metrics_port}/metrics"
        with flashserve.Client(s.address, timeout=120) as c:
            for q, k, v in problems[:2]:
                _check(c, q, k, v, "float16", False)
            _wait_for(lambda: len(_entries(cache)) == 2, "the first two classes were never tuned", s)
            for _ in range(3):  # a class past the cap: served (by the default), never queued
                _check(c, *problems[2], "float16", False)
            time.sleep(2)
            assert len(_entries(cache)) == 2, _entries(cache)
            m = scrape(metrics)
            assert m.value("flashserve_autotune_total", result="tuned") == 2
            assert m.value("flashserve_autotune_total", result="skipped") >= 3
        assert "reach --tune_max_classes" in s.logs(limit=50000)
    finally:
        _stop_and_check(s)

    text = json.loads(cache.read_text())
    broken = next(key for key in text["entries"] if "|q256|k256" in key)  # SEQLENS[0]'s class
    kept = next(key for key in text["entries"] if "|q1024|k1024" in key)  # SEQLENS[1]'s
    winner = text["entries"][kept]["config"]
    text["entries"][broken]["tflops"] = "fast"  # a hand edit of the wrong type
    cache.write_text(json.dumps(text))
    s2 = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--autotune=off", f"--tune_cache={cache}"],
                       name="malformed").start()
    try:
        logs = s2.logs(limit=50000)
        assert "1 malformed entries skipped" in logs and broken in logs, logs
        assert "1 tuned classes loaded" in logs, logs
        with flashserve.Client(s2.address, timeout=120) as c:
            _check(c, *problems[0], "float16", False)  # its class skipped: the default serves it
            assert _check(c, *problems[1], "float16", False).kernel.endswith(winner)
    finally:
        _stop_and_check(s2)
