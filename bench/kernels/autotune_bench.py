#!/usr/bin/env python3
"""Evidence for the kernel-side autotuner (kernels/include/flashserve/kernels/tuner.h), over the
kernel benchmark grid (bench_vs_torch.py's grid()). Per point:

  1. tune: flashserve_attention_tune (the C ABI over cuda::tune: warm-up 3, median of 20,
     candidates interleaved, its own random inputs rotated over > 2x L2), wall time measured;
  2. exhaustive: every candidate timed again here, on torch.randn inputs rotated over > 2x L2,
     candidates interleaved per round, median of --reps (default 60) calls;
  3. report the tuner's pick against the exhaustive best (must be within 2%) and against the
     fixed default (select()): gain = t(default) / t(pick), both from the exhaustive timing.

  python3 bench/kernels/autotune_bench.py --lib build/kernels/cuda/libflashserve_kernels_capi.so
"""
import argparse
import ctypes
import datetime
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_torch import DTYPE_CODE, Ours, grid, make_sets  # noqa: E402


def tune(ours, dtype, b, sq, sk, hq, hkv, d, causal, n):
    f = ours.lib.flashserve_attention_tune
    f.restype = ctypes.c_int
    med = (ctypes.c_double * n)()
    ok = (ctypes.c_int * n)()
    diff = (ctypes.c_double * n)()
    best, dflt, count = ctypes.c_int(-1), ctypes.c_int(-1), ctypes.c_int(0)
    err = f(DTYPE_CODE[dtype], b, sq, sk, hq, hkv, d, int(causal), 3, 20,
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), n, med, ok, diff,
            ctypes.byref(best), ctypes.byref(dflt), ctypes.byref(count))
    if err != 0:
        raise RuntimeError(f"flashserve_attention_tune failed: cudaError {err}")
    assert count.value == n
    return list(med), list(ok), list(diff), best.value, dflt.value


def exhaustive(ours, sets, causal, configs, warmup, reps):
    """Median ms per config; each round launches every config once on the next input set."""
    k = 0
    for _ in range(warmup):
        for c in configs:
            q, kk, v, o = sets[k % len(sets)]
            ours(q, kk, v, o, causal, c)
            k += 1
    ev = {c: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)] for c in configs}
    for r in range(reps):
        for c in configs:
            q, kk, v, o = sets[k % len(sets)]
            k += 1
            ev[c][r][0].record()
            ours(q, kk, v, o, causal, c)
            ev[c][r][1].record()
    torch.cuda.synchronize()
    return {c: statistics.median(s.elapsed_time(e) for s, e in ev[c]) for c in configs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--reps", type=int, default=60, help="exhaustive repetitions (tuner: 20)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    assert args.reps > 20, "the exhaustive timing takes more repetitions than the tuner"
    torch.manual_seed(0)
    ours = Ours(args.lib)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    sms = props.multi_processor_count
    lines = []
    emit = lambda s="": (print(s, flush=True), lines.append(s))
    emit(f"# flashserve kernel autotuner on {props.name}")
    emit()
    emit(f"- date: {datetime.date.today().isoformat()}; torch {torch.__version__}; {sms} SMs, L2 {l2 >> 20} MiB")
    emit(f"- command: `{' '.join(sys.argv)}`")
    emit(f"- tuner: cuda::tune, warm-up 3, median of 20, candidates interleaved, own random inputs rotated over > 2x L2; "
         f"exhaustive: every candidate again, median of {args.reps} (warm-up {args.warmup}), interleaved, torch.randn inputs rotated over > 2x L2")
    emit("- TFLOPS from the exhaustive timing; 'pick/best' = t(best) / t(pick) (1.000 = the tuner found the exhaustive best); "
         "'gain vs default' = t(default) / t(pick)")
    emit()
    emit("| case | dtype | d | causal | B | Hq:Hkv | Sq | Sk | default (select) | tuner pick | exhaustive best | default TFLOPS | pick TFLOPS | best TFLOPS | pick/best | gain vs default | tune s | not ok |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    total_tune = 0.0
    within, gains, n_points = 0, [], 0
    worst = 1.0
    for (label, dtype, b, sq, sk, hq, hkv, d, causal) in grid(args.quick):
        configs = ours.candidates(dtype, d, causal)
        default = ours.select(dtype, b, sq, sk, hq, hkv, d, causal, sms)
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        med, ok, diff, best, dflt = tune(ours, dtype, b, sq, sk, hq, hkv, d, causal, len(configs))
        torch.cuda.synchronize()
        t_tune = time.perf_counter() - t0
        total_tune += t_tune
        assert configs[dflt] == default, (configs[dflt], default)
        pick = configs[best]
        sets = make_sets(b, sq, sk, hq, hkv, d, dtype, l2)
        ex = exhaustive(ours, sets, causal, configs, args.warmup, args.reps)
        del sets
        flops = 4.0 * b * hq * sq * sk * d / (2 if causal and sq == sk else 1)
        tf = lambda ms: flops / (ms * 1e-3) / 1e12
        ex_best = min(ex, key=ex.get)
        ratio = ex[ex_best] / ex[pick]
        gain = ex[default] / ex[pick]
        n_points += 1
        within += ratio >= 0.98
        worst = min(worst, ratio)
        gains.append(gain)
        bad = ", ".join(c for c, o in zip(configs, ok) if not o) or "-"
        emit(f"| {label} | {str(dtype).split('.')[-1]} | {d} | {'yes' if causal else 'no'} | {b} | {hq}:{hkv} | {sq} | {sk} | "
             f"{default} | {pick} | {ex_best} | {tf(ex[default]):.0f} | {tf(ex[pick]):.0f} | {tf(ex[ex_best]):.0f} | "
             f"{ratio:.3f} | {gain:.3f} | {t_tune:.2f} | {bad} |")
    emit()
    gm = math.exp(sum(math.log(g) for g in gains) / len(gains))
    emit(f"- points: {n_points}; tuner pick within 2% of the exhaustive best: **{within}/{n_points}** (worst pick/best {worst:.3f})")
    emit(f"- gain of the pick over the fixed default: geometric mean {gm:.3f}, max {max(gains):.3f}, min {min(gains):.3f}")
    emit(f"- total tuning time for the whole grid: **{total_tune:.1f} s** (wall, including the tuner's allocations and input fills)")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
