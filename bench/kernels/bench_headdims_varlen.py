#!/usr/bin/env python3
"""Issue 19's prefill benchmarks, in one process with bench_vs_torch.py's method (CUDA events,
warm-up, median of --reps, inputs rotated over sets totalling > 2x L2):

1. head dims 32, 96, 256 (sm80 family only): every compiled configuration and dispatch's pick vs
   torch SDPA FLASH_ATTENTION and CUDNN_ATTENTION;
2. dense d64 / d128 sm80 points (the kernel gained the varlen branch: compare the ratio to flash
   with the earlier tables);
3. variable-length prefill (cu_seqlens) vs the dense sm80 kernel with the same configuration:
   equal lengths (identical work: the varlen overhead), and mixed lengths against a dense problem
   of equal FLOPs and against one dense launch per sequence.

  python3 bench/kernels/bench_headdims_varlen.py --lib build/kernels/cuda/libflashserve_kernels_capi.so
"""
import argparse
import ctypes
import datetime
import math
import os
import random
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_torch import DTYPE_CODE, Ours, make_sets, sdpa_fn, sm80_choice, time_fn  # noqa: E402


class OursVarlen:
    """flashserve_attention_forward_varlen through ctypes."""

    def __init__(self, lib):
        f = lib.flashserve_attention_forward_varlen
        f.restype = ctypes.c_int
        f.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int] * 8 +
                      [ctypes.POINTER(ctypes.c_int64), ctypes.c_float, ctypes.c_int,
                       ctypes.c_char_p, ctypes.c_void_p])
        self.f = f

    def __call__(self, q, k, v, o, cu_q, cu_k, max_q, max_k, causal, config):
        """q, o: [Tq, Hq, d]; k, v: [Tk, Hkv, d]; cu_q, cu_k: int32 [B + 1] on the device (total_k
        is passed, so sm90 configurations can run it too)."""
        tq, hq, d = q.shape
        hkv = k.shape[1]
        strides = (ctypes.c_int64 * 8)(q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                       v.stride(0), v.stride(1), o.stride(0), o.stride(1))
        err = self.f(DTYPE_CODE[q.dtype], q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                     None, cu_q.data_ptr(), cu_k.data_ptr(), cu_q.numel() - 1, max_q, max_k, tq,
                     k.shape[0], hq, hkv, d, strides, 1.0 / math.sqrt(d), int(causal),
                     config.encode() if config else None, torch.cuda.current_stream().cuda_stream)
        if err != 0:
            raise RuntimeError(f"flashserve_attention_forward_varlen failed: cudaError {err}")


def tflops(flops, t):
    return flops / t / 1e12 if t else None


def fmt(x, spec=".0f"):
    return format(x, spec) if x else "n/a"


def torch_times(sets, causal, gqa, warmup, reps):
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            out[name] = time_fn(sdpa_fn(backend, causal, gqa), sets, warmup, reps)
        except RuntimeError as e:
            print(f"{name} unavailable: {str(e).splitlines()[0]}", file=sys.stderr)
            out[name] = None
    return out


def max_diff_vs_flash(ours, q, k, v, o, causal, cfg):
    ours(q, k, v, o, causal, cfg)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2)
    return (ref.float() - o.float()).abs().max().item()


def head_dim_section(ours, args, l2, sms, emit):
    emit("## Head dims 32, 96, 256 (every compiled configuration; bf16 unless noted)")
    emit()
    emit("| d | dtype | causal | B | H | S | dispatch cfg | per config TFLOPS | flash | cudnn | "
         "dispatch/flash | dispatch/cudnn | max abs diff vs flash |")
    emit("|" + "---|" * 13)
    pts = []
    for d, h in ((32, 32), (96, 16), (256, 16)):
        for s in (1024, 4096):
            for causal in (False, True):
                b = 16 if d != 256 or s == 1024 else 8
                pts.append((d, torch.bfloat16, causal, b, h, s))
        pts.append((d, torch.float16, False, 16 if d != 256 else 8, h, 4096))
    pts.append((256, torch.bfloat16, False, 1, 16, 512))  # small: dispatch takes the 64-row tile
    for d, dtype, causal, b, h, s in pts:
        sets = make_sets(b, s, s, h, h, d, dtype, l2)
        flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
        cfg = ours.select(dtype, b, s, s, h, h, d, causal, sms)
        per = {c: time_fn(lambda q, k, v, o, c=c: ours(q, k, v, o, causal, c), sets, args.warmup, args.reps)
               for c in ours.candidates(dtype, d, causal)}
        tt = torch_times(sets, causal, False, args.warmup, args.reps)
        diff = max_diff_vs_flash(ours, *sets[0], causal, cfg)
        t = per[cfg]
        emit(f"| {d} | {str(dtype).split('.')[-1]} | {'yes' if causal else 'no'} | {b} | {h} | {s} | {cfg} | "
             + ", ".join(f"{c}: {tflops(flops, x):.0f}" for c, x in per.items())
             + f" | {fmt(tflops(flops, tt['flash']))} | {fmt(tflops(flops, tt['cudnn']))} | "
             f"{fmt(tt['flash'] and tt['flash'] / t, '.2f')} | {fmt(tt['cudnn'] and tt['cudnn'] / t, '.2f')} | {diff:.2e} |")
        del sets
        torch.cuda.empty_cache()
    emit()


