#!/usr/bin/env bash
# Configure + build (kernels, GPU tests, benchmark; no gRPC) + GPU tests + compute-sanitizer +
# benchmark, on the GPU machine, in one go. Logs and tables go to $OUT (default ./gpu-out).
#   bench/kernels/run_on_gpu.sh [all|build|test|sanitize|bench|autotune|profile|sass]...   (default: all;
#   autotune, profile and sass run only when named)
# Needs a GoogleTest source tree at .deps/googletest (a copy of /usr/src/googletest).
# CUDA_ARCHS (default "80;90") and BUILD_TARGETS (default: all) narrow the build.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
BUILD=${BUILD:-build-gpu}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)
want() { for s in "${steps[@]}"; do [ "$s" = all ] || [ "$s" = "$1" ] && return 0; done; return 1; }
named() { for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tail -1

if want build; then
  start=$(date +%s)
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHSERVE_BUILD_SERVER=OFF \
    -DFLASHSERVE_GTEST_SOURCE_DIR=$PWD/.deps/googletest -DFLASHSERVE_CUDA_ARCHS="${CUDA_ARCHS:-80;90}" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  cmake --build "$BUILD" -j 16 ${BUILD_TARGETS:+--target $BUILD_TARGETS} >> "$OUT/build.log" 2>&1 || { grep -B2 -A10 -m5 "error" "$OUT/build.log"; tail -20 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"; grep -i "warning" "$OUT/build.log" | head -20
fi
if want test; then
  (cd "$BUILD" && FLASHSERVE_REQUIRE_GPU=1 timeout ${TEST_TIMEOUT:-420} ctest -L gpu -j 16 --output-on-failure --timeout 600 > "$OUT/ctest-gpu.log" 2>&1)
  echo "ctest gpu rc=$?"; tail -5 "$OUT/ctest-gpu.log"; grep -m3 "seed" "$OUT/ctest-gpu.log"
  grep -A15 "Failure\|FAILED" "$OUT/ctest-gpu.log" | head -60
fi
if want sanitize; then
  t="$BUILD/tests/gpu/cuda_attention_test"
  f='Grid/CudaAttention.MatchesReference/bf16_d64_b1_sq17_sk17_h3x3_causal:Grid/CudaAttention.MatchesReference/fp16_d128_b1_sq65_sk65_h3x3:Grid/CudaAttention.MatchesReference/bf16_d128_b1_sq200_sk17_h2x1_causal:CudaAttentionLayout.PaddedStrides'
  for tool in memcheck racecheck; do
    timeout ${SANITIZE_TIMEOUT:-120} compute-sanitizer --tool $tool --error-exitcode 9 "$t" --gtest_filter="$f" > "$OUT/sanitizer-$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1)"
  done
  # The sm90 family (skips off sm_90): small shapes through the TMA/mbarrier/wgmma pipeline.
  t="$BUILD/tests/gpu/sm90_attention_test"
  f='Grid/Sm90Attention.MatchesFp64Reference/bf16_d128_b1_sq129_sk129_h3x3_causal:Grid/Sm90Attention.MatchesFp64Reference/fp16_d64_b2_sq77_sk77_h4x2_causal_pad8:Grid/Sm90Attention.MatchesFp64Reference/bf16_d64_b1_sq200_sk17_h2x1_causal:Grid/Sm90Attention.MatchesFp64Reference/fp16_d128_b2_sq97_sk300_h8x1'
  if [ -x "$t" ]; then
    for tool in memcheck racecheck synccheck; do
      timeout ${SANITIZE_TIMEOUT:-120} compute-sanitizer --tool $tool --error-exitcode 9 "$t" --gtest_filter="$f" > "$OUT/sanitizer-sm90-$tool.log" 2>&1
      echo "compute-sanitizer sm90 $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|Tests|PASSED|FAILED' "$OUT/sanitizer-sm90-$tool.log" | tail -2 | tr '\n' ' ')"
    done
  fi
fi
if want bench; then
  PYTHONUNBUFFERED=1 timeout ${BENCH_TIMEOUT:-400} python3 bench/kernels/bench_vs_torch.py --lib "$BUILD/kernels/cuda/libflashserve_kernels_capi.so" \
    ${BENCH_ARGS:-} --out "$OUT/bench.md" 2> "$OUT/bench.err" | tee "$OUT/bench-live.md"
  tail -5 "$OUT/bench.err"
fi
if named autotune; then
  PYTHONUNBUFFERED=1 timeout ${AUTOTUNE_TIMEOUT:-300} python3 bench/kernels/autotune_bench.py --lib "$BUILD/kernels/cuda/libflashserve_kernels_capi.so" \
    ${AUTOTUNE_ARGS:-} --out "$OUT/autotune.md" 2> "$OUT/autotune.err" | tee "$OUT/autotune-live.md" | tail -4
  tail -5 "$OUT/autotune.err"
fi
if named profile; then
  # Nsight Compute on the default d=128 config at S=4096 (B16 H16), non-causal and causal: one
  # warm launch each (5 warm-up launches skipped). --clock-control none: leave the clocks alone.
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for causal in 0 1; do
    rep="$OUT/ncu-d128-s4096-c$causal"
    timeout ${PROFILE_TIMEOUT:-200} "$ncu" --clock-control none -k regex:'flash_fwd_kernel|sm90_fwd_kernel' --launch-skip 5 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section SourceCounters --section LaunchStats --section Occupancy \
      -f -o "$rep" "$BUILD/bench/kernels/kernel_bench" --d 128 --causal $causal --b 16 --h 16 --hkv 16 --sq 4096 --sk 4096 \
      > "$rep.log" 2>&1
    echo "ncu causal=$causal rc=$?"
    "$ncu" --import "$rep.ncu-rep" --page details --print-details all > "$rep.txt" 2>&1
    grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per|Local Memory|No Eligible|Executed Ipc A" "$rep.txt" | head -12
  done
fi
if named sass; then
  # SASS of the d=128 bf16 default instance (sm_90): instruction mix of the kernel.
  obj=$(find "$BUILD" -name 'flash_fwd_bf16_hd128_m128n64w4s2.cu.o' | head -1)
  cuobjdump --dump-sass -arch sm_90 "$obj" > "$OUT/sass-bf16-hd128-m128n64w4s2.txt" 2>&1
  echo "sass: $(wc -l < "$OUT/sass-bf16-hd128-m128n64w4s2.txt") lines"
fi
