#!/usr/bin/env python3
"""Decode benchmark: flashserve's split-KV decode kernel (flashserve_decode_forward in
libflashserve_kernels_capi.so, through ctypes) on dense and paged K/V, against PyTorch SDPA's
FLASH_ATTENTION and CUDNN_ATTENTION backends on the dense equivalent, in one process, same GPU.

Timing: CUDA events around each call, median over --reps calls after --warmup calls; every call
uses the next of several input sets totalling > 3x the L2 cache (one set when a set alone is
larger), so no call finds K/V in L2; a ~20 ms GPU sleep is queued before the timed calls so the
CPU queues them all ahead and launch gaps do not enter short kernels' times. Bandwidth = K and V
bytes (2 * B * Sk * Hkv * d * 2) / time; fraction of the GPU's peak (H100 SXM 3.35 TB/s, H200
4.8 TB/s). All runs are non-causal (torch's is_causal is top-left aligned, which is not decode's
mask); with Sq <= 16 the bottom-right causal mask would drop at most 15 keys of >= 1024.

  python3 bench/kernels/bench_decode.py --lib build/kernels/cuda/libflashserve_kernels_capi.so
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
PEAK_TBS = {"H100": 3.35, "H200": 4.8}


class Ours:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        f = self.lib.flashserve_decode_forward
        f.restype = ctypes.c_int
        f.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 7 +
                      [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_void_p] * 4 +
                      [ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
        g = self.lib.flashserve_decode_num_splits
        g.restype = ctypes.c_int
        g.argtypes = [ctypes.c_int] * 9
        self.lib.flashserve_decode_set_l2_prefetch.argtypes = [ctypes.c_int]
        self.lib.flashserve_decode_set_l2_prefetch.restype = None
        self.lib.flashserve_decode_set_copy.argtypes = [ctypes.c_int]
        self.lib.flashserve_decode_set_copy.restype = None
        self.lib.flashserve_decode_set_pdl.argtypes = [ctypes.c_int]
        self.lib.flashserve_decode_set_pdl.restype = None
        self.lib.flashserve_decode_set_deep_issue.argtypes = [ctypes.c_int]
        self.lib.flashserve_decode_set_deep_issue.restype = None
        self.lib.flashserve_decode_last_copy.argtypes = []
        self.lib.flashserve_decode_last_copy.restype = ctypes.c_int
        self.lib.flashserve_decode_set_tma_wide.argtypes = [ctypes.c_int]
        self.lib.flashserve_decode_set_tma_wide.restype = None
        self.lib.flashserve_decode_set_wide_tiles.argtypes = [ctypes.c_int]
        self.lib.flashserve_decode_set_wide_tiles.restype = None
        self.lib.flashserve_decode_last_block_n.argtypes = []
        self.lib.flashserve_decode_last_block_n.restype = ctypes.c_int
        self.lib.flashserve_decode_last_stages.argtypes = []
        self.lib.flashserve_decode_last_stages.restype = ctypes.c_int
        # The merge knob is newer than some libraries an A/B loads (session 26).
        self.has_merge = hasattr(self.lib, "flashserve_decode_set_fused_merge")
        if self.has_merge:
            self.lib.flashserve_decode_set_fused_merge.argtypes = [ctypes.c_int]
            self.lib.flashserve_decode_set_fused_merge.restype = None
            self.lib.flashserve_decode_last_merge.argtypes = []
            self.lib.flashserve_decode_last_merge.restype = ctypes.c_int
        w = self.lib.flashserve_decode_workspace_bytes
        w.restype = ctypes.c_size_t
        w.argtypes = [ctypes.c_int] * 5

    def splits(self, dtype, b, sq, sk, hq, hkv, d, sms, page=0):
        """The heuristic's split count for dense K/V (page 0) or pages of `page` keys."""
        return self.lib.flashserve_decode_num_splits(DTYPE_CODE[dtype], b, sq, sk, hq, hkv, d,
                                                     page, sms)

    def workspace(self, dtype, total_q, hq, d, splits):
        n = self.lib.flashserve_decode_workspace_bytes(DTYPE_CODE[dtype], total_q, hq, d, splits)
        return torch.empty(max(n, 16), dtype=torch.uint8, device="cuda")

    def set_l2_prefetch(self, nbytes):
        self.lib.flashserve_decode_set_l2_prefetch(nbytes)

    def set_copy(self, mode):
        self.lib.flashserve_decode_set_copy(mode)

    def set_pdl(self, mode):
        self.lib.flashserve_decode_set_pdl(mode)

    def last_copy(self):
        return self.lib.flashserve_decode_last_copy()

    def set_deep_issue(self, mode):
        self.lib.flashserve_decode_set_deep_issue(mode)

    def set_wide_tiles(self, mode):
        """128-key tiles of the d64 16-row kernel: 0 never, 1 always, 2 / 3 always with that many stages, -1 default
        (dense, pages >= 64; stages by the split plan)."""
        self.lib.flashserve_decode_set_wide_tiles(mode)

    def last_block_n(self):
        return self.lib.flashserve_decode_last_block_n()

    def set_merge(self, mode):
        """Merge of split partials: 0 the combine kernel, 1 in the split kernel up to the default's size
        limit, 2 there at any size that fits shared memory, -1 default."""
        if self.has_merge:
            self.lib.flashserve_decode_set_fused_merge(mode)
        elif mode >= 0:
            raise SystemExit("this library has no merge knob (flashserve_decode_set_fused_merge)")

    def last_merge(self):
        """How the last launch merged: 0 one split, 1 combine kernel, 2 in-kernel (-1: unknown)."""
        return self.lib.flashserve_decode_last_merge() if self.has_merge else -1

    def __call__(self, q, k, v, o, seqlens=None, table=None, page=0, workspace=None, splits=0):
        """q, o: [B, Sq, Hq, d]; k, v: dense [B, Sk, Hkv, d] or a page pool [P, page, Hkv, d]."""
        b, sq, hq, d = q.shape
        hkv = k.shape[2]
        sk = k.shape[1] if table is None else table.shape[1] * page
        strides = (ctypes.c_int64 * 12)(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                        *o.stride()[:3])
        err = self.lib.flashserve_decode_forward(
            DTYPE_CODE[q.dtype], q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), None,
            b, sq, sk, 0, hq, hkv, d, strides, None, None,
            seqlens.data_ptr() if seqlens is not None else None,
            table.data_ptr() if table is not None else None,
            table.shape[1] if table is not None else 0, page, 1.0 / math.sqrt(d), 0, splits,
            workspace.data_ptr() if workspace is not None else None,
            workspace.numel() if workspace is not None else 0,
            torch.cuda.current_stream().cuda_stream)
        if err != 0:
            raise RuntimeError(f"flashserve_decode_forward failed: cudaError {err}")


