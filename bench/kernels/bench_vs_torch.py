#!/usr/bin/env python3
"""Side-by-side forward-attention benchmark: flashserve's CUDA kernels (through the C ABI in
libflashserve_kernels_capi.so, loaded with ctypes) against PyTorch SDPA's FLASH_ATTENTION,
CUDNN_ATTENTION and EFFICIENT_ATTENTION backends, in one process on the same torch tensors.

Timing: CUDA events around each call, warm-up first, median over --reps calls; every call uses
the next of several input sets whose total size exceeds twice the L2 cache, so no call finds its
inputs in L2. TFLOPS = 4*B*Hq*Sq*Sk*d / time, halved for causal when Sq == Sk.

  python3 bench/kernels/bench_vs_torch.py --lib build/kernels/cuda/libflashserve_kernels_capi.so
"""
import argparse
import ctypes
import datetime
import math
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2}


class Ours:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        f = self.lib.flashserve_attention_forward
        f.restype = ctypes.c_int
        f.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 +
                      [ctypes.POINTER(ctypes.c_int64), ctypes.c_float, ctypes.c_int,
                       ctypes.c_char_p, ctypes.c_void_p])
        for name in ("flashserve_attention_candidate_name",):
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.flashserve_attention_num_candidates.restype = ctypes.c_int
        self.lib.flashserve_attention_select_name.restype = ctypes.c_int

    def candidates(self, dtype, d, causal):
        n = self.lib.flashserve_attention_num_candidates(DTYPE_CODE[dtype], d, int(causal))
        out = []
        for i in range(n):
            buf = ctypes.create_string_buffer(64)
            self.lib.flashserve_attention_candidate_name(DTYPE_CODE[dtype], d, int(causal), i, buf, 64)
            out.append(buf.value.decode())
        return out

    def select(self, dtype, b, sq, sk, hq, hkv, d, causal, sms):
        buf = ctypes.create_string_buffer(64)
        self.lib.flashserve_attention_select_name(DTYPE_CODE[dtype], b, sq, sk, hq, hkv, d,
                                                  int(causal), sms, buf, 64)
        return buf.value.decode()

    def __call__(self, q, k, v, o, causal, config=None, lse=None):
        """q, k, v, o: [B, S, H, D] torch tensors (last dim contiguous)."""
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        strides = (ctypes.c_int64 * 12)(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                        *o.stride()[:3])
        err = self.lib.flashserve_attention_forward(
            DTYPE_CODE[q.dtype], q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
            lse.data_ptr() if lse is not None else None, b, sq, sk, hq, hkv, d, strides,
            1.0 / math.sqrt(d), int(causal), config.encode() if config else None,
            torch.cuda.current_stream().cuda_stream)
        if err != 0:
            raise RuntimeError(f"flashserve_attention_forward failed: cudaError {err}")


def make_sets(b, sq, sk, hq, hkv, d, dtype, l2_bytes):
    one = (2 * b * sq * hq * d + 2 * b * sk * hkv * d) * 2
    n = max(2, math.ceil(2 * l2_bytes / one))
    sets = []
    for _ in range(n):
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
        o = torch.empty_like(q)
        sets.append((q, k, v, o))
    return sets


def time_fn(fn, sets, warmup, reps):
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        s = sets[i % len(sets)]
        starts[i].record()
        fn(*s)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(st.elapsed_time(en) for st, en in zip(starts, ends)) * 1e-3


def sdpa_fn(backend, causal, gqa):
    def fn(q, k, v, o):
        with sdpa_kernel([backend]):
            # [B, S, H, D] views as [B, H, S, D]: no copies.
            F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=causal, enable_gqa=gqa)
    return fn


