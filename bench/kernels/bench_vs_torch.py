#!/usr/bin/env python3
"""Side-by-side forward-attention benchmark: flashserve's CUDA kernels (through the C ABI in
libflashserve_kernels_capi.so, loaded with ctypes), both families where the GPU runs both (sm90:
wgmma/TMA, on compute capability 9.0; sm80: mma.sync), against PyTorch SDPA's FLASH_ATTENTION
and CUDNN_ATTENTION backends (EFFICIENT_ATTENTION with --efficient), in one process on the same
torch tensors. "dispatch" is the configuration flashserve's select() picks.

Timing: CUDA events around each call, warm-up first, median over --reps calls queued behind a
~20 ms GPU sleep (so host launch costs do not count); every call uses
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
    """Median seconds per call. The timed calls queue up behind ~20 ms of GPU sleep, so each event
    pair times the kernel, not the host's launch of it (a 60 us kernel timed one call at a time
    measured the ctypes call and the tensor-map encoding too)."""
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda._sleep(40_000_000)  # ~20 ms at 1.98 GHz: more than the host needs to queue reps
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


def sm80_choice(cands, d, b, sq, hq, sms):
    """The sm80 family's heuristic pick (select_sm80 in kernels/cuda/flash_fwd_dispatch.cu)."""
    sm80 = [c for c in cands if not c.startswith("sm90")]
    best = sm80[0]
    if d == 64 and sq <= 1024 and "m128n64w4s2q" in sm80:
        best = "m128n64w4s2q"
    if math.ceil(sq / 128) * hq * b < sms and "m64n64w4s2" in sm80:
        best = "m64n64w4s2"
    return best


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
    for (b, s) in ((1, 128), (2, 256), (1, 1024)):  # a few blocks: where dispatch may keep sm80
        for d in (64, 128):
            pts.append(("small", torch.bfloat16, b, s, s, 16, 16, d, False))
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
    ap.add_argument("--efficient", action="store_true", help="also time EFFICIENT_ATTENTION")
    ap.add_argument("--sm90-configs", action="store_true", help="also time every sm90 candidate")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every column this many times per row, interleaved (order rotated "
                         "per round); report medians over rounds and the spread of sm90/cudnn")
    args = ap.parse_args()
    assert args.reps >= 30, "median over at least 30 repetitions"
    torch.manual_seed(0)
    ours = Ours(args.lib)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    sms = props.multi_processor_count
    lines = []
    emit = lambda s="": (print(s, flush=True), lines.append(s))
    emit(f"# flashserve kernels (sm90 and sm80 families) vs torch SDPA on {props.name}")
    emit()
    emit(f"- date: {datetime.date.today().isoformat()}; torch {torch.__version__}, "
         f"cuDNN {torch.backends.cudnn.version()}; {sms} SMs, L2 {l2 >> 20} MiB")
    emit(f"- command: `{' '.join(sys.argv)}`")
    emit(f"- median of {args.reps} calls after {args.warmup} warm-up calls, CUDA events, calls "
         f"queued behind a ~20 ms GPU sleep, inputs "
         f"rotated over sets totalling > 2x L2; TFLOPS = 4*B*Hq*Sq*Sk*d/t (halved when causal and Sq==Sk)")
    if args.rounds > 1:
        emit(f"- {args.rounds} interleaved rounds per row (every column timed once per round, order "
             f"rotated): the TFLOPS are medians over rounds; `sm90/cudnn rounds` is the range of "
             f"the per-round ratio (each round's sm90 against the same round's cuDNN)")
    emit()
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    if args.efficient:
        backends.append(("efficient", SDPBackend.EFFICIENT_ATTENTION))
    cols = ["sm90", "sm80"] + [n for n, _ in backends]
    emit("| case | dtype | d | causal | B | Hq:Hkv | Sq | Sk | dispatch cfg | " +
         " | ".join(f"{c} TFLOPS" for c in cols) +
         " | sm90/sm80 | sm90/flash | sm90/cudnn | sm90/cudnn rounds | dispatch/cudnn | best cfg (TFLOPS) |")
    emit("|" + "---|" * (9 + len(cols) + 6))
    summary = []  # (d, causal, sq, r_sm90_sm80, r_sm90_cudnn, r_dispatch_cudnn, dispatch_is_sm90)
    for (label, dtype, b, sq, sk, hq, hkv, d, causal) in grid(args.quick):
        sets = make_sets(b, sq, sk, hq, hkv, d, dtype, l2)
        flops = 4.0 * b * hq * sq * sk * d / (2 if causal and sq == sk else 1)
        tf = lambda t: flops / t / 1e12 if t else None
        cfg = ours.select(dtype, b, sq, sk, hq, hkv, d, causal, sms)
        cands = ours.candidates(dtype, d, causal)
        # The sm90 column: dispatch's sm90 pick, or the family's default where dispatch keeps sm80.
        sm90_cfg = cfg if cfg.startswith("sm90") else next(
            (c for c in cands if c.startswith("sm90")), None)
        sm80_cfg = sm80_choice(cands, d, b, sq, hq, sms)
        q, k, v, o = sets[0]
        fns = {}  # column or candidate name -> callable, every one timed in each round
        for name, c in (("sm90", sm90_cfg), ("sm80", sm80_cfg)):
            if c is None:
                continue
            ours(q, k, v, o, causal, c)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=causal, enable_gqa=hq != hkv).transpose(1, 2)
            diff = (ref.float() - o.float()).abs().max().item()
            if not diff <= 0.05:
                print(f"WARNING {label} {c}: max |ours - flash| = {diff}", file=sys.stderr)
            fns[name] = lambda q, k, v, o, c=c: ours(q, k, v, o, causal, c)
        for name, backend in backends:
            fn = sdpa_fn(backend, causal, hq != hkv)
            try:
                fn(q, k, v, o)
                fns[name] = fn
            except RuntimeError as e:
                print(f"{name} unavailable for {label} d={d} causal={causal}: {str(e).splitlines()[0]}",
                      file=sys.stderr)
        if args.all_configs or args.sm90_configs:
            for c in (cands if args.all_configs else [c for c in cands if c.startswith("sm90")]):
                if c not in (sm90_cfg, sm80_cfg):  # those are timed as their columns already
                    fns["cfg:" + c] = lambda q, k, v, o, c=c: ours(q, k, v, o, causal, c)
        runs = {n: [] for n in fns}
        order = list(fns)
        for r in range(args.rounds):
            for n in order[r % len(order):] + order[:r % len(order)]:
                runs[n].append(time_fn(fns[n], sets, args.warmup, args.reps))
        times = {c: (statistics.median(runs[c]) if c in runs else None) for c in cols}
        spread = ""
        if args.rounds > 1 and "sm90" in runs and "cudnn" in runs:
            rr = [c / s9 for s9, c in zip(runs["sm90"], runs["cudnn"])]
            spread = f"{min(rr):.2f}-{max(rr):.2f}"
        best = ""
        per = {n[4:]: statistics.median(ts) for n, ts in runs.items() if n.startswith("cfg:")}
        if args.all_configs or args.sm90_configs:
            for col, c in (("sm90", sm90_cfg), ("sm80", sm80_cfg)):
                if c in cands and runs.get(col) and (args.all_configs or c.startswith("sm90")):
                    per[c] = statistics.median(runs[col])
        if per:
            bc = min(per, key=per.get)
            best = f"{bc} ({tf(per[bc]):.0f}); " + ", ".join(f"{c}:{tf(t):.0f}" for c, t in per.items())
        fmt = lambda t: f"{tf(t):.0f}" if t else "n/a"
        ratio = lambda a, b: (times[b] / times[a]) if times.get(a) and times.get(b) else None
        fr = lambda r: "%.2f" % r if r else "n/a"
        is90 = cfg.startswith("sm90")
        t_dispatch = times["sm90"] if is90 else times["sm80"]
        r_dc = times["cudnn"] / t_dispatch if times.get("cudnn") and t_dispatch else None
        r98, r9f, r9c = ratio("sm90", "sm80"), ratio("sm90", "flash"), ratio("sm90", "cudnn")
        summary.append((d, causal, sq, r98, r9c, r_dc, is90))
        emit(f"| {label} | {str(dtype).split('.')[-1]} | {d} | {'yes' if causal else 'no'} | {b} | {hq}:{hkv} | "
             f"{sq} | {sk} | {cfg} | " + " | ".join(fmt(times[c]) for c in cols) +
             f" | {fr(r98)} | {fr(r9f)} | {fr(r9c)} | {spread} | {fr(r_dc)} | {best} |")
        del sets
        torch.cuda.empty_cache()
    hm = lambda xs: len(xs) / sum(1 / x for x in xs) if xs else float("nan")
    mn = lambda xs: min(xs) if xs else float("nan")
    d128 = [r for d, c, sq, _, r, _, _ in summary if d == 128 and sq >= 1024 and r]
    d64 = [r for d, c, sq, _, r, _, _ in summary if d == 64 and sq >= 2048 and r]
    vs80 = [x[3] for x in summary if x[3]]
    picked = [x[3] for x in summary if x[3] and x[6]]
    disp = [x[5] for x in summary if x[5]]
    emit()
    ge1 = lambda xs: sum(1 for x in xs if x >= 1.0)
    emit(f"- sm90/cudnn over the d=128 points with S >= 1k: harmonic mean **{hm(d128):.3f}**, "
         f"minimum {mn(d128):.3f}, {ge1(d128)} of {len(d128)} points >= 1.0 (target: hm >= 1.05 "
         f"and every point >= 1.0)")
    emit(f"- sm90/cudnn over the d=64 points with S >= 2k: minimum **{mn(d64):.3f}**, harmonic mean "
         f"{hm(d64):.3f}, {ge1(d64)} of {len(d64)} points >= 1.0 (target: every point >= 1.0)")
    emit(f"- sm90/sm80: minimum {mn(vs80):.3f} over all points, {mn(picked):.3f} where dispatch "
         f"picks sm90; dispatch/cudnn harmonic mean {hm(disp):.3f}, minimum {mn(disp):.3f}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
