#!/usr/bin/env bash
# Decode-step A/B on a GPU machine (issue 20): bench/service/run_decode_on_gpu.sh once per variant per round, the
# variants interleaved (round 1: A B C, round 2: A B C, ...) so that drift on the host hits each alike; each run
# into $OUT/ab/<variant>-r<round>/, then bench/service/decode_ab_table.py prints and writes the medians over the
# rounds ($OUT/ab.md) and everything is packed into $OUT/ab.tar.gz (the device tool returns at most 8 files).
#   AB_VARIANTS  one variant per line: "name|server binary|extra server flags" (the binary empty: the bundle's)
#   AB_ROUNDS    rounds (default 2)
# Everything else as for run_decode_on_gpu.sh (CPP_VARIANTS, CLIENT_SPIN_US, SHM, extra arguments to
# decode_bench.py, e.g. --contexts=1024 --full_kv_steps=0 --no-sdpa).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flashserve-decode-ab}
mkdir -p "$OUT/ab"
[[ -n ${AB_VARIANTS:-} ]] || { echo "run_decode_ab_on_gpu: set AB_VARIANTS (see the header)"; exit 2; }
for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  while IFS='|' read -r name bin flags; do
    [[ -n $name ]] || continue
    echo "== round $round: $name ($(date +%T))"
    mkdir -p "$OUT/ab/$name-r$round"
    OUT="$OUT/ab/$name-r$round" FLASHSERVE_BIN=${bin:-${FLASHSERVE_BIN:-}} SERVER_FLAGS="$flags ${SERVER_FLAGS:-}" \
      bash bench/service/run_decode_on_gpu.sh "$@" >"$OUT/ab/$name-r$round/run.log" 2>&1
    echo "   exit $? ($(date +%T))"
  done <<<"$AB_VARIANTS"
done
python3 bench/service/decode_ab_table.py "$OUT/ab" | tee "$OUT/ab.md"
tar -C "$OUT" -czf "$OUT/ab.tar.gz" ab ab.md
