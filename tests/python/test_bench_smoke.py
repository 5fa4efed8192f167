"""The load generators the benchmark tables come from, run against the real CPU server so they do not rot between GPU
sessions: bench/service/smoke_cli_cpu.sh (flag parsing, bearer token on every path) and smoke_local_cpu.sh (local
socket and shared-memory cells, decode variants). Skipped when the build has no benchmarks
(-DFLASHSERVE_BUILD_BENCH=OFF)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["smoke_cli_cpu.sh", "smoke_local_cpu.sh"])
def test_load_generator_smoke(flashserve_bin, script):
    build = flashserve_bin.parent.parent  # <build>/server/flashserve
    if not (build / "bench" / "service" / "flashserve-loadgen").is_file():
        pytest.skip(f"no load generators in {build} (configured with -DFLASHSERVE_BUILD_BENCH=OFF)")
    env = dict(os.environ, FLASHSERVE_BIN=str(flashserve_bin))
    done = subprocess.run(["bash", str(REPO / "bench" / "service" / script), str(build)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script} exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "OK" in done.stdout.splitlines()[-1], done.stdout[-2000:]


def test_kv_placement_bench_dry_run(flashserve_bin, tmp_path):
    """bench/service/kv_placement_bench.py's procedure (fragment the pool, create, step) on the CPU backend, where
    the kernel time it reports is 0: the script stays runnable for the GPU table."""
    md = tmp_path / "placement.md"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "service" / "kv_placement_bench.py"), "--backend", "cpu",
         "--server", f"a={flashserve_bin}", "--rounds", "1", "--pool_bytes", str(64 << 20), "--context", "1024",
         "--sequences", "2", "--steps", "2", "--warmup", "1", "--fillers", "8", "--log_dir", str(tmp_path),
         "--md", str(md)], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "client" / "python"),
                                                                      os.environ.get("PYTHONPATH")]))))
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    rows = [line for line in md.read_text().splitlines() if line.startswith("| a |")]
    assert [r.split("|")[2].strip() for r in rows] == ["fresh", "fragmented"], md.read_text()
    filled, after_release = (float(x) for x in rows[1].split("|")[7].strip().split("-"))
    assert filled >= 0.75 and after_release < filled, rows[1]  # filled, then the fillers' half released