def grid(quick):
    pts = []  # (label, dtype, b, sq, sk, hq, hkv, d, causal)
    for d in (64, 128):
        for causal in (False, True):
            for s in (512, 1024, 2048, 4096, 8192, 16384):
                h = 16 if d == 128 else 32
                b = 16 if s <= 4096 else (8 if s == 8192 else 4)
                pts.append(("grid", torch.bfloat16, b, s, s, h, h, d, causal))
    for d in (64, 128):
        for causal in (False, True):
            h = 16 if d == 128 else 32
            pts.append(("fp16", torch.float16, 16, 4096, 4096, h, h, d, causal))
    for causal in (False, True):
        pts.append(("gqa 32:8", torch.bfloat16, 16, 4096, 4096, 32, 8, 128, causal))
    for d in (64, 128):
        h = 16 if d == 128 else 32
        pts.append(("Sq<Sk", torch.bfloat16, 16, 1024, 8192, h, h, d, False))
    for d in (64, 128):
        for causal in (False, True):
            h = 16 if d == 128 else 32
            pts.append(("odd S", torch.bfloat16, 16, 4000, 4000, h, h, d, causal))
    if quick:
        pts = [p for p in pts if p[3] in (1024, 4096) or p[0] != "grid"]
    return pts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--all-configs", action="store_true", help="also time every candidate config")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args()
    assert args.reps >= 30, "median over at least 30 repetitions"
    torch.manual_seed(0)
    ours = Ours(args.lib)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    sms = props.multi_processor_count
    lines = []
    emit = lambda s="": (print(s, flush=True), lines.append(s))
    emit(f"# flashserve sm80 kernels vs torch SDPA on {props.name}")
    emit()
    emit(f"- date: {datetime.date.today().isoformat()}; torch {torch.__version__}, "
         f"cuDNN {torch.backends.cudnn.version()}; {sms} SMs, L2 {l2 >> 20} MiB")
    emit(f"- command: `{' '.join(sys.argv)}`")
    emit(f"- median of {args.reps} calls after {args.warmup} warm-up calls, CUDA events, inputs "
         f"rotated over sets totalling > 2x L2; TFLOPS = 4*B*Hq*Sq*Sk*d/t (halved when causal and Sq==Sk)")
    emit()
    emit("| case | dtype | d | causal | B | Hq:Hkv | Sq | Sk | ours cfg | ours | flash | cudnn | efficient | ours/flash | ours/cudnn | best cfg (TFLOPS) |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios128 = []
    ratios_all = []
    for (label, dtype, b, sq, sk, hq, hkv, d, causal) in grid(args.quick):
        sets = make_sets(b, sq, sk, hq, hkv, d, dtype, l2)
        flops = 4.0 * b * hq * sq * sk * d / (2 if causal and sq == sk else 1)
        tf = lambda t: flops / t / 1e12 if t else None
        cfg = ours.select(dtype, b, sq, sk, hq, hkv, d, causal, sms)
        # sanity: ours vs flash on one set
        q, k, v, o = sets[0]
        ours(q, k, v, o, causal)
        torch.cuda.synchronize()
        results = {}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            fn = sdpa_fn(backend, causal, hq != hkv)
            try:
                with sdpa_kernel([backend]):
                    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=causal, enable_gqa=hq != hkv).transpose(1, 2)
                diff = (ref.float() - o.float()).abs().max().item()
                if diff > 0.05:
                    print(f"WARNING {label} {name}: max |ours - {name}| = {diff}", file=sys.stderr)
                results[name] = time_fn(fn, sets, args.warmup, args.reps)
            except RuntimeError as e:
                print(f"{name} unavailable for {label} d={d} causal={causal}: {str(e).splitlines()[0]}",
                      file=sys.stderr)
                results[name] = None
        t_ours = time_fn(lambda q, k, v, o: ours(q, k, v, o, causal), sets, args.warmup, args.reps)
        best = ""
        if args.all_configs:
            per = {}
            for c in ours.candidates(dtype, d, causal):
                per[c] = time_fn(lambda q, k, v, o, c=c: ours(q, k, v, o, causal, c), sets, args.warmup, args.reps)
            bc = min(per, key=per.get)
            best = f"{bc} ({tf(per[bc]):.0f}); " + ", ".join(f"{c}:{tf(t):.0f}" for c, t in per.items())
        fmt = lambda t: f"{tf(t):.0f}" if t else "n/a"
        r_flash = results["flash"] / t_ours if results["flash"] else None
        r_cudnn = results["cudnn"] / t_ours if results["cudnn"] else None
        if r_flash:
            ratios_all.append(r_flash)
            if d == 128:
                ratios128.append(r_flash)
        emit(f"| {label} | {str(dtype).split('.')[-1]} | {d} | {'yes' if causal else 'no'} | {b} | {hq}:{hkv} | "
             f"{sq} | {sk} | {cfg} | {fmt(t_ours)} | {fmt(results['flash'])} | {fmt(results['cudnn'])} | "
             f"{fmt(results['efficient'])} | {'%.2f' % r_flash if r_flash else 'n/a'} | "
             f"{'%.2f' % r_cudnn if r_cudnn else 'n/a'} | {best} |")
        del sets
        torch.cuda.empty_cache()
    hm = lambda xs: len(xs) / sum(1 / x for x in xs) if xs else float("nan")
    emit()
    emit(f"- harmonic mean of ours/flash over the d=128 points: **{hm(ratios128):.3f}** ({len(ratios128)} points); "
         f"over all points: {hm(ratios_all):.3f}; minimum: {min(ratios_all):.3f}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
