#!/usr/bin/env python3
"""Medians over rounds of run_decode_ab_on_gpu.sh's runs: one row per (context, path, server, clients), one
column group per variant (p50 ms, p99 ms, seq-steps/s, calls merged, server queue/h2d/kernel us). Reads
DIR/<variant>-r<round>/decode.json; variants in the order their directories first appear."""
import json
import re
import statistics
import sys
from pathlib import Path


def load(root: Path):
    runs = {}
    for d in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime):
        m = re.fullmatch(r"(.+)-r(\d+)", d.name)
        f = d / "decode.json"
        if m and f.exists():
            runs.setdefault(m.group(1), []).append(json.loads(f.read_text()))
    return runs


def cell(rows):
    good = [r for r in rows if "error" not in r]
    if not good:
        return "failed"

    def med(key):
        return statistics.median(r.get(key, 0) for r in good)

    stages = "-".join(f"{med(f'server_{k}_us'):.0f}" for k in ("queue", "h2d", "kernel"))
    return (f"{med('p50_ms'):.3f} / {med('p99_ms'):.2f} / {med('seq_steps_per_s'):.0f} / "
            f"{med('batched_calls_mean'):.2f} / {stages}")


def main() -> int:
    runs = load(Path(sys.argv[1]))
    if not runs:
        print("decode_ab_table: no decode.json found")
        return 1
    keys, by = [], {}
    for variant, rounds in runs.items():
        for rows in rounds:
            for r in rows:
                if not r.get("path", "").startswith("sequences"):
                    continue
                k = (r["context"], r["path"], r["concurrency"])
                if k not in by:
                    keys.append(k)
                    by[k] = {}
                by[k].setdefault(variant, []).append(r)
    names = list(runs)
    print(f"rounds: {', '.join(f'{n} {len(runs[n])}' for n in names)}; each cell: median over rounds of "
          "p50 ms / p99 ms / seq-steps/s / calls merged / server queue-h2d-kernel us (p50)\n")
    print("| context | path | clients | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for k in sorted(keys, key=lambda k: (k[0], k[1], k[2])):
        print(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cell(by[k].get(n, [])) for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
