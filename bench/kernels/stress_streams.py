#!/usr/bin/env python3
"""Many streams at once through the kernels' counter pools (kernels/cuda/counter_slots.h): one long
causal sm90 prefill on stream 0 (2048 query rows against --long-keys keys, one head: 16 blocks busy for tens
of milliseconds, the other SMs free) while --short launches of a small causal problem are queued round-robin
on --streams - 1 other streams and run beside it, none synchronized until the end, then every output compared
bit for bit with the same problem run alone. The sm90 dynamic schedule takes a tile-counter slot per launch; two launches in
flight on one slot take tiles from one counter (tiles skipped or computed twice). Session 27 replaced the
round-robin slots (1024 per instance file: the 1024th launch after a long one shared its slot) with slots
kept per stream.

  python3 bench/kernels/stress_streams.py --lib build/kernels/cuda/libflashserve_kernels_capi.so [--lib OTHER]

Prints, per library and round: the long launch's and the short launches' mismatching outputs.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_torch import Ours  # noqa: E402


def problem(b, sq, sk, hq, hkv, d, dtype):
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    return q, k, v


def one_round(ours, cfg, long_p, short_p, args):
    """Queues the long launch and args.short short ones without a sync; returns mismatch counts."""
    lq, lk, lv = long_p
    sq, sk, sv = short_p
    alone_long, alone_short = torch.empty_like(lq), torch.empty_like(sq)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    ours(lq, lk, lv, alone_long, True, cfg)
    end.record()
    ours(sq, sk, sv, alone_short, True, cfg)
    torch.cuda.synchronize()
    print(f"  long launch alone: {start.elapsed_time(end):.1f} ms", flush=True)
    out_long = torch.full_like(lq, float("nan"))
    outs = torch.full((args.short,) + tuple(sq.shape), float("nan"), device="cuda", dtype=sq.dtype)
    streams = [torch.cuda.Stream() for _ in range(args.streams)]
    torch.cuda.synchronize()
    with torch.cuda.stream(streams[0]):
        ours(lq, lk, lv, out_long, True, cfg)
    for i in range(args.short):
        with torch.cuda.stream(streams[1 + i % (args.streams - 1)]):
            ours(sq, sk, sv, outs[i], True, cfg)
    torch.cuda.synchronize()
    long_bad = int(not torch.equal(out_long, alone_long))
    short_bad = sum(int(not torch.equal(outs[i], alone_short)) for i in range(args.short))
    return long_bad, short_bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", action="append", required=True, help="libflashserve_kernels_capi.so (repeatable)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--short", type=int, default=3000, help="short launches per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long-keys", type=int, default=2 << 20, help="keys of the long problem (B1, 2048 rows)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    long_p = problem(1, 2048, args.long_keys, 1, 1, 128, dtype)
    short_p = problem(1, 300, 300, 32, 8, 128, dtype)
    print(f"{torch.cuda.get_device_name(0)}; long: B1 Sq2048 Sk{args.long_keys} causal 1:1 d128 bf16; "
          f"{args.short} short: B1 S300 causal, over {args.streams - 1} streams", flush=True)
    for path in args.lib:
        ours = Ours(path)
        cfg = next((c for c in ours.candidates(dtype, 128, True) if c.startswith("sm90")), None)
        if cfg is None:
            print(f"{path}: no sm90 configuration (needs an sm_90 GPU and build)", flush=True)
            continue
        for r in range(args.rounds):
            long_bad, short_bad = one_round(ours, cfg, long_p, short_p, args)
            print(f"{path} {cfg} round {r + 1}: long output differs: {long_bad}; "
                  f"short outputs differing: {short_bad} of {args.short}", flush=True)


if __name__ == "__main__":
    main()
