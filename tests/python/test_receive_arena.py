"""The receive arena (--receive_arena_bytes) on the CPU backend: the whole server then runs on gRPC read
buffers that the server's malloc replacement serves from the arena. The CPU backend reads nothing in
place (that is the CUDA backend's use of it; test_gpu_e2e.py covers it), so these check the mechanism
every build ships: answers stay right under concurrent mixed traffic, a full arena only falls back to
the heap, and the metrics say what happened."""

import subprocess
import threading

import numpy as np
import pytest

import flashserve
from metrics_helpers import scrape, start_metrics_server

pytestmark = pytest.mark.e2e

ARENA = "flashserve_receive_arena_bytes"
INPUTS = "flashserve_request_inputs_total"


def _traffic(address, rng_seed, shapes, rounds, make_qkv, check_answer, failures):
    rng = np.random.default_rng(rng_seed)
    try:
        with flashserve.Client(address, timeout=60) as c:
            for _ in range(rounds):
                for seqlen, dtype in shapes:
                    q, k, v = make_qkv(rng, 1, seqlen, seqlen, 4, 2, 64, dtype)
                    out, lse = c.attention(q, k, v, causal=True, return_lse=True)
                    check_answer(out, lse, q, k, v, causal=True)
    except BaseException as e:  # reported by the main thread
        failures.append(e)


def _run_clients(address, make_qkv, check_answer, shapes, clients=6, rounds=2):
    failures = []
    threads = [threading.Thread(target=_traffic, args=(address, 1000 + i, shapes, rounds, make_qkv, check_answer,
                                                      failures)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]
    return clients * rounds * len(shapes)


# Requests from 24 KB to ~5 MB: a few read buffers each, up to ~80.
SHAPES = [(24, "float32"), (700, "bfloat16"), (1500, "float32"), (3000, "float16")]


def test_server_answers_right_on_arena_read_buffers(start_server, make_qkv, check_answer):
    server, url = start_metrics_server(start_server, f"--receive_arena_bytes={64 << 20}",
                                       "--max_tensor_elements=4000000")
    n = _run_clients(server.address, make_qkv, check_answer, SHAPES)
    m = scrape(url)
    assert m.value(ARENA, state="capacity") == 64 << 20
    assert m.value(ARENA, state="peak") >= 1 << 20, "gRPC's read buffers did not come from the arena"
    assert m.value(ARENA, state="used") <= m.value(ARENA, state="peak") <= 64 << 20
    # The CPU backend reads contiguous memory only: a tensor that arrived in one read buffer is read
    # where it is, one split over several buffers is copied once. Every request is counted once.
    assert m.value(INPUTS, path="copied") + m.value(INPUTS, path="in_place") == n
    assert m.value(INPUTS, path="copied") > 0, "multi-buffer requests must be gathered"
    server.stop()
    assert server.proc.returncode == 0, server.logs()


def test_a_full_arena_falls_back_to_the_heap(start_server, make_qkv, check_answer):
    # Room for two read buffers: almost every buffer of this traffic comes from the heap.
    server, url = start_metrics_server(start_server, "--receive_arena_bytes=150000",
                                       "--max_tensor_elements=4000000")
    _run_clients(server.address, make_qkv, check_answer, SHAPES[1:], clients=4, rounds=1)
    m = scrape(url)
    assert 0 < m.value(ARENA, state="peak") <= 150000
    server.stop()
    assert server.proc.returncode == 0, server.logs()


def test_cpu_backend_has_no_arena_by_default(start_server, make_qkv, check_answer):
    server, url = start_metrics_server(start_server, "--max_tensor_elements=4000000")
    _run_clients(server.address, make_qkv, check_answer, SHAPES[:2], clients=2, rounds=1)
    m = scrape(url)
    assert m.value(ARENA, state="capacity") == 0
    assert m.value(ARENA, state="peak") == 0


def test_bad_arena_size_is_refused(flashserve_bin):
    r = subprocess.run([str(flashserve_bin), "--backend=cpu", "--grpc_port=0", "--receive_arena_bytes=-2"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "--receive_arena_bytes" in r.stderr + r.stdout
