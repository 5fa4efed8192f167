#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan) into build-fuzz and runs each over its seed
# corpus for a short time; exits non-zero if any target crashes, leaks, trips a sanitizer or
# breaks one of its checks. CI calls it as is; a longer campaign: FUZZ_SECONDS_PER_TARGET=600.
#
#   tests/fuzz/run_smoke.sh                   # 54 s of fuzzing split over the 9 targets (6 s each)
#   FUZZ_SECONDS_PER_TARGET=300 tests/fuzz/run_smoke.sh fuzz_tune_cache
#   FUZZ_BUILD_ONLY=1 tests/fuzz/run_smoke.sh   # configure and build the fuzzers, run none
#
# The seed corpus in tests/fuzz/corpus/<target>/ is only read; new inputs go to
# $BUILD_DIR/corpus/<target>/ and crash reproducers to $BUILD_DIR/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
BUILD_DIR=${BUILD_DIR:-$REPO/build-fuzz}
CXX_COMPILER=${FUZZ_CXX:-clang++}
TOTAL_SECONDS=${FUZZ_TOTAL_SECONDS:-54}

command -v "$CXX_COMPILER" >/dev/null || { echo "run_smoke.sh: $CXX_COMPILER not found (apt-get install clang)"; exit 2; }
mkdir -p "$BUILD_DIR"
common_args=(-G Ninja -DCMAKE_CXX_COMPILER="$CXX_COMPILER" -DCMAKE_BUILD_TYPE=RelWithDebInfo
             -DFLASHSERVE_ENABLE_CUDA=OFF -DFLASHSERVE_BUILD_BENCH=OFF -DFLASHSERVE_BUILD_SERVER=ON
             -DFLASHSERVE_BUILD_FUZZERS=ON)
command -v ninja >/dev/null || common_args=("${common_args[@]:2}")
if grep -qE '^\s*add_subdirectory\(fuzz\)' tests/CMakeLists.txt; then
  source_dir=$REPO
  bin_dir=$BUILD_DIR/tests/fuzz
  extra_args=(-DFLASHSERVE_BUILD_TESTS=ON)
else
  # tests/CMakeLists.txt does not add tests/fuzz (yet): a two-line wrapper project adds both.
  source_dir=$BUILD_DIR/wrapper
  mkdir -p "$source_dir"
  cat >"$source_dir/CMakeLists.txt" <<WRAPPER
cmake_minimum_required(VERSION 3.25)
project(flashserve_fuzz_wrapper CXX)
set(CMAKE_FIND_PACKAGE_TARGETS_GLOBAL ON)  # the project's imported targets, visible in tests/fuzz
add_subdirectory("$REPO" flashserve)
add_subdirectory("$REPO/tests/fuzz" fuzz)
WRAPPER
  bin_dir=$BUILD_DIR/fuzz
  extra_args=(-DFLASHSERVE_BUILD_TESTS=OFF)
fi
# A build dir configured from the other source (wrapper <-> repository) is rebuilt from scratch.
if [ -f "$BUILD_DIR/CMakeCache.txt" ] &&
   ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$source_dir" "$BUILD_DIR/CMakeCache.txt"; then
  echo "run_smoke.sh: $BUILD_DIR was configured from another source directory; starting it afresh"
  find "$BUILD_DIR" -mindepth 1 -maxdepth 1 ! -name corpus ! -name wrapper -exec rm -rf {} +
fi
echo "== configure ($BUILD_DIR, $("$CXX_COMPILER" --version | head -1))"
cmake -S "$source_dir" -B "$BUILD_DIR" "${common_args[@]}" "${extra_args[@]}" >"$BUILD_DIR/configure.log" 2>&1 || {
  cat "$BUILD_DIR/configure.log"; exit 1; }
echo "== build"
cmake --build "$BUILD_DIR" --target fuzzers -j"$(nproc)" >"$BUILD_DIR/build.log" 2>&1 || {
  tail -50 "$BUILD_DIR/build.log"; exit 1; }
if [ "${FUZZ_BUILD_ONLY:-0}" = 1 ]; then echo "run_smoke.sh: fuzzers built in $BUILD_DIR; FUZZ_BUILD_ONLY=1: none run"; exit 0; fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for dir in tests/fuzz/corpus/*/; do
    t=$(basename "$dir")
    [ -x "$bin_dir/$t" ] && targets+=("$t")
  done
fi
seconds=${FUZZ_SECONDS_PER_TARGET:-$(( TOTAL_SECONDS / ${#targets[@]} ))}

failed=()
for t in "${targets[@]}"; do
  binary=$bin_dir/$t
  [ -x "$binary" ] || { echo "run_smoke.sh: no binary $binary"; failed+=("$t"); continue; }
  work=$BUILD_DIR/corpus/$t
  artifacts=$BUILD_DIR/artifacts/$t/
  mkdir -p "$work" "$artifacts"
  args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
        -artifact_prefix="$artifacts")
  [ -f "tests/fuzz/$t.dict" ] && args+=(-dict="tests/fuzz/$t.dict")
  echo "== $t: ${seconds} s"
  log=$BUILD_DIR/$t.log
  if ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
      "$binary" "${args[@]}" "$work" "tests/fuzz/corpus/$t" >"$log" 2>&1; then
    grep -E '^#[0-9]+ +DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb' "$log" || true
  else
    echo "!! $t FAILED (log: $log; reproducer under $artifacts):"
    grep -B2 -A30 -E 'ERROR: |FUZZ_CHECK failed|runtime error' "$log" | head -60 || tail -40 "$log"
    failed+=("$t")
  fi
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "run_smoke.sh: FAILED: ${failed[*]}"
  exit 1
fi
echo "run_smoke.sh: ${#targets[@]} targets, ${seconds} s each, no crashes"
