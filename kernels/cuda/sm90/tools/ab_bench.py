"""Side-by-side A/B of sm90 variants against torch SDPA (cuDNN, FLASH) in one process.

Each row times every variant in interleaved rounds (variant order rotated per round), with the
timing helpers of bench/kernels/bench_vs_torch.py (median of --reps CUDA-event-timed calls after
--warmup calls, inputs rotated over sets totalling > 2x L2). A variant is an sm90 configuration
name (block_n 128 / 192 and block_m 192 at d=64, block_n 128 / 176 at d=128), e.g.
  python3 kernels/cuda/sm90/tools/ab_bench.py --lib build/kernels/cuda/libflashserve_kernels_capi.so
Prints one markdown table (TFLOPS per round, then per variant the median and range of its
per-round ratio to the same round's cuDNN). --lib2 adds every variant of a second build (another
branch or CMake option) as '<name>@2', so two builds of one configuration are timed side by side.
"""
import argparse
import itertools
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../../bench/kernels"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

from bench_vs_torch import Ours, make_sets, sdpa_fn, time_fn  # noqa: E402

N128, N176, N192 = "sm90m128n128w12s2l", "sm90m128n176w12s2l", "sm90m128n192w12s2l"
M192 = "sm90m192n128w16s2l"  # three consumer warpgroups (d=64)


def rows():
    """(label, dtype, b, sq, sk, hq, hkv, d, causal, variants); variants: (name, config)."""
    bf, fp = torch.bfloat16, torch.float16
    d64 = [("n128", N128), ("n192", N192), ("m192", M192)]
    d128 = [("n128", N128), ("n176", N176)]
    out = []
    for causal in (False, True):
        for (b, s) in ((16, 1024), (16, 2048), (16, 4096), (8, 8192), (4, 16384)):
            out.append(("grid", bf, b, s, s, 32, 32, 64, causal, d64))
        out.append(("fp16", fp, 16, 4096, 4096, 32, 32, 64, causal, d64))
        out.append(("odd S", bf, 16, 4000, 4000, 32, 32, 64, causal, d64))
    out.append(("Sq<Sk", bf, 16, 1024, 8192, 32, 32, 64, False, d64))
    for (label, dt, b, sq, sk) in (("grid", bf, 16, 4096, 4096), ("fp16", fp, 16, 4096, 4096),
                                   ("grid", bf, 8, 8192, 8192), ("grid", bf, 4, 16384, 16384),
                                   ("Sq<Sk", bf, 16, 1024, 8192), ("odd S", bf, 16, 4000, 4000)):
        out.append((label, dt, b, sq, sk, 16, 16, 128, False, d128))
    out.append(("odd S", bf, 16, 4000, 4000, 16, 16, 128, True, d128))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--lib2", default="", help="a second build's capi library ('<variant>@2')")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-flash", action="store_true", help="time cuDNN and the variants only")
    ap.add_argument("--only", default="",
                    help="substring filter on 'd<d>_<label>_c<0|1>', e.g. d64_grid_c1")
    args = ap.parse_args()
    torch.manual_seed(0)
    libs = [("", Ours(args.lib))] + ([("@2", Ours(args.lib2))] if args.lib2 else [])
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"# sm90 A/B on {props.name}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}; median of {args.reps} after {args.warmup} warm-up, "
          f"{args.rounds} interleaved rounds (TFLOPS per round; each round's "
          f"ratio against the same round's cuDNN)\n", flush=True)
    print("| case | dtype | d | causal | B | H | Sq | Sk | variant TFLOPS (r1/r2...) | "
          "per-round ratio to cudnn: median [min-max] |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for (label, dtype, b, sq, sk, hq, hkv, d, causal, variants) in rows():
        if args.only and args.only not in f"d{d}_{label}_c{int(causal)}".replace(" ", "_"):
            continue
        sets = make_sets(b, sq, sk, hq, hkv, d, dtype, l2)
        flops = 4.0 * b * hq * sq * sk * d / (2 if causal and sq == sk else 1)
        q, k, v, o = sets[0]
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal,
                                             enable_gqa=hq != hkv).transpose(1, 2)
        fns = [("cudnn", sdpa_fn(SDPBackend.CUDNN_ATTENTION, causal, hq != hkv))]
        if not args.no_flash:
            fns.append(("flash", sdpa_fn(SDPBackend.FLASH_ATTENTION, causal, hq != hkv)))
        for (suffix, ours), (name, cfg) in itertools.product(libs, variants):
            fn = lambda q, k, v, o, cfg=cfg, ours=ours: ours(q, k, v, o, causal, cfg)
            o.fill_(float("nan"))
            fn(q, k, v, o)
            err = (o.float() - ref.float()).abs().max().item()
            assert err < 0.05 and not torch.isnan(o).any(), f"{name}{suffix}: max error {err}"
            fns.append((name + suffix, fn))
        res = {n: [] for n, _ in fns}
        for r in range(args.rounds):
            order = fns[r % len(fns):] + fns[:r % len(fns)]
            for n, fn in order:
                res[n].append(flops / time_fn(fn, sets, args.warmup, args.reps) / 1e12)
        cud = statistics.median(res["cudnn"])
        cells = ", ".join(f"{n} {'/'.join(f'{x:.0f}' for x in xs)}" for n, xs in res.items())
        # Per round: the variant against the same round's cuDNN (adjacent in time); median [min-max].
        def per_round(n):
            rs = [x / c for x, c in zip(res[n], res["cudnn"])]
            return f"{statistics.median(rs):.3f} [{min(rs):.2f}-{max(rs):.2f}]"
        ratios = ", ".join(f"{n} {per_round(n)}" for n in res if n != "cudnn")
        print(f"| {label} | {str(dtype)[6:]} | {d} | {'yes' if causal else 'no'} | {b} | "
              f"{hq}:{hkv} | {sq} | {sk} | {cells} | {ratios} |", flush=True)
        del sets


if __name__ == "__main__":
    main()
