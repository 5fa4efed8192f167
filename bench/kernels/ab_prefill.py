#!/usr/bin/env python3
"""Two builds of the kernels side by side in one process (A: --lib-a, B: --lib-b, each a
libflashserve_kernels_capi.so): prefill points timed A, B, A, B... over --rounds interleaved
rounds (median of each; clocks drift between seconds-long timings), with torch SDPA CUDNN and
FLASH on the same inputs once per point. Method as bench_vs_torch.py (CUDA events, calls queued
behind a GPU sleep, inputs rotated over sets totalling > 2x L2).

Points: dense causal problems whose lengths are and are not multiples of the tile rows, the
variable-length batch of bench_headdims_varlen.py (16 lengths in [128, 4096], seed 0) against
a dense problem of equal FLOPs, and non-causal controls. Every sm90 configuration for the point
(the one dispatch picks marked *).

  python3 bench/kernels/ab_prefill.py --lib-a old/libflashserve_kernels_capi.so \\
      --lib-b build/kernels/cuda/libflashserve_kernels_capi.so --out ab.md
"""
import argparse
import datetime
import math
import os
import random
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_headdims_varlen import OursVarlen, make_varlen_sets  # noqa: E402
from bench_vs_torch import Ours, make_sets, sdpa_fn, time_fn  # noqa: E402


def dense_points(sizes=None, causal=(True,)):
    pts = []  # (d, h, b, s, causal)
    if sizes:  # only these lengths
        return [(d, h, 16, s, c) for c in causal for s in sizes for d, h in ((64, 32), (128, 16))]
    for s in (1024, 1000, 2048, 2000, 4096, 4000):
        pts.append((64, 32, 16, s, True))
        pts.append((128, 16, 16, s, True))
    pts.append((64, 32, 8, 8192, True))
    pts.append((64, 32, 16, 4000, False))  # control: non-causal tiles do not move
    pts.append((128, 16, 16, 4000, False))
    return pts


def sm90_configs(lib, d, causal, pick):
    cands = [c for c in lib.candidates(torch.bfloat16, d, causal) if c.startswith("sm90")]
    return sorted(cands, key=lambda c: c != pick)


def ab_times(fn_a, fn_b, sets, args):
    """Medians of A and B over the interleaved rounds; nan for a build whose call fails."""
    ta, tb = [], []
    for _ in range(args.rounds):
        for fn, times in ((fn_a, ta), (fn_b, tb)):
            try:
                times.append(time_fn(fn, sets, args.warmup, args.reps))
            except RuntimeError as e:
                print(f"failed: {e}", file=sys.stderr)
                times.append(math.nan)
    return statistics.median(ta), statistics.median(tb)


def dense_section(a, b, args, l2, sms, emit):
    emit("## Dense, bf16 (TFLOPS = 4*B*H*S^2*d/t, halved when causal)")
    emit()
    emit("| d | causal | B | H | S | cfg | A ms | B ms | B/A speed | B TFLOPS | cudnn TFLOPS | flash TFLOPS | "
         "B vs cudnn | A vs cudnn |")
    emit("|" + "---|" * 14)
    for d, h, bs, s, causal in dense_points(args.dense_sizes, args.dense_causal):
        sets = make_sets(bs, s, s, h, h, d, torch.bfloat16, l2)
        flops = 4.0 * bs * h * s * s * d / (2 if causal else 1)
        pick = b.select(torch.bfloat16, bs, s, s, h, h, d, causal, sms)
        tc = time_fn(sdpa_fn(SDPBackend.CUDNN_ATTENTION, causal, False), sets, args.warmup, args.reps)
        tf = time_fn(sdpa_fn(SDPBackend.FLASH_ATTENTION, causal, False), sets, args.warmup, args.reps)
        for cfg in sm90_configs(b, d, causal, pick):
            t_a, t_b = ab_times(lambda q, k, v, o, c=cfg: a(q, k, v, o, causal, c),
                                lambda q, k, v, o, c=cfg: b(q, k, v, o, causal, c), sets, args)
            emit(f"| {d} | {'yes' if causal else 'no'} | {bs} | {h} | {s} | {cfg}{'*' if cfg == pick else ''} | "
                 f"{t_a * 1e3:.3f} | {t_b * 1e3:.3f} | **{t_a / t_b:.3f}** | {flops / t_b / 1e12:.0f} | "
                 f"{flops / tc / 1e12:.0f} | {flops / tf / 1e12:.0f} | {tc / t_b:.3f} | {tc / t_a:.3f} |")
        del sets
        torch.cuda.empty_cache()
    emit()


