"""Side-by-side A/B of sm90 variants against torch SDPA (cuDNN, FLASH) in one process.

Each row times every variant in interleaved rounds (variant order rotated per round), with the
timing helpers of bench/kernels/bench_vs_torch.py (median of --reps CUDA-event-timed calls after
--warmup calls, inputs rotated over sets totalling > 2x L2). A variant is an sm90 configuration
name (block_n 128 / 192 at d=64, 128 / 176 at d=128), e.g.
  python3 kernels/cuda/sm90/tools/ab_bench.py --lib build/kernels/cuda/libflashserve_kernels_capi.so
Prints one markdown table (TFLOPS per round, then the median ratio to cuDNN per variant).
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../../bench/kernels"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

from bench_vs_torch import Ours, make_sets, sdpa_fn, time_fn  # noqa: E402

N128, N176, N192 = "sm90m128n128w12s2l", "sm90m128n176w12s2l", "sm90m128n192w12s2l"


# Session 8 A/B (a temporary host switch in launch.h): the causal L2-section tile order against
# the old one-head-after-another order (FLASHSERVE_SM90_AB_L2=0).
OLD = {"FLASHSERVE_SM90_AB_L2": "0"}
AB_KEYS = ("FLASHSERVE_SM90_AB_L2",)


def rows_s8():
    bf = torch.bfloat16
    c = [("n128", N128, {}), ("n128old", N128, OLD)]
    out = [(label, bf, b, sq, sk, 32, 32, 64, True, c)
           for (label, b, sq, sk) in (("grid", 16, 2048, 2048), ("grid", 16, 4096, 4096),
                                      ("grid", 8, 8192, 8192), ("odd S", 16, 4000, 4000))]
    out.append(("gqa 32:8", bf, 16, 4096, 4096, 32, 8, 128, True, c))
    out.append(("grid", bf, 16, 4096, 4096, 16, 16, 128, True, c))
    return out


def rows_pin():
    """The wait ordered after the softmax (--lib) against the old plain wait (--lib2)."""
    bf, fp = torch.bfloat16, torch.float16
    v = [("new", N128, {}), ("old", (N128, 2), {})]
    out = []
    for (dt, b, s, causal) in ((bf, 16, 2048, False), (bf, 16, 4096, False), (bf, 16, 4096, True),
                               (fp, 16, 4096, False), (bf, 4, 16384, False)):
        out.append(("grid" if dt == bf else "fp16", dt, b, s, s, 16, 16, 128, causal, v))
    for (dt, b, s, causal) in ((bf, 16, 2048, False), (bf, 16, 4096, False), (bf, 16, 2048, True),
                               (bf, 16, 4096, True), (fp, 16, 4096, False), (bf, 8, 8192, False)):
        out.append(("grid" if dt == bf else "fp16", dt, b, s, s, 32, 32, 64, causal, v))
    return out


def rows():
    """(label, dtype, b, sq, sk, hq, hkv, d, causal, variants); variants: (name, config)."""
    bf, fp = torch.bfloat16, torch.float16
    d64 = [("n128", N128, {}), ("n192", N192, {})]
    d128 = [("n128", N128, {}), ("n176", N176, {})]
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
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", default="default", choices=("default", "s8", "pin"))
    ap.add_argument("--lib2", help="a second build; a variant's config (name, 2) runs it")
    ap.add_argument("--no-flash", action="store_true")
    ap.add_argument("--only", default="",
                    help="substring filter on 'd<d>_<label>_c<0|1>', e.g. d64_grid_c1")
    args = ap.parse_args()
    torch.manual_seed(0)
    ours = Ours(args.lib)
    ours2 = Ours(args.lib2) if args.lib2 else None
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"# sm90 A/B on {props.name}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}; median of {args.reps} after {args.warmup} warm-up, "
          f"{args.rounds} interleaved rounds (TFLOPS per round)\n", flush=True)
    print("| case | dtype | d | causal | B | H | Sq | Sk | variant TFLOPS (r1/r2...) | median / cudnn |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for (label, dtype, b, sq, sk, hq, hkv, d, causal, variants) in (
            {"s8": rows_s8, "pin": rows_pin}.get(args.set, rows)()):
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
        for name, cfg, env in variants:
            lib = ours
            if isinstance(cfg, tuple):  # (config, 2): the --lib2 build
                cfg, lib = cfg[0], ours2

            def fn(q, k, v, o, cfg=cfg, env=env, lib=lib):
                for key in AB_KEYS:  # the launch reads them (temporary A/B switches)
                    os.environ.pop(key, None)
                os.environ.update(env)
                lib(q, k, v, o, causal, cfg)
            fn(q, k, v, o)
            err = (o.float() - ref.float()).abs().max().item()
            assert err < 0.05 and not torch.isnan(o).any(), f"{name}: max error {err}"
            fns.append((name, fn))
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