def dense_section(ours, args, l2, sms, emit):
    emit("## Dense sm80 d64 / d128 (after the varlen change; compare sm80/flash with earlier tables)")
    emit()
    emit("| d | causal | B | H | S | sm80 cfg | sm80 TFLOPS | flash | sm80/flash |")
    emit("|" + "---|" * 9)
    for d, h in ((64, 32), (128, 16)):
        for causal in (False, True):
            for s in (1024, 4096):
                sets = make_sets(16, s, s, h, h, d, torch.bfloat16, l2)
                flops = 4.0 * 16 * h * s * s * d / (2 if causal else 1)
                cfg = sm80_choice(ours.candidates(torch.bfloat16, d, causal), d, 16, s, h, sms)
                t = time_fn(lambda q, k, v, o: ours(q, k, v, o, causal, cfg), sets, args.warmup, args.reps)
                tf = time_fn(sdpa_fn(SDPBackend.FLASH_ATTENTION, causal, False), sets, args.warmup, args.reps)
                emit(f"| {d} | {'yes' if causal else 'no'} | 16 | {h} | {s} | {cfg} | {tflops(flops, t):.0f} | "
                     f"{tflops(flops, tf):.0f} | {tf / t:.2f} |")
                del sets
                torch.cuda.empty_cache()
    emit()


def make_varlen_sets(lens, h, d, dtype, l2):
    total = sum(lens)
    one = 4 * total * h * d * 2
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
    sets = []
    for _ in range(max(2, math.ceil(2 * l2 / one))):
        q, k, v = (torch.randn(total, h, d, device="cuda", dtype=dtype) for _ in range(3))
        sets.append((q, k, v, torch.empty_like(q)))
    return sets, cu


def varlen_row(ours, varlen, args, l2, emit, label, lens, d, h, causal, cfg, dense_b, dense_s):
    """Times varlen on lens and the dense kernel (cfg) on [dense_b, dense_s] in --rounds
    interleaved rounds (the median of each: the GPU's clocks drift between seconds-long timings),
    and per-sequence launches once."""
    dtype = torch.bfloat16
    vsets, cu = make_varlen_sets(lens, h, d, dtype, l2)
    dsets = make_sets(dense_b, dense_s, dense_s, h, h, d, dtype, l2)
    mx = max(lens)
    t_vars, t_denses = [], []
    for _ in range(args.rounds):
        t_vars.append(time_fn(lambda q, k, v, o: varlen(q, k, v, o, cu, cu, mx, mx, causal, cfg),
                              vsets, args.warmup, args.reps))
        t_denses.append(time_fn(lambda q, k, v, o: ours(q, k, v, o, causal, cfg), dsets,
                                args.warmup, args.reps))
    t_var, t_dense = statistics.median(t_vars), statistics.median(t_denses)
    cuts = [0] + [sum(lens[:i + 1]) for i in range(len(lens))]

    def per_sequence(q, k, v, o):
        for a, b in zip(cuts, cuts[1:]):
            ours(q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0), o[a:b].unsqueeze(0), causal, cfg)
    t_loop = time_fn(per_sequence, vsets, args.warmup, args.reps)
    del vsets, dsets
    torch.cuda.empty_cache()
    div = 2 if causal else 1
    f_var = sum(4.0 * h * n * n * d / div for n in lens)
    f_dense = 4.0 * dense_b * h * dense_s * dense_s * d / div
    tv, td, tl = tflops(f_var, t_var), tflops(f_dense, t_dense), tflops(f_var, t_loop)
    emit(f"| {label} | {d} | {'yes' if causal else 'no'} | {h} | {len(lens)} seqs, {min(lens)}..{mx}, "
         f"total {sum(lens)} | {cfg} | {t_var * 1e3:.3f} | {tv:.0f} | {dense_b}x{dense_s}: {td:.0f} | "
         f"**{tv / td:.3f}** | {tl:.0f} |")


