#!/usr/bin/env python3
"""Where the KV pool puts a sequence's pages, seen from the decode kernel (issue 19/20).

The decode kernel reads a layer whose pages lie in few 2 MiB slabs as fast as dense K/V and one whose pages are
scattered over the pool 1-3% slower (bench/results/kernels-decode-h200-2026-11-29-placement.md). This runs the
same decode steps on servers (one binary per --server, e.g. two page allocators) whose pool is either fresh or
fragmented the way a decoding server's pool gets: --fillers sequences of --filler_layers layers grow round-robin,
one page per layer at a time, until --fill of the pool is used, then every other filler is released. Then
--sequences sequences of one layer with a --context-token prefix are created and --steps DecodeSteps run over
them (one new token each); the row reports the server's own kernel time per step (Timing.kernel_us: the decode
launch alone, CUDA events), median over the steps, per round and the median of the rounds.

    python3 bench/service/kv_placement_bench.py --server new=build/server/flashserve \\
        --server old=/tmp/flashserve-old --rounds 3 --md placement.md
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import numpy as np

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_bench as db  # noqa: E402 - the Llama-3-8B-like layer, requests and bf16 rows
from decode_bench import flashserve, spb, spb_grpc, tensors  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary: str, backend: str, pool_bytes: int, max_tokens: int, log: Path):
    ports = [free_port() for _ in range(3)]
    args = [binary, f"--backend={backend}", "--host=127.0.0.1", f"--grpc_port={ports[0]}", f"--http_port={ports[1]}",
            f"--metrics_port={ports[2]}", f"--kv_cache_bytes={pool_bytes}", "--kv_page_tokens=64",
            f"--max_sequence_tokens={max_tokens}", "--sequence_ttl_s=0", "--max_sequences=100000",
            "--batch_window_us=0", "--max_request_bytes=2147483647", "--max_tensor_elements=1099511627776",
            "--max_inflight_bytes=0", "--grpc_memory_quota_bytes=0", "--log_level=warn"]
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{ports[0]}"
    channel = grpc.insecure_channel(target, options=db.CHANNEL_OPTIONS)
    stub = spb_grpc.SequencesStub(channel)
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"{binary} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            stub.GetKvPoolInfo(spb.GetKvPoolInfoRequest(), timeout=1)
            return proc, channel, stub, target
        except grpc.RpcError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{binary} did not answer in 60 s")


def fragment(stub, fill: float, fillers: int, layers: int, rng) -> dict:
    """Fillers grow round-robin, a page (64 tokens) per layer per Append, until `fill` of the pool is used;
    then every other one is released. Returns the pool's use before and after."""
    created = [stub.CreateSequence(spb.CreateSequenceRequest(
        num_layers=layers, heads_q=db.HEADS_Q, heads_kv=db.HEADS_KV, head_dim=db.HEAD_DIM,
        dtype=tensors.PROTO_DTYPE[db.DTYPE]), timeout=60).sequence_id for _ in range(fillers)]
    k = tensors.to_proto_rows(db.bf16_rows(rng, 64, db.HEADS_KV, db.HEAD_DIM), "k")
    request_rows = [spb.LayerKV(layer=layer, k=k, v=k) for layer in range(layers)]
    info = stub.GetKvPoolInfo(spb.GetKvPoolInfoRequest(), timeout=10)
    while info.used_bytes < fill * info.capacity_bytes:
        for sequence_id in created:
            stub.Append(spb.AppendRequest(sequence_id=sequence_id, rows=request_rows), timeout=60)
        info = stub.GetKvPoolInfo(spb.GetKvPoolInfoRequest(), timeout=10)
    full = info.used_bytes
    stub.Release(spb.ReleaseRequest(sequence_ids=created[::2]), timeout=60)
    info = stub.GetKvPoolInfo(spb.GetKvPoolInfoRequest(), timeout=10)
    return {"filled": full / info.capacity_bytes, "after_release": info.used_bytes / info.capacity_bytes}


def kernel_us_per_step(stub, ids: List[str], steps: int, warmup: int, rng) -> List[int]:
    request = db.decode_requests(ids, 1, rng)[0]
    out = []
    for i in range(warmup + steps):
        response = stub.DecodeStep(request, timeout=60)
        if i >= warmup:
            out.append(response.timing.kernel_us)
    return out


def one_run(binary: str, fragmented: bool, args, rng, log: Path) -> dict:
    max_tokens = args.context + args.steps + args.warmup + 64
    proc, channel, stub, target = start_server(binary, args.backend, args.pool_bytes, max_tokens, log)
    try:
        pool = fragment(stub, args.fill, args.fillers, args.filler_layers, rng) if fragmented else {}
        ids = db.create_sequences(target, None, args.context, args.sequences, rng)
        times = kernel_us_per_step(stub, ids, args.steps, args.warmup, rng)
        return {"kernel_us": statistics.median(times), **pool}
    finally:
        channel.close()
        proc.terminate()
        proc.wait(timeout=30)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, help="NAME=PATH of a CUDA server binary")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool_bytes", type=int, default=8 << 30)
    ap.add_argument("--fill", type=float, default=0.75)
    ap.add_argument("--fillers", type=int, default=64)
    # 5 pages per Append: not a whole number of 2 MiB slabs (8 pages of 256 KiB), so the released fillers leave
    # every slab part free instead of giving whole slabs back
    ap.add_argument("--filler_layers", type=int, default=5)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--log_dir", default="/tmp/kv-placement")
    ap.add_argument("--backend", default="cuda", help="cpu: a dry run of the procedure (kernel_us is then 0)")
    ap.add_argument("--md", help="also write the table here")
    return ap.parse_args(argv)


def table(results: dict, servers, args) -> str:
    kv_bytes = 2 * args.sequences * args.context * db.HEADS_KV * db.HEAD_DIM * 2
    lines = ["| server | pool | kernel us per step (rounds) | median | TB/s of the prefix's K/V | vs fresh | "
             "pool used when filled / after release |", "|---|---|---|---|---|---|---|"]
    for name, _ in servers:
        if not results[(name, False)]:
            continue
        fresh = statistics.median(x["kernel_us"] for x in results[(name, False)])
        for frag in (False, True):
            rows = results[(name, frag)]
            if not rows:
                continue
            med = statistics.median(x["kernel_us"] for x in rows)
            use = " / ".join(f"{x['filled']:.2f}-{x['after_release']:.2f}" for x in rows) if frag else ""
            lines.append(f"| {name} | {'fragmented' if frag else 'fresh'} | "
                         f"{' / '.join(str(x['kernel_us']) for x in rows)} | {med:.0f} | "
                         f"{kv_bytes / max(med, 1) * 1e-6:.2f} | {fresh / max(med, 1):.3f}x | {use} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    servers = [s.split("=", 1) for s in args.server]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261129)
    results = {(name, frag): [] for name, _ in servers for frag in (False, True)}
    for r in range(args.rounds):  # interleaved: drift hits every row alike
        for name, path in servers:
            for frag in (False, True):
                row = one_run(path, frag, args, rng, Path(args.log_dir) / f"{name}-{int(frag)}-{r}.log")
                results[(name, frag)].append(row)
                print(f"round {r} {name} {'fragmented' if frag else 'fresh'}: {row}", flush=True)
        if args.md:  # after every round: a run cut short keeps its whole rounds
            Path(args.md).write_text(table(results, servers, args))
    print(table(results, servers, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
