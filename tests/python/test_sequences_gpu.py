"""flashserve.v1.Sequences on the CUDA backend (KV pool in device memory), against the fp64 reference: a
Llama-3-8B-like layer (32 q heads, 8 kv heads, d128) in bf16 and fp16, many steps across pages, a batch of
sequences of different lengths, causal multi-row queries, re-prefill after release by another client, DecodeSteps
through a system shared-memory region, packed DecodeSteps. Skips with a
message on machines without a usable NVIDIA GPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

import pytest

import flashserve
from conftest import ServerProcess, _stop_and_check, zip_all
from sequences_truth import Truth
from test_gpu_e2e import _gpu_present
from test_sequences_e2e import check_a_nan_key_poisons_only_the_heads_that_read_it, \
    check_idle_sequences_leave_the_pool_without_a_call
from test_sequences_packed import run_packed_steps
from test_sequences_shm import run_shm_steps

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]


@pytest.fixture(scope="module")
def cuda_kv_server(flashserve_bin, tmp_path_factory):
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA Sequences tests skipped")
    path = os.path.join(tempfile.mkdtemp(prefix="fsg", dir="/tmp"), "fs.sock")  # sun_path: at most 107 bytes
    s = ServerProcess(flashserve_bin, tmp_path_factory.mktemp("cuda_kv"),
                      ["--backend=cuda", "--kv_cache_bytes=1073741824", "--kv_page_tokens=64",
                       "--allow_client_shm", f"--local_socket={path}"],
                      name="cuda_kv").start()
    s.local_path = path
    yield s
    _stop_and_check(s)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


# d96 / d32: the decode kernels' TMA slices of 32 columns (16-row kernels, pages of 64).
@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 128), ("float16", 128), ("bfloat16", 64),
                                            ("bfloat16", 96), ("float16", 32)])
def test_llama_like_layer_many_steps(cuda_kv_server, rng, dtype, head_dim):
    truth = Truth(rng, 32, 8, head_dim, dtype)
    shape = dict(num_layers=2, heads_q=32, heads_kv=8, head_dim=head_dim, dtype=dtype)
    with flashserve.SequenceClient(cuda_kv_server.address, timeout=120) as client:
        seqs = []
        for i, rows in enumerate([1, 63, 64, 65, 700, 1500]):  # page edges and a long one
            k, v = truth.rows(rows)
            seqs.append(client.create(**shape, prefix={0: (k, v)}))
            truth.add(seqs[-1].key, 0, k, v)
        for _ in range(20):
            qs = [truth.query() for _ in seqs]
            kvs = [truth.rows(1) for _ in seqs]
            outs = client.decode_step([(s, 0, q, k, v) for s, q, (k, v) in zip(seqs, qs, kvs)], return_lse=True)
            for seq, q, (k, v), (out, lse) in zip_all(seqs, qs, kvs, outs):
                truth.add(seq.key, 0, k, v)
                truth.check(out, q, seq.key, 0, lse=lse)
        for seq in seqs:
            k, v = truth.rows(5)
            seq.append(1, k, v)
            truth.add(seq.key, 1, k, v)
            q = truth.query(4)
            truth.check(seq.attend(1, q, causal=True), q, seq.key, 1, causal=True)
            seq.release()


def test_reprefill_on_gpu(cuda_kv_server, rng):
    truth = Truth(rng, 32, 8, 128, "bfloat16")
    shape = dict(num_layers=1, heads_q=32, heads_kv=8, head_dim=128, dtype="bfloat16")
    with flashserve.SequenceClient(cuda_kv_server.address, timeout=120) as client:
        k, v = truth.rows(300)
        seq = client.create(**shape, prefix={0: (k, v)})
        truth.add(seq.key, 0, k, v)
        # Another client frees it: the next call sees NOT_FOUND and re-creates it from the kept rows.
        client.stub(seq.endpoint).Release(flashserve.sequences_pb2.ReleaseRequest(sequence_ids=[seq.id]))
        q, (k, v) = truth.query(), truth.rows(1)
        out = seq.step(0, q, k, v)
        truth.add(seq.key, 0, k, v)
        truth.check(out, q, seq.key, 0)
        assert seq.reprefills == 1
        seq.release()


@pytest.mark.parametrize("dtype,rows_q", [("bfloat16", 1), ("float16", 2)])
def test_decode_step_through_system_shm(cuda_kv_server, rng, dtype, rows_q):
    """q/k/v read from and O/LSE written to a system region (page-locked by the server), items in the message mixed
    in; fresh random data, the fp64 reference, NaN-poisoned outputs."""
    run_shm_steps(cuda_kv_server, rng, dtype, rows_q, dict(heads_q=32, heads_kv=8, head_dim=128),
                  prefixes=(1, 63, 130, 700), steps=5)


@pytest.mark.parametrize("transport", ["grpc", "local"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_packed_decode_steps(cuda_kv_server, rng, dtype, transport):
    """DecodeStepRequest.packed on the device KV pool: one q/k/v tensor per step, inline and through a system region
    (O and LSE written back packed), uneven rows, some items attend only; the fp64 reference. Over gRPC and the local
    socket: inline outputs are written by the launch into the answer buffer they are sent from."""
    run_packed_steps(cuda_kv_server, rng, dtype, cuda_kv_server.local_path if transport == "local" else None,
                     shape=dict(heads_q=32, heads_kv=8, head_dim=128), prefixes=(1, 63, 130, 700), steps=5)


def test_packed_steps_of_64_sequences(cuda_kv_server, rng):
    """64 sequences of the Llama-3-8B-like layer: an inline packed step's q (up to 1.5 MB) and k/v are strings large
    enough for the server's malloc to take from the page-locked receive arena, and the store then reads them where
    they are (no staging copy); every answer against the fp64 reference."""
    run_packed_steps(cuda_kv_server, rng, "bfloat16", shape=dict(heads_q=32, heads_kv=8, head_dim=128),
                     prefixes=tuple(1 + (i * 37) % 300 for i in range(64)), steps=4)


def test_a_nan_key_poisons_only_the_heads_that_read_it_whatever_the_split(cuda_kv_server, rng):
    """12000 keys of one sequence: the decode kernel splits them over many blocks (test_sequences_e2e.py)."""
    check_a_nan_key_poisons_only_the_heads_that_read_it(cuda_kv_server.address, rng)


def test_idle_sequences_leave_the_device_pool_without_a_call(flashserve_bin, tmp_path, rng):
    """The sweeper evicts from the CUDA store too (its pages freed through the store's fence, off any call)."""
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA Sequences tests skipped")
    s = ServerProcess(flashserve_bin, tmp_path, ["--backend=cuda", "--kv_cache_bytes=268435456", "--sequence_ttl_s=1"],
                      name="cuda_sweep").start()
    try:
        check_idle_sequences_leave_the_pool_without_a_call(s, rng)
    finally:
        _stop_and_check(s)


def test_a_device_pool_larger_than_the_gpu_exits_2_saying_what_was_free(flashserve_bin):
    """--kv_cache_bytes past the GPU's memory: exit 2 naming the flag (as the CPU pool that cannot be mapped, in
    test_signals_exit_codes.py), and the message says what the device had free, so the operator knows what to ask."""
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi -L fails): CUDA Sequences tests skipped")
    r = subprocess.run([str(flashserve_bin), "--backend=cuda", "--grpc_port=0", "--http_port=0", "--metrics_port=0",
                        f"--kv_cache_bytes={1 << 50}"], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    line = next((x for x in r.stderr.splitlines() if "kv_cache_bytes" in x and "error" in x), "")
    assert "cannot allocate 1125899906842624 bytes of device memory" in line, r.stderr[-3000:]
    free, total = re.search(r"had (\d+) of its (\d+) bytes free", line).groups()
    assert 0 < int(free) <= int(total) < 1 << 50, line
