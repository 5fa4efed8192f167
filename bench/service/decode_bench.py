#!/usr/bin/env python3
"""Decode-step benchmark (issue 20): one Llama-3-8B-like attention layer (32 q heads, 8 kv heads, d128, bf16),
``--sequences`` sequences at each ``--contexts`` length, ``--concurrency`` clients each driving its share of them.

Paths, per decode step (every sequence appends one token's k/v and attends its q):
  sequences   flashserve.v1.Sequences DecodeStep: the KV cache stays on the server, a step ships q, k, v (~0.8 MB
              for 64 sequences) and gets O back. One row per --target (e.g. servers with different --batch_window_us).
  full_kv     (a) the same step through AttentionService.Attention shipping each sequence's whole K/V every call
              (split into several calls when one would pass gRPC's 2 GiB message limit).
  sdpa        (c) torch.nn.functional.scaled_dot_product_attention on the local GPU in this process (cache appended
              in place, then attention over it; the fastest of torch's backends, query heads folded onto their KV
              head), timed with CUDA events.
Latency per step = wall time of one client's call (its share of the sequences); p50/p99 after --warmup steps.
"seq-steps/s" = sequences advanced by one token per second, all clients together. "server us" = the server's own
DecodeStep timing (total_us / compute_us, medians): what is not in it is transport and the client.

    python3 bench/service/decode_bench.py --target w0=127.0.0.1:8001 --target w200=127.0.0.1:9001 \
        --contexts 1024,8192 --concurrency 1,8 --cpp_loadgen build/bench/service/flashserve-decode-loadgen \
        --md decode.md --json decode.json

Clients: with --cpp_loadgen the Sequences and (a) rows come from the C++ client (decode_loadgen.cc: requests
serialized once, one connection per client thread), which measures the server and the transport; without it (or
with --python_client too) from this Python client (grpcio), whose serialization adds to the latency as it would
for a Python model server.

With --echo_target (a flashserve-echo, bench/service/echo_server.cc) the C++ client also sends, after each gRPC
Sequences row, each client's same serialized DecodeStep bytes to that echo server, which answers with as many bytes
as the real DecodeStepResponse (same clients, warm-up and steps): the raw gRPC round trip of the same bytes, shown
as "gRPC echo of the same bytes p50 ms" and as the floor "echo of the same bytes + kernel" in the targets table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

import grpc  # noqa: E402

try:  # PYTHONPATH may name a prepared copy (bench/service/make_py_stubs.sh); else the repository's client
    import flashserve
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client" / "python"))
    import flashserve
from flashserve import attention_pb2 as pb, sequences_pb2 as spb, sequences_pb2_grpc as spb_grpc  # noqa: E402
from flashserve import tensors  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM, DTYPE = 32, 8, 128, "bfloat16"
MAX_MESSAGE = 2**31 - 1
# The Timing fields a decode step reports (sequences.proto): total and compute, then where the rest went.
SERVER_TIMING = ("total_us", "compute_us", "prepare_us", "queue_us", "stage_us", "h2d_us", "kernel_us", "d2h_us")
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE),
                   ("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per client thread


def percentiles(samples: List[float]) -> Dict[str, float]:
    arr = np.asarray(samples) * 1e3
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99)), "n": len(samples)}


def bf16_rows(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(tensors.numpy_dtype(DTYPE))


def run_clients(concurrency: int, call, steps: int, warmup: int):
    """Runs call(client_index) warmup+steps times on each of `concurrency` threads, started together; returns
    (latencies of the measured steps, wall seconds of the measured part)."""
    latencies: List[List[float]] = [[] for _ in range(concurrency)]
    barrier = threading.Barrier(concurrency + 1)
    errors: List[BaseException] = []

    def worker(i):
        try:
            for _ in range(warmup):
                call(i)
            barrier.wait()
            for _ in range(steps):
                t0 = time.perf_counter()
                call(i)
                latencies[i].append(time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - reported after join
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [x for per in latencies for x in per], time.perf_counter() - start


# --- the Sequences path -------------------------------------------------------------------------------------------


def create_sequences(target: str, token, context: int, count: int, rng) -> List[str]:
    """`count` sequences with the same random `context`-token prefix (contents do not change the timing)."""
    k, v = bf16_rows(rng, context, HEADS_KV, HEAD_DIM), bf16_rows(rng, context, HEADS_KV, HEAD_DIM)
    prefix = {0: (tensors.to_proto_rows(k, "k"), tensors.to_proto_rows(v, "v"))}
    with flashserve.SequenceClient(target, token=token, timeout=600, reprefill=False) as client:
        seqs = [client.create(1, HEADS_Q, HEADS_KV, HEAD_DIM, DTYPE, prefix=prefix, keep_history=False)
                for _ in range(count)]
    return [s.id for s in seqs]


def release(target: str, token, ids: List[str]) -> None:
    with flashserve.SequenceClient(target, token=token, timeout=60) as client:
        client.stub(target).Release(spb.ReleaseRequest(sequence_ids=ids), timeout=60,
                                    metadata=client.metadata(""))


def decode_requests(ids: List[str], concurrency: int, rng) -> List["spb.DecodeStepRequest"]:
    """One DecodeStep request per client for its share of the sequences; re-sent every step (one new token's q,
    k, v per sequence: encoding them is a copy, the same each step)."""
    q = tensors.to_proto_rows(bf16_rows(rng, 1, HEADS_Q, HEAD_DIM), "q")
    k = tensors.to_proto_rows(bf16_rows(rng, 1, HEADS_KV, HEAD_DIM), "k")
    v = tensors.to_proto_rows(bf16_rows(rng, 1, HEADS_KV, HEAD_DIM), "v")
    shares = np.array_split(np.arange(len(ids)), concurrency)
    return [spb.DecodeStepRequest(items=[spb.DecodeItem(sequence_id=ids[i], layer=0, q=q, k=k, v=v) for i in share])
            for share in shares]


def bench_sequences(target: str, token, ids: List[str], concurrency: int, steps: int, warmup: int, rng) -> dict:
    """DecodeSteps of `concurrency` clients over the sequences `ids` (each client its share)."""
    sequences = len(ids)
    requests = decode_requests(ids, concurrency, rng)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    channels = [grpc.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(concurrency)]
    stubs = [spb_grpc.SequencesStub(c) for c in channels]
    server = {key: [] for key in SERVER_TIMING + ("batched_calls",)}

    def call(i):
        _record(server, stubs[i].DecodeStep(requests[i], timeout=60, metadata=metadata))

    try:
        latencies, wall = run_clients(concurrency, call, steps, warmup)
    finally:
        for c in channels:
            c.close()
    return _row(latencies, wall, sequences, steps, server)


def bench_sequences_local(socket_path: str, token, ids: List[str], concurrency: int, steps: int, warmup: int,
                          rng) -> dict:
    """The same DecodeSteps (tensors in the message) as frames over the server's local socket: one
    flashserve.LocalClient per client, the transport SequenceClient(local_sockets=...) uses."""
    requests = decode_requests(ids, concurrency, rng)
    clients = [flashserve.LocalClient(socket_path, token=token, timeout=60) for _ in range(concurrency)]
    server = {key: [] for key in SERVER_TIMING + ("batched_calls",)}

    def call(i):
        _record(server, clients[i].decode_step(requests[i]))

    try:
        latencies, wall = run_clients(concurrency, call, steps, warmup)
    finally:
        for c in clients:
            c.close()
    return _row(latencies, wall, len(ids), steps, server)


def bench_sequences_shm(target: str, token, ids: List[str], concurrency: int, steps: int, warmup: int,
                        rng) -> dict:
    """The same DecodeSteps with q, k, v and O in a system shared-memory region per client (the server needs
    --allow_client_shm): each step writes the new q/k/v into the region, sends a message of references only and
    reads O back from the region; all of that is inside the measured latency."""
    from flashserve.shm import SystemRegion

    shares = np.array_split(np.arange(len(ids)), concurrency)
    q_bytes, kv_bytes = HEADS_Q * HEAD_DIM * 2, HEADS_KV * HEAD_DIM * 2
    clients, regions, requests, layouts = [], [], [], []
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        for c, share in enumerate(shares):
            n = len(share)
            # [q of every item][k][v][O]: one contiguous block per tensor, written / read with one copy.
            at = {"q": 0, "k": n * q_bytes, "v": n * (q_bytes + kv_bytes), "o": n * (q_bytes + 2 * kv_bytes)}
            clients.append(flashserve.Client(target, token=token))
            regions.append(SystemRegion(clients[-1], f"decode-bench-{c}", at["o"] + n * q_bytes))
            request = spb.DecodeStepRequest()
            for j, i in enumerate(share):
                item = request.items.add(sequence_id=ids[i], layer=0)
                item.out_shm.CopyFrom(regions[-1].ref(at["o"] + j * q_bytes, q_bytes))
                for field, heads, size in (("q", HEADS_Q, q_bytes), ("k", HEADS_KV, kv_bytes),
                                           ("v", HEADS_KV, kv_bytes)):
                    t = getattr(item, field)
                    t.dtype = pb.BFLOAT16
                    t.shape[:] = [1, heads, HEAD_DIM]
                    t.shm.CopyFrom(regions[-1].ref(at[field] + j * size, size))
            requests.append(request)
            layouts.append((at, n))
        qs = [bf16_rows(rng, n, HEADS_Q, HEAD_DIM).view(np.uint8).reshape(-1) for _, n in layouts]
        kvs = [bf16_rows(rng, 2 * n, HEADS_KV, HEAD_DIM).view(np.uint8).reshape(-1) for _, n in layouts]
        stubs = [spb_grpc.SequencesStub(cl.channel) for cl in clients]
        server = {key: [] for key in SERVER_TIMING + ("batched_calls",)}

        def call(i):
            (at, n), buf = layouts[i], regions[i]._buffer
            buf[at["q"]:at["q"] + qs[i].size] = qs[i]
            buf[at["k"]:at["k"] + kvs[i].size] = kvs[i]  # k then v: adjacent blocks
            response = stubs[i].DecodeStep(requests[i], timeout=60, metadata=metadata)
            out = buf[at["o"]:at["o"] + n * q_bytes].copy()  # O, as the caller would take it
            assert out.size == n * q_bytes
            _record(server, response)

        latencies, wall = run_clients(concurrency, call, steps, warmup)
    finally:
        for r in regions:
            r.close()
        for cl in clients:
            cl.close()
    return _row(latencies, wall, len(ids), steps, server)


def _record(server: dict, response) -> None:
    t = response.timing
    for key in SERVER_TIMING:
        server[key].append(getattr(t, key))
    server["batched_calls"].append(response.batched_calls)


def _row(latencies, wall, sequences, steps, server) -> dict:
    row = percentiles(latencies)
    row.update(seq_steps_per_s=sequences * steps / wall,
               server_total_us=float(np.median(server["total_us"])),
               server_compute_us=float(np.median(server["compute_us"])),
               batched_calls_mean=float(np.mean(server["batched_calls"])))
    for key in SERVER_TIMING[2:]:
        row[f"server_{key}"] = float(np.median(server[key]))
    return row


# --- (a) full K/V per call through AttentionService ----------------------------------------------------------------


def full_kv_requests(batch: int, context: int, rng) -> List["pb.AttentionRequest"]:
    """The step of `batch` sequences as Attention calls of [b, 1, 32, 128] q over [b, context, 8, 128] K/V, as few
    as fit under gRPC's message limit."""
    per_seq = 2 * context * HEADS_KV * HEAD_DIM * 2 + HEADS_Q * HEAD_DIM * 2
    calls = -(-batch // max(1, (MAX_MESSAGE - (1 << 20)) // per_seq))
    per_call = -(-batch // calls)  # as even as possible: 64 at 8k context -> 2 calls of 32
    k = bf16_rows(rng, per_call, context, HEADS_KV, HEAD_DIM)
    v = bf16_rows(rng, per_call, context, HEADS_KV, HEAD_DIM)
    q = bf16_rows(rng, per_call, 1, HEADS_Q, HEAD_DIM)
    requests = []
    for start in range(0, batch, per_call):
        n = min(per_call, batch - start)
        requests.append(pb.AttentionRequest(q=tensors.to_proto(q[:n], "q"), k=tensors.to_proto(k[:n], "k"),
                                            v=tensors.to_proto(v[:n], "v")))
    return requests


def bench_full_kv(target: str, token, context: int, sequences: int, concurrency: int, steps: int, warmup: int,
                  rng) -> dict:
    shares = [len(s) for s in np.array_split(np.arange(sequences), concurrency)]
    requests = [full_kv_requests(n, context, rng) for n in shares]
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    channels = [grpc.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(concurrency)]
    stubs = [flashserve.attention_pb2_grpc.AttentionServiceStub(c) for c in channels]

    def call(i):
        for request in requests[i]:
            stubs[i].Attention(request, timeout=600, metadata=metadata)

    try:
        latencies, wall = run_clients(concurrency, call, steps, warmup)
    finally:
        for c in channels:
            c.close()
    row = percentiles(latencies)
    row.update(seq_steps_per_s=sequences * steps / wall, calls_per_step=sum(len(r) for r in requests),
               bytes_per_step=sum(r.ByteSize() for rs in requests for r in rs))
    return row


# --- (c) torch SDPA in this process ---------------------------------------------------------------------------------


def bench_sdpa(context: int, sequences: int, steps: int, warmup: int) -> dict:
    """Append one row per sequence into a preallocated cache, then SDPA over it; CUDA events per step, and the
    mean of `steps` steps queued back to back (no host gap). Torch's fastest way for this step: a decode step
    (one query row, no mask) lets the 4 query heads of a KV head be 4 query rows of that head, so every backend
    runs it without GQA support and without repeating K/V; each backend torch has (cuDNN, FLASH, EFFICIENT, math)
    is timed over the warm-up and the fastest is measured ("backend" in the row). Until session 17 the step left the
    choice to torch's dispatch, which took cuDNN, and cuDNN builds a plan for every new key length: 37-57 ms per step
    (bench/results/service-h200-2026-11-28-decode-full.md)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = "cuda", torch.bfloat16
    group = HEADS_Q // HEADS_KV
    length = context + 5 * (warmup + 1) + 2 * steps + 1  # the warm-ups of four backends, then the measured steps
    k_cache = torch.randn(sequences, HEADS_KV, length, HEAD_DIM, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sequences, HEADS_Q, 1, HEAD_DIM, device=dev, dtype=dt)
    new_k = torch.randn(sequences, HEADS_KV, HEAD_DIM, device=dev, dtype=dt)
    pos = [context]

    def step():
        k_cache[:, :, pos[0]] = new_k
        v_cache[:, :, pos[0]] = new_k
        pos[0] += 1
        rows = q.view(sequences, HEADS_KV, group, HEAD_DIM)  # query head h reads KV head h // group
        out = F.scaled_dot_product_attention(rows, k_cache[:, :, :pos[0]], v_cache[:, :, :pos[0]])
        return out.view(sequences, HEADS_Q, 1, HEAD_DIM)

    def warm_time(backend):
        """Mean ms of `warmup` queued steps on `backend`, or None when it cannot run this step."""
        try:
            with sdpa_kernel([backend]):
                step()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(warmup):
                    step()
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / max(warmup, 1)
        except RuntimeError:
            return None

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    tried = {name: warm_time(backend) for name, backend in backends.items()}
    best = min((t, name) for name, t in tried.items() if t is not None)[1]
    with sdpa_kernel([backends[best]]):
        torch.cuda.synchronize()
        times = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
    row = percentiles(times)
    row.update(queued_mean_ms=start.elapsed_time(end) / steps, seq_steps_per_s=sequences / (float(np.median(times))),
               backend=best, backends_warm_ms={k: (round(v, 4) if v is not None else None)
                                                         for k, v in tried.items()})
    return row


# --- driver -----------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="append", default=[], help="label=host:port of a server with a KV cache "
                   "(repeatable; e.g. one per --batch_window_us)")
    p.add_argument("--full_kv_target", default="", help="host:port for (a); default: the first --target")
    p.add_argument("--token", default=None, help="bearer token, if the servers need one")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--steps", type=int, default=200, help="measured steps per row (each appends one token)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--full_kv_steps", type=int, default=5, help="0 skips (a)")
    p.add_argument("--full_kv_max_context", type=int, default=8192)
    p.add_argument("--sdpa", action=argparse.BooleanOptionalAction, default=True, help="(c), needs torch + CUDA")
    p.add_argument("--cpp_loadgen", default="", help="path of flashserve-decode-loadgen: the Sequences and (a) "
                   "rows are measured by that C++ client")
    p.add_argument("--python_client", action=argparse.BooleanOptionalAction, default=False,
                   help="with --cpp_loadgen: also measure the Sequences rows with this Python client")
    p.add_argument("--shm", action=argparse.BooleanOptionalAction, default=False,
                   help="also the Sequences rows with q/k/v/O in system shared memory (Python client; the servers "
                        "need --allow_client_shm)")
    p.add_argument("--cpp_variants", default="", help="with --cpp_loadgen: more C++ Sequences rows, comma-separated: "
                   "grpc+system, grpc+cuda (q/k/v/O in shared memory over gRPC), local, local+system, local+cuda "
                   "(DecodeStep over the server's --local_socket; needs --local_socket for the target); each may end "
                   "in +packed (DecodeStepRequest.packed)")
    p.add_argument("--local_socket", action="append", default=[], help="label=PATH: the --local_socket of the "
                   "--target with that label (repeatable); the C++ variants above and, with the Python client, a "
                   "\"sequences, local\" row (LocalClient, tensors in the message) use it")
    p.add_argument("--client_spin_us", default="0", help="with --cpp_variants local...: comma-separated values of "
                   "flashserve-decode-loadgen --client_spin_us (the C++ client polls this long for each reply before "
                   "it blocks); each local variant runs once per value, back to back (e.g. 0,1000: an A/B)")
    p.add_argument("--echo_target", default="", help="host:port of a flashserve-echo: with --cpp_loadgen, every "
                   "gRPC Sequences row also measures the raw gRPC echo of the same request bytes (answered with the "
                   "response's size)")
    p.add_argument("--md", default="", help="write the markdown table here")
    p.add_argument("--json", default="", help="write every row as JSON here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def python_sequence_rows(args, label, address, context, levels, rng) -> List[dict]:
    ids = create_sequences(address, args.token, context, args.sequences, rng)  # each level adds steps
    rows = []
    try:
        for c in levels if args.python_client or not args.cpp_loadgen else []:
            row = bench_sequences(address, args.token, ids, c, args.steps, args.warmup, rng)
            rows.append(dict(path=f"sequences ({label})", client="Python", context=context, concurrency=c, **row))
            print(json.dumps(rows[-1]), flush=True)
        for c in levels if args.shm else []:
            row = bench_sequences_shm(address, args.token, ids, c, args.steps, args.warmup, rng)
            rows.append(dict(path=f"sequences, shared memory ({label})", client="Python", context=context,
                             concurrency=c, **row))
            print(json.dumps(rows[-1]), flush=True)
        socket_path = _local_sockets(args).get(label)
        for c in levels if socket_path else []:  # the Python client over the local socket, tensors inline
            row = bench_sequences_local(socket_path, args.token, ids, c, args.steps, args.warmup, rng)
            rows.append(dict(path=f"sequences, local ({label})", client="Python", context=context, concurrency=c,
                             **row))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        release(address, args.token, ids)
    return rows


VARIANTS = {"grpc+system": ("", "system"), "grpc+cuda": ("", "cuda"), "local": ("local", "none"),
            "local+system": ("local", "system"), "local+cuda": ("local", "cuda")}
# "+packed" on any variant: DecodeStepRequest.packed (one q/k/v/O place per step instead of one per item).


def cpp_rows(args, path, address, context, mode, steps, warmup, extra=()) -> List[dict]:
    """Rows measured by flashserve-decode-loadgen (bench/service/decode_loadgen.cc), one JSON line each. `path`
    names the rows; None keeps the load generator's own name (e.g. "sequences, local, shm system") + the label.
    A failed run gives error rows (the loadgen's own, or one per concurrency with its stderr), not an exception."""
    command = [args.cpp_loadgen, f"--target={address}", f"--context={context}", f"--sequences={args.sequences}",
               f"--concurrency={args.concurrency}", f"--steps={steps}", f"--warmup={warmup}", f"--mode={mode}",
               *extra]
    if args.token:
        command.append(f"--token={args.token}")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        stdout, failure = done.stdout, (f"exit {done.returncode}: {done.stderr[-500:]}" if done.returncode else "")
    except subprocess.TimeoutExpired:
        stdout, failure = "", "timed out after 3600 s"
    rows = []
    for line in stdout.splitlines():
        row = json.loads(line)
        row["path"] = path if path else row["path"]
        rows.append(row)
    if failure and not rows:
        rows = [dict(path=path or "sequences", client="C++", context=context, concurrency=int(c), error=failure)
                for c in args.concurrency.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    if failure:
        print(f"{' '.join(command)}: {failure}", file=sys.stderr, flush=True)
    return rows


def _local_sockets(args) -> Dict[str, str]:
    """--local_socket label=PATH as {label: path} (the label may hold "=", the path may not)."""
    return dict(s.rsplit("=", 1) for s in args.local_socket)


def cpp_variant_rows(args, label, address, context) -> List[dict]:
    """The --cpp_variants rows of one target: DecodeStep over gRPC or the local socket, inline or shared memory."""
    sockets = _local_sockets(args)
    rows = []
    for variant in [v for v in args.cpp_variants.split(",") if v]:
        base, packed = (variant[:-len("+packed")], True) if variant.endswith("+packed") else (variant, False)
        if base not in VARIANTS:
            raise SystemExit(f"--cpp_variants: unknown {variant!r} (one of {', '.join(VARIANTS)}, each may end in "
                             "+packed)")
        transport, shm = VARIANTS[base]
        extra = [f"--shm={shm}"] + (["--packed=1"] if packed else []) + (_echo_flags(args) if transport == "" else [])
        if transport == "local":
            if label not in sockets:
                raise SystemExit(f"--cpp_variants {variant}: no --local_socket {label}=PATH")
            extra.append(f"--local_socket={sockets[label]}")
        # Over the local socket: once per --client_spin_us value (rows named "..., client spin N us" when N > 0).
        spins = [int(s) for s in args.client_spin_us.split(",")] if transport == "local" else [0]
        for spin in spins:
            spin_flags = [f"--client_spin_us={spin}"] if spin > 0 else []
            for row in cpp_rows(args, None, address, context, "sequences", args.steps, args.warmup,
                                extra + spin_flags):
                row["path"] = f"{row['path']} ({label})"
                rows.append(row)
    return rows


def _echo_flags(args) -> List[str]:
    """The load generator's --echo for rows whose DecodeStep goes over gRPC (the echo is a gRPC call too)."""
    return [f"--echo={args.echo_target}"] if args.echo_target else []


def full_kv_rows(args, address, context, levels, rng) -> List[dict]:
    path = "(a) full K/V per call"
    if args.cpp_loadgen:
        return cpp_rows(args, path, address, context, "full_kv", args.full_kv_steps, 1)
    rows = []
    for c in levels:
        row = bench_full_kv(address, args.token, context, args.sequences, c, args.full_kv_steps, 1, rng)
        rows.append(dict(path=path, client="Python", context=context, concurrency=c, **row))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run(args) -> List[dict]:
    rng = np.random.default_rng(args.seed)
    targets = [t.rsplit("=", 1) if "=" in t else (t, t) for t in args.target]  # the label may hold "="
    contexts = [int(c) for c in args.contexts.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for context in contexts:
        for label, address in targets:
            if args.cpp_loadgen:
                rows += cpp_rows(args, f"sequences ({label})", address, context, "sequences", args.steps,
                                 args.warmup, _echo_flags(args))
                rows += cpp_variant_rows(args, label, address, context)
            if args.python_client or args.shm or not args.cpp_loadgen:
                rows += python_sequence_rows(args, label, address, context, levels, rng)
        full_target = args.full_kv_target or (targets[0][1] if targets else "")
        if args.full_kv_steps and full_target and context <= args.full_kv_max_context:
            rows += full_kv_rows(args, full_target, context, levels, rng)
        if args.sdpa and _cuda_available():
            row = bench_sdpa(context, args.sequences, args.steps, args.warmup)
            rows.append(dict(path=f"(c) torch SDPA ({row['backend']}), one process", client="-", context=context,
                             concurrency=1, **row))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _stages(r: dict) -> str:
    keys = ("queue", "stage", "h2d", "kernel", "d2h")
    if not all(f"server_{k}_us" in r for k in keys):
        return ""
    return "/".join(f"{r[f'server_{k}_us']:.0f}" for k in keys)


def _echo(r: dict) -> str:
    if "echo_error" in r:
        return f"echo failed: {r['echo_error'][:200]}"
    return f"{r['echo_p50_ms']:.3f}" if "echo_p50_ms" in r else ""


def markdown(rows: List[dict], args) -> str:
    lines = [f"Decode step, one Llama-3-8B-like layer ({HEADS_Q} q heads, {HEADS_KV} kv heads, d{HEAD_DIM}, {DTYPE}), "
             f"{args.sequences} sequences; {args.steps} measured steps after {args.warmup} warm-up "
             f"((a): {args.full_kv_steps} after 1). Latency = one client's call for its share of the sequences.",
             *(["gRPC echo of the same bytes = each client's serialized DecodeStep sent as is to flashserve-echo, "
                "answered with as many bytes as its DecodeStepResponse (the raw gRPC round trip; same clients, "
                "warm-up and steps, measured right after the row; C++ gRPC rows only)."]
               if any("echo_p50_ms" in r or "echo_error" in r for r in rows) else []),
             "",
             "| context | path | client | clients | p50 ms | p99 ms | gRPC echo of the same bytes p50 ms | "
             "seq-steps/s | server total us (p50) | server compute us (p50) | calls merged (mean) | "
             "server queue/stage/h2d/kernel/d2h us (p50) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['path']} | {r.get('client', '')} | {r['concurrency']} | "
                         f"failed: {r['error'][:300]} |  |  |  |  |  |  |  |")
            continue
        merged = f"{r['batched_calls_mean']:.2f}" if r["path"].startswith("sequences") else ""
        total = f"{r['server_total_us']:.0f}" if "server_total_us" in r else ""
        compute = f"{r['server_compute_us']:.0f}" if "server_compute_us" in r else ""
        p50 = f"{r['p50_ms']:.3f}" + (f" (queued {r['queued_mean_ms']:.3f})" if "queued_mean_ms" in r else "")
        lines.append(f"| {r['context']} | {r['path']} | {r.get('client', '')} | {r['concurrency']} | {p50} | "
                     f"{r['p99_ms']:.3f} | {_echo(r)} | "
                     f"{r['seq_steps_per_s']:.0f} | {total} | {compute} | {merged} | {_stages(r)} |")
    return "\n".join(lines + targets_lines(rows)) + "\n"


def targets_lines(rows: List[dict]) -> List[str]:
    """Issue 20's latency targets for every measured Sequences row at one client: p50 <= kernel + 0.5 ms for a step
    whose tensors cross the socket, <= kernel + 100 us with q/k/v/O in shared memory. Kernel = the server's
    kernel_us (CUDA events); where that is 0 (CPU backend) its compute_us. Each step appends a token, so the
    kernel reads more than the context (keys attended, p50: C++ rows). Floor = the raw gRPC echo of the same
    bytes (p50, --echo_target) + kernel: what the step would cost if the server and the client's proto work were
    free."""
    lines = ["", "Against issue 20's targets (one client, p50):", "",
             "| context | path | keys attended (p50) | p50 us | kernel us | target | bound us | met? | "
             "p50 - server total us | floor: echo of the same bytes + kernel us | p50 - floor us |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r or r["concurrency"] != 1 or not r["path"].startswith("sequences"):
            continue
        kernel = r.get("server_kernel_us") or r.get("server_compute_us", 0.0)
        shm = "shm" in r["path"] or "shared memory" in r["path"]
        bound = kernel + (100 if shm else 500)
        p50 = r["p50_ms"] * 1e3
        floor = r["echo_p50_ms"] * 1e3 + kernel if "echo_p50_ms" in r else None
        floor_cells = f"{floor:.0f} | {p50 - floor:.0f}" if floor is not None else (
            "echo failed | " if "echo_error" in r else " | ")
        attended = f"{r['attended_p50']:.0f}" if "attended_p50" in r else ""
        lines.append(f"| {r['context']} | {r['path']} | {attended} | {p50:.0f} | {kernel:.0f} | kernel + "
                     f"{'100 us' if shm else '0.5 ms'} | {bound:.0f} | {'yes' if p50 <= bound else 'no'} | "
                     f"{p50 - r.get('server_total_us', 0.0):.0f} | {floor_cells} |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = run(args)
    table = markdown(rows, args)
    print(table)
    if args.md:
        Path(args.md).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