def varlen_section(a, b, va, vb, args, l2, sms, emit):
    emit("## Variable lengths (cu_seqlens), bf16, against the dense problem of equal FLOPs (same build)")
    emit()
    emit("| d | causal | H | sequences | cfg | A ms | B ms | B/A speed | A varlen/dense | B varlen/dense |")
    emit("|" + "---|" * 10)
    rng = random.Random(0)
    mixed = [rng.randint(128, 4096) for _ in range(16)]
    rms = int(round(math.sqrt(sum(n * n for n in mixed) / len(mixed))))
    for d, h in ((64, 32), (128, 16)):
        if args.varlen_dims and d not in args.varlen_dims:
            continue
        for causal in (True, False):
            for lens, dense_s in ((mixed, rms), ([1000] * 16, 1000)):
                vsets, cu = make_varlen_sets(lens, h, d, torch.bfloat16, l2)
                dsets = make_sets(16, dense_s, dense_s, h, h, d, torch.bfloat16, l2)
                mx = max(lens)
                pick = b.select(torch.bfloat16, 16, dense_s, dense_s, h, h, d, causal, sms)
                div = 2 if causal else 1
                f_var = sum(4.0 * h * n * n * d / div for n in lens)
                f_dense = 4.0 * 16 * h * dense_s * dense_s * d / div
                for cfg in sm90_configs(b, d, causal, pick):
                    tva, tvb = ab_times(
                        lambda q, k, v, o, c=cfg: va(q, k, v, o, cu, cu, mx, mx, causal, c),
                        lambda q, k, v, o, c=cfg: vb(q, k, v, o, cu, cu, mx, mx, causal, c), vsets, args)
                    tda, tdb = ab_times(lambda q, k, v, o, c=cfg: a(q, k, v, o, causal, c),
                                        lambda q, k, v, o, c=cfg: b(q, k, v, o, causal, c), dsets, args)
                    ratio = lambda tv, td: (f_var / tv) / (f_dense / td)
                    emit(f"| {d} | {'yes' if causal else 'no'} | {h} | {len(lens)} seqs, {min(lens)}..{mx}, "
                         f"total {sum(lens)} (dense 16x{dense_s}) | {cfg}{'*' if cfg == pick else ''} | "
                         f"{tva * 1e3:.3f} | {tvb * 1e3:.3f} | **{tva / tvb:.3f}** | {ratio(tva, tda):.3f} | "
                         f"**{ratio(tvb, tdb):.3f}** |")
                del vsets, dsets
                torch.cuda.empty_cache()
    emit()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib-a", required=True)
    ap.add_argument("--lib-b", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sections", default="dense,varlen")
    ap.add_argument("--dense-sizes", type=lambda v: [int(x) for x in v.split(",")],
                    help="dense section: only d64/d128 at these lengths (--dense-causal)")
    ap.add_argument("--dense-causal", type=lambda v: {"yes": (True,), "no": (False,), "both": (True, False)}[v],
                    default=(True,), help="with --dense-sizes: yes (default), no or both")
    ap.add_argument("--varlen-dims", type=lambda v: [int(x) for x in v.split(",")],
                    help="varlen section: only these head dims")
    ap.add_argument("--out")
    args = ap.parse_args()
    assert args.reps >= 30, "median over at least 30 repetitions"
    torch.manual_seed(0)
    a, b = Ours(args.lib_a), Ours(args.lib_b)
    va, vb = OursVarlen(a.lib), OursVarlen(b.lib)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    sms = props.multi_processor_count
    lines = []
    emit = lambda s="": (print(s, flush=True), lines.append(s))
    emit(f"# Prefill A/B on {props.name}")
    emit()
    emit(f"- date: {datetime.date.today().isoformat()}; torch {torch.__version__}, cuDNN "
         f"{torch.backends.cudnn.version()}; {sms} SMs, L2 {l2 >> 20} MiB")
    emit(f"- A: `{args.lib_a}`; B: `{args.lib_b}`")
    emit(f"- median of {args.reps} queued calls after {args.warmup} warm-up calls; A and B: median of "
         f"{args.rounds} interleaved rounds; cudnn / flash: one median per point")
    emit()
    if "dense" in args.sections:
        dense_section(a, b, args, l2, sms, emit)
    if "varlen" in args.sections:
        varlen_section(a, b, va, vb, args, l2, sms, emit)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