def varlen_section(ours, varlen, args, l2, sms, emit):
    emit("## Variable-length prefill (cu_seqlens) vs the dense kernel, same configuration, bf16")
    emit()
    emit("Equal lengths: the same problem packed (identical FLOPs). Mixed: 16 lengths drawn "
         "uniformly from [128, 4096] (seed 0), against a dense B16 problem whose S is the root mean "
         "square of the lengths (equal FLOPs up to rounding; TFLOPS compared), and against one dense "
         "launch per sequence. TFLOPS count causal work as half of L^2 per sequence. Configurations: "
         "the sm80 one with a varlen kernel, and on an sm_90 GPU the sm90 one dispatch picks for the "
         "dense problem.")
    emit()
    emit("| kind | d | causal | H | sequences | cfg | varlen ms | varlen TFLOPS | dense TFLOPS | "
         "varlen/dense | per-sequence launches TFLOPS |")
    emit("|" + "---|" * 11)
    rng = random.Random(0)
    mixed = [rng.randint(128, 4096) for _ in range(16)]
    rms = int(round(math.sqrt(sum(n * n for n in mixed) / len(mixed))))
    for d, h in ((128, 16), (64, 32)):
        for causal in (False, True):
            # sm80: the one configuration with a varlen kernel, the default (first sm80 candidate).
            cfg80 = [c for c in ours.candidates(torch.bfloat16, d, causal) if not c.startswith("sm90")][0]

            def configs(s, every_sm90=False):
                pick = ours.select(torch.bfloat16, 16, s, s, h, h, d, causal, sms)
                picks = [pick] if pick.startswith("sm90") else []
                if every_sm90 and picks:
                    picks += [c for c in ours.candidates(torch.bfloat16, d, causal)
                              if c.startswith("sm90") and c != pick]
                return [cfg80] + picks
            for s in (1024, 4096):
                for cfg in configs(s):
                    varlen_row(ours, varlen, args, l2, emit, "equal", [s] * 16, d, h, causal, cfg, 16, s)
            for cfg in configs(rms, args.mixed_every_sm90):
                varlen_row(ours, varlen, args, l2, emit, "mixed", mixed, d, h, causal, cfg, 16, rms)
    emit()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sections", default="headdims,dense,varlen")
    ap.add_argument("--rounds", type=int, default=3,
                    help="varlen rows: interleaved rounds of varlen and dense timings (median)")
    ap.add_argument("--mixed-every-sm90", action="store_true",
                    help="varlen: mixed lengths also with every other sm90 configuration")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args()
    assert args.reps >= 30, "median over at least 30 repetitions"
    torch.manual_seed(0)
    ours = Ours(args.lib)
    varlen = OursVarlen(ours.lib)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    sms = props.multi_processor_count
    lines = []
    emit = lambda s="": (print(s, flush=True), lines.append(s))
    emit(f"# sm80 prefill: head dims 32/96/256 and variable lengths on {props.name}")
    emit()
    emit(f"- date: {datetime.date.today().isoformat()}; torch {torch.__version__}, "
         f"cuDNN {torch.backends.cudnn.version()}; {sms} SMs, L2 {l2 >> 20} MiB")
    emit(f"- command: `{' '.join(sys.argv)}`")
    emit(f"- median of {args.reps} calls after {args.warmup} warm-up calls, CUDA events, calls queued "
         f"behind a ~20 ms GPU sleep, inputs rotated over sets totalling > 2x L2; "
         f"TFLOPS = 4*B*H*S^2*d/t (halved when causal); varlen rows: median of {args.rounds} "
         f"interleaved rounds of varlen and dense timings")
    emit()
    sections = args.sections.split(",")
    if "headdims" in sections:
        head_dim_section(ours, args, l2, sms, emit)
    if "dense" in sections:
        dense_section(ours, args, l2, sms, emit)
    if "varlen" in sections:
        varlen_section(ours, varlen, args, l2, sms, emit)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
