#!/usr/bin/env bash
# One device call for the sm90 family: build (kernels, capi, sm90/tuner tests; no gRPC), the sm90
# GPU tests (8 shards, fresh seeds), compute-sanitizer racecheck / synccheck / memcheck on small
# shapes (logs printed, not only counted; every sm90 configuration runs on each shape), then the
# side-by-side A/B (tools/ab_bench.py). BUDGET (s, default 400) bounds the benchmarks.
#   kernels/cuda/sm90/tools/gpu_check.sh [build] [test] [sanitize] [old] [grid] [bench] [mutant]
# (default: all but grid and mutant; grid = bench/kernels/bench_vs_torch.py --sm90-configs, the
# results table, with $GRID_ARGS, e.g. "--rounds 3"; mutant: the dispatch test rebuilt against the
# old block_n rule must fail). CMAKE_EXTRA: more configure arguments (e.g. a narrower build:
# -DFLASHSERVE_CUDA_ARCHS=90 "-DFLASHSERVE_KERNEL_HEAD_DIMS=64;128").
# "old": racecheck of a second tree unpacked from $OLD_TAR (e.g. the previous commit, built the
# same way) on the shapes that reuse Q buffers, to name what it reports. Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-$PWD/gpu-out}
BUILD=${BUILD:-build-gpu}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test sanitize old bench)
want() { for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
TARGETS=${TARGETS:-"sm90_attention_test tuner_test flashserve_kernels_capi"}
configure() {  # <src> <build> [extra cmake args]
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHSERVE_BUILD_SERVER=OFF \
    -DFLASHSERVE_GTEST_SOURCE_DIR=$PWD/.deps/googletest -DCMAKE_CUDA_FLAGS=-lineinfo "${@:3}"
}
if want old && [ -f "${OLD_TAR:-}" ]; then  # built in the background while the rest runs
  (rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf "$OLD_TAR" -C /tmp/old &&
   configure /tmp/old /tmp/old/build -DFLASHSERVE_CUDA_ARCHS=90 -DFLASHSERVE_KERNEL_DTYPES=bf16 &&
   cmake --build /tmp/old/build -j 6 --target sm90_attention_test) > "$OUT/old-build.log" 2>&1 &
  old_pid=$!
fi
if want build; then
  start=$(date +%s)
  configure . "$BUILD" ${CMAKE_EXTRA:-} > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  cmake --build "$BUILD" -j 12 --target $TARGETS >> "$OUT/build.log" 2>&1 ||
    { grep -B2 -A12 -m5 "error" "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"; grep -i "warning" "$OUT/build.log" | head -10
  # ptxas reports serialized wgmma (a wait after every wgmma: the sm90 kernel at sm80 speed) only
  # as "info" (C7513/C7514...), not as a warning; a predicated wgmma wait did that (results -d.md).
  grep -m3 "wgmma.mma_async instructions are serialized" "$OUT/build.log" &&
    echo "ERROR: ptxas serialized wgmma"
fi
T="$BUILD/tests/gpu/sm90_attention_test"
san() {  # <tool> <test binary> <gtest filter> <label>
  local log="$OUT/san-$4-$1.log"
  timeout ${SAN_TIMEOUT:-60} compute-sanitizer --tool "$1" --error-exitcode 9 "$2" --gtest_filter="$3" > "$log" 2>&1
  echo "== compute-sanitizer $1 ($4) rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
  grep -E "PASSED|FAILED|seed" "$log" | head -4
  grep -vE "^\[ |^$|sm90_attention_test seed" "$log" | grep -v "^Note" | head -${SAN_LINES:-40}
  { echo "##### $1 $4"; cat "$log"; } >> "$OUT/san.log"; rm -f "$log"
}
G=Grid/Sm90Attention.MatchesFp64Reference
SHAPES="$G/bf16_d128_b1_sq129_sk129_h3x3_causal:$G/bf16_d64_b2_sq130_sk130_h80x8_causal:$G/fp16_d128_b3_sq65_sk65_h100x4:$G/bf16_d64_b1_sq1025_sk65_h3x3_causal:$G/fp16_d64_b2_sq77_sk77_h4x2_causal_pad8"
if want sanitize; then
  SAN_TIMEOUT=90 san racecheck "$T" "$SHAPES" new
fi
if want test; then
  start=$(date +%s)
  for i in 0 1 2 3 4 5 6 7; do
    GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 200 "$T" > "$OUT/t$i.log" 2>&1 &
  done
  wait $(jobs -p | grep -v "^${old_pid:-x}$")
  cat "$OUT"/t?.log > "$OUT/tests.log"; rm -f "$OUT"/t?.log
  echo "sm90 tests ($(( $(date +%s) - start )) s): $(grep -c '^\[       OK' "$OUT/tests.log") OK, $(grep -c '^\[  FAILED  \].*ms)' "$OUT/tests.log") FAILED, $(grep -c '^\[  SKIPPED' "$OUT/tests.log") SKIPPED; seeds: $(grep -h 'seed:' "$OUT/tests.log" | awk '{print $NF}' | tr '\n' ' ')"
  grep -h -B3 -A12 "Failure" "$OUT/tests.log" | head -50
  timeout 60 "$BUILD/tests/gpu/tuner_test" > "$OUT/tuner.log" 2>&1; echo "tuner_test rc=$?: $(grep -E 'PASSED|FAILED' "$OUT/tuner.log" | head -2 | tr '\n' ' ')"
  cat "$OUT/tuner.log" >> "$OUT/tests.log"; rm -f "$OUT/tuner.log"
fi
if want sanitize; then
  san synccheck "$T" "$SHAPES" new
  SAN_LINES=10 san memcheck "$T" "$SHAPES" new
fi
if want old && [ -n "${old_pid:-}" ]; then
  wait "$old_pid"; echo "old build rc=$?"; tail -3 "$OUT/old-build.log"
  SAN_LINES=60 san racecheck /tmp/old/build/tests/gpu/sm90_attention_test \
    "$G/bf16_d128_b1_sq129_sk129_h3x3_causal:$G/bf16_d64_b2_sq130_sk130_h80x8_causal:$G/bf16_d64_b1_sq1025_sk65_h3x3_causal" old
fi
if want grid; then  # the results grid (bench/kernels/bench_vs_torch.py), every sm90 candidate too
  PYTHONUNBUFFERED=1 timeout $(( ${BUDGET:-400} - ${BENCH_RESERVE:-0} - SECONDS )) python3 \
    bench/kernels/bench_vs_torch.py --lib "$BUILD/kernels/cuda/libflashserve_kernels_capi.so" \
    --sm90-configs ${GRID_ARGS:-} --out "$OUT/grid.md" 2>> "$OUT/bench.err"
  tail -3 "$OUT/bench.err"
fi
if want bench; then
  # What is left of the call's ${BUDGET:-400} s (the run's limit is a little more).
  PYTHONUNBUFFERED=1 timeout $(( ${BUDGET:-400} - SECONDS )) python3 kernels/cuda/sm90/tools/ab_bench.py \
    --lib "$BUILD/kernels/cuda/libflashserve_kernels_capi.so" ${BENCH_ARGS:-} 2>> "$OUT/bench.err" | tee "$OUT/ab.md"
  tail -3 "$OUT/bench.err"
fi
if want mutant; then
  cp kernels/cuda/flash_fwd_dispatch.cu /tmp/dispatch.bak
  sed -i 's/p.seqlen_q >= 8192 \&\& p.seqlen_k >= 8192/p.seqlen_k >= 8192/' kernels/cuda/flash_fwd_dispatch.cu
  grep -c "p.seqlen_q >= 8192" kernels/cuda/flash_fwd_dispatch.cu
  cmake --build "$BUILD" -j 16 --target sm90_attention_test > /dev/null 2>&1 &&
    "$T" --gtest_filter='Sm90Dispatch.BlockN*' 2>&1 | grep -E "Failure|Which is|Expected|FAILED|PASSED" | head -8
  cp /tmp/dispatch.bak kernels/cuda/flash_fwd_dispatch.cu
fi
