"""The load generators the benchmark tables come from, run against the real CPU server so they do not rot between GPU
sessions: bench/service/smoke_cli_cpu.sh (flag parsing, bearer token on every path) and smoke_local_cpu.sh (local
socket and shared-memory cells, decode variants). Skipped when the build has no benchmarks
(-DFLASHSERVE_BUILD_BENCH=OFF)."""

from __future__ import annotations

import os
import subprocess
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