def page_key(key):
    """A pool's key: its page size, then how its pages lie (bench's diagnostics): "" shuffled, "o" in
    sequence order, "g" in order within 2 MiB runs whose order is shuffled, "w" shuffled only within
    each 2 MiB of the pool. g and w tell address translation (2 MiB) from finer placement."""
    text = str(key)
    mode = text[-1] if text[-1].isalpha() else ""
    return int(text.rstrip("ogw")), mode


def page_order(n, per_run, mode):
    """A permutation of n page slots laid out as page_key's mode says (runs of per_run pages)."""
    if mode == "o":
        return torch.arange(n, device="cuda")
    if mode not in ("g", "w") or per_run <= 1:
        return torch.randperm(n, device="cuda")
    runs = torch.arange(n, device="cuda").view(-1, per_run)  # n is a multiple of per_run here
    if mode == "g":
        return runs[torch.randperm(runs.shape[0], device="cuda")].reshape(-1)
    inner = torch.argsort(torch.rand(runs.shape, device="cuda"), dim=1)
    return torch.gather(runs, 1, inner).reshape(-1)


def make_sets(b, sq, sk, hq, hkv, d, dtype, l2_bytes, pages):
    """Input sets: dense q/k/v/o plus, per page key (page_key), a page pool holding the same K/V."""
    one = 2 * b * sk * hkv * d * 2 * (1 + len(pages))
    n = max(1, math.ceil(3 * l2_bytes / one))
    sets = []
    for _ in range(n):
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
        paged = {}
        for key in pages:
            ps, mode = page_key(key)
            per_seq = sk // ps
            per_run = max(1, (2 << 20) // (ps * hkv * d * 2))
            if (b * per_seq) % per_run:
                per_run = 1
            perm = page_order(b * per_seq, per_run, mode)
            kp = torch.empty(b * per_seq, ps, hkv, d, device="cuda", dtype=dtype)
            vp = torch.empty_like(kp)
            kp[perm] = k.view(b * per_seq, ps, hkv, d)
            vp[perm] = v.view(b * per_seq, ps, hkv, d)
            table = perm.view(b, per_seq).to(torch.int32)
            paged[key] = (kp, vp, table)
        seqlens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        sets.append(dict(q=q, k=k, v=v, o=torch.empty_like(q), paged=paged, seqlens=seqlens))
    return sets


def time_fn(fn, sets, warmup, reps):
    for i in range(warmup):
        fn(sets[i % len(sets)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    torch.cuda._sleep(40_000_000)  # ~20 ms of GPU time: the calls below queue up behind it
    for i in range(reps):
        s = sets[i % len(sets)]
        starts[i].record()
        fn(s)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(st.elapsed_time(en) for st, en in zip(starts, ends)) * 1e-3


def sdpa(backend, gqa):
    def fn(s):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(
                s["q"].transpose(1, 2), s["k"].transpose(1, 2), s["v"].transpose(1, 2),
                enable_gqa=gqa).transpose(1, 2)
    return fn


def shapes(quick, mem_budget):
    models = [("d128 GQA 32:8", 128, 32, 8), ("d64 MHA 32:32", 64, 32, 32)]
    out = []
    for name, d, hq, hkv in models:
        for b in (1, 8, 64, 256):
            for sk in (1024, 8192, 32768, 131072):
                kv = 2 * b * sk * hkv * d * 2
                if kv * 3 > mem_budget:  # dense + two page pools
                    continue
                for sq in (1, 4, 16):
                    if quick and not ((b, sk) in ((64, 8192), (1, 131072), (8, 32768)) and
                                      (sq == 1 or (sq == 16 and b == 8))):
                        continue
                    out.append((name, d, hq, hkv, b, sq, sk))
    return out


def sweep(ours, dtype, l2, sms, args):
    """Times ours (paged, page 64) on the target shapes over split counts and prefetch hints."""
    for (d, hq, hkv, b, sq, sk) in ((128, 32, 8, 64, 1, 8192), (128, 32, 8, 1, 1, 131072),
                                     (128, 32, 8, 8, 16, 32768), (64, 32, 32, 1, 1, 131072)):
        sets = make_sets(b, sq, sk, hq, hkv, d, dtype, l2, (64,))
        kv_bytes = 2 * b * sk * hkv * d * 2
        heur = ours.splits(dtype, b, sq, sk, hq, hkv, d, sms, 64)
        ws = ours.workspace(dtype, b * sq, hq, d, 128)
        for copy, hint, pdl in ((0, 128, 1), (2, 128, 1)):
            ours.set_l2_prefetch(hint)
            ours.set_copy(copy)
            ours.set_pdl(pdl)
            row = []
            for splits in sorted({1, 2, 4, 8, 16, 24, 32, 33, 48, 64, 66, 96, 128, heur}):
                if b >= 64 and splits > 8:
                    continue
                if splits > sk // 64:
                    continue
                fn = lambda s, n=splits: ours(s["q"], s["paged"][64][0], s["paged"][64][1], s["o"],
                                              seqlens=s["seqlens"], table=s["paged"][64][2], page=64,
                                              workspace=ws, splits=n)
                t = time_fn(fn, sets, args.warmup, args.reps)
                row.append(f"{splits}:{kv_bytes / t / 1e12:.2f}")
            print(f"sweep d{d} {hq}:{hkv} B{b} Sq{sq} Sk{sk} heuristic {heur} "
                  f"{COPY_NAMES[copy]} l2 {hint} pdl {pdl}: TB/s by splits "
                  + " ".join(row), flush=True)
        ours.set_l2_prefetch(-1)
        ours.set_copy(-1)
        ours.set_pdl(-1)
        del sets, ws
        torch.cuda.empty_cache()


def profile(ours, dtype, l2, sms, args):
    """Kernel timeline (torch profiler) of ours (paged 64, PDL off/on) and cuDNN on two target
    shapes: per kernel its grid, block and mean duration, and the mean span of one call."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    import json, os, tempfile
    for (d, hq, hkv, b, sq, sk) in ((128, 32, 8, 1, 1, 131072), (128, 32, 8, 64, 1, 8192)):
        sets = make_sets(b, sq, sk, hq, hkv, d, dtype, l2, (64,))
        ws = ours.workspace(dtype, b * sq, hq, d, 128)
        runs = []
        for pdl in (0, 1):
            runs.append((f"ours pdl {pdl}", pdl, lambda s: ours(
                s["q"], s["paged"][64][0], s["paged"][64][1], s["o"], seqlens=s["seqlens"],
                table=s["paged"][64][2], page=64, workspace=ws)))
        runs.append(("cudnn", -1, sdpa(SDPBackend.CUDNN_ATTENTION, True)))
        for label, pdl, fn in runs:
            ours.set_pdl(pdl)
            for i in range(5):
                fn(sets[i % len(sets)])
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(10):
                    fn(sets[i % len(sets)])
                torch.cuda.synchronize()
            path = os.path.join(tempfile.mkdtemp(), "trace.json")
            prof.export_chrome_trace(path)
            events = [e for e in json.load(open(path))["traceEvents"]
                      if e.get("cat") == "kernel" and "sleep" not in e.get("name", "")]
            events.sort(key=lambda e: e["ts"])
            per = {}
            for e in events:
                key = (e["name"][:60], str(e["args"].get("grid")), str(e["args"].get("block")))
                per.setdefault(key, []).append(e["dur"])
            span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / 10 if events else 0
            print(f"profile d{d} B{b} Sk{sk} {label}: {len(events)} kernels over 10 calls, "
                  f"mean span per call {span:.1f} us", flush=True)
            for (name, grid, block), durs in per.items():
                print(f"  {name} grid {grid} block {block}: n {len(durs)} mean {sum(durs) / len(durs):.1f} us",
                      flush=True)
        ours.set_pdl(-1)
        del sets, ws
        torch.cuda.empty_cache()

AB_SHAPES = ((128, 32, 8, 64, 1, 8192), (128, 32, 8, 1, 1, 131072), (128, 32, 8, 8, 16, 32768),
             (128, 32, 8, 8, 1, 32768), (128, 32, 8, 256, 1, 1024), (64, 32, 32, 1, 1, 131072),
             (64, 32, 32, 64, 1, 8192))
COPY_NAMES = {-1: "default copy", 0: "cp.async", 2: "TMA"}


def parse_variant(text):
    """'c2', 'c2d1', 'c0l256', 'c2w1', 'c2t1', 'c2o1', 'cxm0', ...: K/V copy (x: the default, which
    names the copy that ran in each cell), then optional deep issue (d),
    L2 hint bytes (l), TMA boxes over all 64-column slices (w), key tiles of the d64 16-row kernel
    (t: 0 64 keys, 1 128 keys, 2 / 3 128 keys with 2 / 3 stages; absent: the default, 128 on dense K/V and pages
    >= 64), o1: the
    split count that gives one block per SM (16-row kernels only; elsewhere the heuristic's) and
    the merge of split partials (m0 the combine kernel, m1 in the split kernel up to the default's
    size limit, m2 there wherever shared memory holds the partials)."""
    import re
    m = re.fullmatch(r"c(\d|x)(?:d(\d))?(?:l(\d+))?(?:w(\d))?(?:t(\d))?(?:o(\d))?(?:m(\d))?", text)
    if not m:
        raise SystemExit(f"bad --ab-variants entry {text!r} (want e.g. c2, c2d1, c2l256, c2w1, c2t1, c2o1, cx)")
    copy = -1 if m[1] == "x" else int(m[1])
    deep, hint, wide = int(m[2] or -1), int(m[3] or -1), int(m[4] or -1)
    tiles = int(m[5] or -1)
    one_per_sm = m[6] == "1"
    merge = int(m[7] or -1)
    name = COPY_NAMES.get(copy, f"copy {copy}") + (f" deep{deep}" if deep >= 0 else "") + \
        (f" l2 {hint}" if hint >= 0 else "") + (f" wide{wide}" if wide >= 0 else "") + \
        (f" tiles{tiles}" if tiles >= 0 else "") + (" 1 block/SM" if one_per_sm else "") + \
        ({0: " combine kernel", 1: " in-kernel merge", 2: " in-kernel merge, any size"}.get(merge, ""))
    return dict(copy=copy, deep=deep, l2=hint, wide=wide, tiles=tiles, one_per_sm=one_per_sm,
                merge=merge, name=name)


def variant_splits(variant, b, sq, hq, hkv, sms):
    """The split count a variant asks for: 0 (the heuristic's), or with one_per_sm, the most
    splits that keep (sequences x KV heads x splits) blocks within one per SM."""
    if not variant["one_per_sm"] or (hq // hkv) * sq > 16:
        return 0
    return max(1, sms // (b * hkv))


def ab(ours, dtype, l2, sms, args, peak):
    """Side by side (default split count and PDL): torch FLASH and CUDNN on the dense tensors, and
    ours in each variant of --ab-variants (K/V copy, deep issue, L2 hint) on paged 64, paged 16
    (Sq 1) and dense K/V, interleaved over --rounds rounds (median of each round's median), so
    that drift hits all columns alike. A cell names the copy that really ran when it fell back, and
    the tile width when a t variant's could not apply (t1 compiles only for d64 with <= 16 rows)."""
    variants = [parse_variant(x) for x in args.ab_variants.split(",")]
    copies = list(range(len(variants)))
    print("| model | B | Sq | Sk | layout | splits | flash ms | cudnn ms | "
          + " | ".join(f"{v['name']}: ms (TB/s, % peak, cudnn/ours)" for v in variants)
          + " | " + " / ".join(v["name"] for v in variants[1:]) + f" vs {variants[0]['name']} | max diff |",
          flush=True)
    print("|" + "---|" * (10 + len(copies)), flush=True)
    shapes_ab = AB_SHAPES if not args.ab_shapes else [
        tuple(int(x) for x in one.split(",")) for one in args.ab_shapes.split(";")]
    for (d, hq, hkv, b, sq, sk) in shapes_ab:
        if args.ab_pages:
            pages = tuple(int(x) if x.isdigit() else x for x in args.ab_pages.split(","))
        else:
            pages = ((64, "64o", 16) if args.ab_in_order else (64, 16)) if sq == 1 else (64,)
        sets = make_sets(b, sq, sk, hq, hkv, d, dtype, l2, pages)
        kv_bytes = 2 * b * sk * hkv * d * 2
        def page_name(key):
            size, mode = page_key(key)
            return f"paged {size}" + {"": "", "o": " in order", "g": " 2MiB runs shuffled",
                                      "w": " shuffled within 2MiB"}[mode]
        # The heuristic's split count depends on the layout (page size) and the tile width (the
        # variants' t), the workspace on it: sized for the most any variant's heuristic picks.
        splits = {page_name(key): ours.splits(dtype, b, sq, sk, hq, hkv, d, sms, page_key(key)[0])
                  for key in pages}
        splits["dense"] = ours.splits(dtype, b, sq, sk, hq, hkv, d, sms)
        most = max(list(splits.values()) + [variant_splits(v, b, sq, hq, hkv, sms) for v in variants])
        for v in variants:
            ours.set_wide_tiles(v["tiles"])
            most = max([most, ours.splits(dtype, b, sq, sk, hq, hkv, d, sms)] +
                       [ours.splits(dtype, b, sq, sk, hq, hkv, d, sms, page_key(key)[0]) for key in pages])
        ours.set_wide_tiles(-1)
        ws = ours.workspace(dtype, b * sq, hq, d, most)
        chosen = {"splits": 0}  # the variant's split count (0: the heuristic's)
        with sdpa_kernel([SDPBackend.MATH]):
            ref = sdpa(SDPBackend.MATH, hq != hkv)(sets[0]).float()
        layouts = [(page_name(key), lambda s, key=key: ours(
            s["q"], s["paged"][key][0], s["paged"][key][1], s["o"], seqlens=s["seqlens"],
            table=s["paged"][key][2], page=page_key(key)[0], workspace=ws,
            splits=chosen["splits"])) for key in pages]
        layouts.append(("dense", lambda s: ours(s["q"], s["k"], s["v"], s["o"], workspace=ws,
                                                splits=chosen["splits"])))
        times = {k: [] for k in ["flash", "cudnn"] + [(l, c) for l, _ in layouts for c in copies]}
        ran, ran_keys, merged, diff = {}, {}, {}, {l: 0.0 for l, _ in layouts}
        for _ in range(args.rounds):
            for tname, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                times[tname].append(time_fn(sdpa(backend, hq != hkv), sets, args.warmup, args.reps))
            for lname, fn in layouts:
                for c in copies:
                    ours.set_copy(variants[c]["copy"])
                    ours.set_deep_issue(variants[c]["deep"])
                    ours.set_l2_prefetch(variants[c]["l2"])
                    ours.lib.flashserve_decode_set_tma_wide(variants[c]["wide"])
                    ours.set_wide_tiles(variants[c]["tiles"])
                    ours.set_merge(variants[c]["merge"])
                    chosen["splits"] = variant_splits(variants[c], b, sq, hq, hkv, sms)
                    sets[0]["o"].fill_(float("nan"))
                    fn(sets[0])
                    torch.cuda.synchronize()
                    ran[(lname, c)] = ours.last_copy()
                    ran_keys[(lname, c)] = (ours.last_block_n(), ours.lib.flashserve_decode_last_stages())
                    merged[(lname, c)] = ours.last_merge()
                    diff[lname] = max(diff[lname], (sets[0]["o"].float() - ref).abs().max().item())
                    times[(lname, c)].append(time_fn(fn, sets, args.warmup, args.reps))
        ours.set_copy(-1)
        ours.set_deep_issue(-1)
        ours.set_l2_prefetch(-1)
        ours.lib.flashserve_decode_set_tma_wide(-1)
        ours.set_wide_tiles(-1)
        ours.set_merge(-1)
        med = {k: statistics.median(v) for k, v in times.items()}
        for lname, _ in layouts:
            cells = []
            for c in copies:
                t = med[(lname, c)]
                tbs = kv_bytes / t / 1e12
                want = variants[c]["copy"]
                note = "" if ran[(lname, c)] == want else f" [ran {COPY_NAMES.get(ran[(lname, c)])}]"
                keys, stages = ran_keys[(lname, c)]
                if variants[c]["tiles"] >= 0 and (keys == 128) != (variants[c]["tiles"] >= 1):
                    note += f" [ran {keys}-key tiles]"
                if keys == 128 and variants[c]["tiles"] in (-1, 1):
                    note += f" [{stages} stages]"
                fixed = variant_splits(variants[c], b, sq, hq, hkv, sms)
                note += f" [{fixed} splits]" if fixed else ""
                note += {1: " [combine kernel]", 2: " [in-kernel merge]"}.get(merged[(lname, c)], "") \
                    if variants[c]["merge"] != 0 else ""
                cells.append(f"{t * 1e3:.4f} ({tbs:.2f}, {100 * tbs / peak if peak else float('nan'):.0f}%, "
                             f"{med['cudnn'] / t:.3f}x){note}")
            rel = " / ".join(f"{med[(lname, copies[0])] / med[(lname, c)]:.3f}x" for c in copies[1:])
            print(f"| d{d} {hq}:{hkv} | {b} | {sq} | {sk} | {lname} | {splits[lname]} | {med['flash'] * 1e3:.3f} | "
                  f"{med['cudnn'] * 1e3:.3f} | " + " | ".join(cells) + f" | {rel} | {diff[lname]:.1e} |",
                  flush=True)
        del sets, ref, ws, layouts
        torch.cuda.empty_cache()

def only_ours(ours, dtype, l2, sms, args):
    """Runs ours on one shape --warmup + --reps times per pool of --shape-pages (in that order),
    then cuDNN as often (no timing: for an external profiler, e.g. ncu --launch-skip)."""
    d, hq, hkv, b, sq, sk = (int(x) for x in args.shape.split(","))
    pages = [int(x) if x.isdigit() else x for x in args.shape_pages.split(",")]
    sets = make_sets(b, sq, sk, hq, hkv, d, dtype, l2, pages)
    splits = ours.splits(dtype, b, sq, sk, hq, hkv, d, sms, 64)
    ws = ours.workspace(dtype, b * sq, hq, d, splits)
    for key in pages:
        for i in range(args.warmup + args.reps):
            s = sets[i % len(sets)]
            ours(s["q"], s["paged"][key][0], s["paged"][key][1], s["o"], seqlens=s["seqlens"],
                 table=s["paged"][key][2], page=page_key(key)[0], workspace=ws)
    fn = sdpa(SDPBackend.CUDNN_ATTENTION, hq != hkv)
    for i in range(args.warmup + args.reps):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    print(f"ran d{d} {hq}:{hkv} B{b} Sq{sq} Sk{sk} splits {splits}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--copy", type=int, default=-1,
                    help="K/V copy of ours: -1 default (TMA on sm_90), 0 cp.async, 2 TMA (sm_90)")
    ap.add_argument("--pdl", type=int, default=-1,
                    help="programmatic dependent launch of ours: -1 default, 0 off, 1 on (sm_90)")
    ap.add_argument("--deep", type=int, default=-1,
                    help="K/V issue order of ours: -1 default, 0 wait-then-issue, 1 issue-then-wait")
    ap.add_argument("--l2", type=int, default=-1,
                    help="L2 prefetch hint of ours' K/V loads: -1 default, 0, 128 or 256 bytes")
    ap.add_argument("--ab", action="store_true",
                    help="only the side-by-side table: the copies of --ab-copies vs torch")
    ap.add_argument("--ab-variants", default="c0,c2",
                    help="--ab: variants of ours, the first the baseline: c<copy 0|2>[d<deep 0|1>][l<L2 bytes>]"
                    "[w<TMA boxes over all slices 0|1>][t<d64 16-row key tiles: 0 64, 1 128, 2|3 128 with 2|3 stages>][o1]"
                    "[m<merge of split partials: 0 combine kernel, 1 in the split kernel, 2 there at any size>]")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: interleaved rounds")
    ap.add_argument("--ab-shapes", help="--ab: shapes 'd,hq,hkv,b,sq,sk;...' instead of the target set")
    ap.add_argument("--ab-pages", help="--ab: the page pools, e.g. 64,64o,64g,64w (bench_decode.page_key)")
    ap.add_argument("--ab-in-order", action="store_true",
                    help="--ab: also a page-64 pool whose pages lie in sequence order (diagnostic)")
    ap.add_argument("--shape", help="only run ours on d,hq,hkv,b,sq,sk (the pools of --shape-pages) --reps times "
                    "(for a profiler such as ncu)")
    ap.add_argument("--shape-pages", default="64",
                    help="--shape: the pools ours runs on, in order (64: shuffled pages of 64 keys, 64o: in order)")
    ap.add_argument("--profile", action="store_true",
                    help="only print kernel timelines (torch profiler) of two target shapes")
    ap.add_argument("--sweep", action="store_true",
                    help="only time paged-64 target shapes over split counts and L2 prefetch hints")
    args = ap.parse_args()
    assert args.reps >= 30 or args.shape, "median over at least 30 repetitions"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    ours = Ours(args.lib)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    sms = props.multi_processor_count
    peak = next((v for k, v in PEAK_TBS.items() if k in props.name), None)
    budget = int(props.total_memory * 0.55)
    lines = []
    emit = lambda s="": (print(s, flush=True), lines.append(s))
    ours.set_copy(args.copy)
    ours.set_pdl(args.pdl)
    ours.set_deep_issue(args.deep)
    ours.set_l2_prefetch(args.l2)
    if args.ab:
        return ab(ours, dtype, l2, sms, args, peak)
    if args.shape:
        return only_ours(ours, dtype, l2, sms, args)
    if args.sweep:
        return sweep(ours, dtype, l2, sms, args)
    if args.profile:
        return profile(ours, dtype, l2, sms, args)
    emit(f"# flashserve split-KV decode vs torch SDPA on {props.name}")
    emit()
    emit(f"- date: {datetime.date.today().isoformat()}; torch {torch.__version__}, cuDNN "
         f"{torch.backends.cudnn.version()}; {sms} SMs, L2 {l2 >> 20} MiB; dtype {args.dtype}; "
         f"peak bandwidth used for the fraction: {peak} TB/s; K/V copy: "
         f"{ {-1: 'default', 0: 'cp.async', 2: 'TMA'}[args.copy] }; PDL: "
         f"{ {-1: 'default', 0: 'off', 1: 'on'}[args.pdl] }")
    emit(f"- command: `{' '.join(sys.argv)}`")
    emit(f"- median of {args.reps} calls after {args.warmup} warm-up calls, CUDA events, calls queued "
         f"behind a GPU sleep, inputs rotated over sets totalling > 3x L2; non-causal; paged pools "
         f"hold the same K/V as the dense tensors in shuffled pages; torch runs on the dense tensors "
         f"(enable_gqa for GQA). TB/s = K+V bytes / time.")
    emit()
    emit("| model | B | Sq | Sk | layout | splits | ours ms | TB/s | % peak | flash ms | cudnn ms | "
         "ours/flash | ours/cudnn | max diff |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (name, d, hq, hkv, b, sq, sk) in shapes(args.quick, budget):
        pages = (64, 16) if sq == 1 else (64,)
        sets = make_sets(b, sq, sk, hq, hkv, d, dtype, l2, pages)
        kv_bytes = 2 * b * sk * hkv * d * 2
        # The heuristic's split count depends on the layout (page size), the workspace on it.
        splits = {f"paged {ps}": ours.splits(dtype, b, sq, sk, hq, hkv, d, sms, ps) for ps in pages}
        splits["dense"] = ours.splits(dtype, b, sq, sk, hq, hkv, d, sms)
        ws = ours.workspace(dtype, b * sq, hq, d, max(splits.values()))
        ref = None
        torch_t = {}
        for tname, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            fn = sdpa(backend, hq != hkv)
            try:
                out = fn(sets[0])
                if ref is None:
                    ref = out.float()
                torch_t[tname] = time_fn(fn, sets, args.warmup, args.reps)
            except RuntimeError as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"{tname} refused {name} B{b} Sq{sq} Sk{sk}: {msg}", file=sys.stderr)
                torch_t[tname] = None
        if ref is None:
            with sdpa_kernel([SDPBackend.MATH]):
                ref = sdpa(SDPBackend.MATH, hq != hkv)(sets[0]).float()
        layouts = [("dense", lambda s: ours(s["q"], s["k"], s["v"], s["o"], workspace=ws))]
        for ps in pages:
            layouts.append((f"paged {ps}", lambda s, ps=ps: ours(
                s["q"], s["paged"][ps][0], s["paged"][ps][1], s["o"], seqlens=s["seqlens"],
                table=s["paged"][ps][2], page=ps, workspace=ws)))
        for lname, fn in layouts:
            s0 = sets[0]
            s0["o"].fill_(float("nan"))
            fn(s0)
            torch.cuda.synchronize()
            diff = (s0["o"].float() - ref).abs().max().item()
            t = time_fn(fn, sets, args.warmup, args.reps)
            tbs = kv_bytes / t / 1e12
            f = lambda x: f"{x * 1e3:.3f}" if x else "refused"
            r = lambda x: f"{x / t:.2f}" if x else "n/a"
            emit(f"| {name} | {b} | {sq} | {sk} | {lname} | {splits[lname]} | {t * 1e3:.3f} | {tbs:.2f} | "
                 f"{100 * tbs / peak if peak else float('nan'):.0f}% | {f(torch_t['flash'])} | "
                 f"{f(torch_t['cudnn'])} | {r(torch_t['flash'])} | {r(torch_t['cudnn'])} | {diff:.1e} |")
        del sets, ref, ws
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
