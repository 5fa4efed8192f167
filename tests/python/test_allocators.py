"""The server beside another allocator (issue 17, item 4). Production images often preload jemalloc or
tcmalloc; with the server's malloc replacement (server/memory/malloc_interpose.cc) a block of one allocator
once reached the other and the server aborted at startup (`free(): invalid pointer`). Now the replacement
forwards every entry point to the preloaded allocator and leaves the receive arena off with a warning.

Runs the real binary with Debian's libjemalloc2 (scripts/setup installs it) preloaded; skipped when the
library is missing or the binary is sanitized (a sanitizer runtime must come first in the process)."""

import subprocess
from pathlib import Path

import pytest

import flashserve
from metrics_helpers import scrape, start_metrics_server

pytestmark = pytest.mark.e2e

JEMALLOC = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")


def _sanitized(binary: Path) -> bool:
    libs = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30).stdout
    return "libasan" in libs or "libtsan" in libs


@pytest.fixture
def jemalloc_preloaded(flashserve_bin, monkeypatch):
    if not JEMALLOC.exists():
        pytest.skip(f"{JEMALLOC} is missing (Debian package libjemalloc2; scripts/setup installs it)")
    if _sanitized(flashserve_bin):
        pytest.skip("sanitized binary: jemalloc cannot be preloaded before the sanitizer runtime")
    monkeypatch.setenv("LD_PRELOAD", str(JEMALLOC))
    return JEMALLOC


def _mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_server_serves_with_jemalloc_preloaded(jemalloc_preloaded, start_server, make_qkv, check_answer, rng):
    # An arena is asked for: it must be refused (warning), not crash the server.
    server, url = start_metrics_server(start_server, f"--receive_arena_bytes={64 << 20}",
                                       "--max_tensor_elements=4000000")
    assert str(jemalloc_preloaded) in _mapped_libraries(server.proc.pid), "jemalloc is not in the process"
    with flashserve.Client(server.address, timeout=60) as c:
        # 24 KB to ~2 MB requests: many of gRPC's 64 KiB read buffers, the sizes the arena would serve.
        for seqlen, dtype in [(17, "float32"), (700, "bfloat16"), (1500, "float32")]:
            q, k, v = make_qkv(rng, 1, seqlen, seqlen + 3, 4, 2, 64, dtype)
            out, lse = c.attention(q, k, v, causal=True, return_lse=True)
            check_answer(out, lse, q, k, v, causal=True)
    metrics = scrape(url)
    assert metrics.value("flashserve_receive_arena_bytes", state="capacity") == 0
    assert server.stop() == 0, server.logs()
    stderr = (Path(server.log_dir) / f"{server.name}.stderr").read_text(errors="replace")
    stdout = (Path(server.log_dir) / f"{server.name}.stdout").read_text(errors="replace")
    assert "receive arena left off" in stderr + stdout, server.logs()
    assert "invalid pointer" not in stderr


ENTRY_POINTS = ["malloc", "free", "calloc", "realloc", "reallocarray", "memalign", "posix_memalign", "aligned_alloc",
                "valloc", "pvalloc", "malloc_usable_size", "cfree"]


def test_the_replacement_exports_every_entry_point_or_none(flashserve_bin):
    # Each shared library's call must reach the same allocator: the executable's dynamic symbol table has all of
    # malloc's entry points (the replacement) or none of them (a build without it, e.g. sanitized).
    result = subprocess.run(["nm", "-D", "--defined-only", str(flashserve_bin)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    defined = {line.split()[-1] for line in result.stdout.splitlines() if line.strip()}
    present = [name for name in ENTRY_POINTS if name in defined]
    assert present in ([], ENTRY_POINTS), f"only some of malloc's entry points are exported: {present}"


def test_server_without_arena_flag_runs_with_jemalloc(jemalloc_preloaded, start_server, make_qkv, check_answer,
                                                       rng):
    # The default command line (no arena on the CPU backend): nothing to refuse, the server just runs.
    server = start_server()
    with flashserve.Client(server.address, timeout=60) as c:
        q, k, v = make_qkv(rng, 2, 33, 97, 4, 4, 64, "float16")
        out, lse = c.attention(q, k, v, return_lse=True)
        check_answer(out, lse, q, k, v)
    assert server.stop() == 0, server.logs()


def test_malloc_flags_under_another_allocator_warn_that_they_do_nothing(jemalloc_preloaded, start_server):
    """glibc's mallopt answers (and succeeds) under a preloaded jemalloc, for an allocator nobody uses: the --malloc_*
    flags seemed to work (an audit found no warning). A flag set away from its default now warns; defaults do not."""
    tuned = start_server("--malloc_arena_max=1", "--malloc_mmap_threshold_bytes=4096")
    untuned = start_server()
    for server in (tuned, untuned):
        assert server.stop() == 0, server.logs()
    assert "they have no effect" in tuned.logs(limit=20000), tuned.logs()
    assert "they have no effect" not in untuned.logs(limit=20000), untuned.logs()
