"""A one-minute soak (tests/soak/soak.py with a 15 s warm-up): not in the default test run, which is
`pytest tests/python`; run it with `.venv/bin/python -m pytest -m soak tests/soak` (about 70 s). The 10-minute soak
is `tests/soak/soak.py --minutes 10` (see RESULTS.md).

It looks for leaks. The server fixes glibc's mmap threshold at 128 KiB itself (--malloc_mmap_threshold_bytes): with
the default (dynamic) threshold the RSS climbs for minutes as freed tensor buffers stay in malloc's per-thread arenas,
which says nothing about leaks and would fail a one-minute run every time (RESULTS.md has both curves)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.soak
def test_soak_one_minute(tmp_path):
    binary = Path(os.environ.get("FLASHSERVE_BIN", REPO / "build" / "server" / "flashserve"))
    if not binary.is_file():
        pytest.fail(f"no server binary at {binary} (build it or set FLASHSERVE_BIN)")
    code = soak.run(soak.parse_args(["--minutes", "1", "--warmup", "0.25", "--binary", str(binary),
                                     "--out", str(tmp_path)]))
    assert code == 0, f"soak failed; CSV and server log in {tmp_path}"
