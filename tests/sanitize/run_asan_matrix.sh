#!/usr/bin/env bash
# The bad-input matrix under AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer).
# Builds the server and the C++ tests with -fsanitize=address,undefined (Debug, CPU backend, the
# default compiler) into build-asan, runs the C++ unit tests, then the Python bad-input matrix
# against the sanitized server, and fails if a test fails or any sanitizer report appears in
# the server's stderr (the matrix starts its servers through tests/python/conftest.py, whose
# logs are kept under build-asan/pytest).
#
#   tests/sanitize/run_asan_matrix.sh                  # C++ tests + test_bad_input_matrix.py
#   tests/sanitize/run_asan_matrix.sh tests/python/test_faults.py   # more Python files, same checks
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
BUILD_DIR=${BUILD_DIR:-$REPO/build-asan}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
SUPPRESSIONS=$REPO/tests/sanitize/lsan.supp

mkdir -p "$BUILD_DIR"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
echo "== configure ($BUILD_DIR)"
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer" \
  -DFLASHSERVE_ENABLE_CUDA=OFF -DFLASHSERVE_BUILD_BENCH=OFF -DFLASHSERVE_BUILD_SERVER=ON \
  >"$BUILD_DIR/configure.log" 2>&1 || { cat "$BUILD_DIR/configure.log"; exit 1; }
echo "== build"
cmake --build "$BUILD_DIR" -j"$(nproc)" >"$BUILD_DIR/build.log" 2>&1 || { tail -60 "$BUILD_DIR/build.log"; exit 1; }

# halt_on_error: the first report ends the process, so a test sees it die. detect_leaks: reports
# at exit (the server exits 0 only when it has none). The slow unwinder gives full stacks through
# the system gRPC libraries (built without frame pointers), which lsan.supp matches on.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$SUPPRESSIONS:print_suppressions=1:fast_unwind_on_malloc=0"

status=0
echo "== ctest (C++ unit tests, sanitized)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" --timeout 900 >"$BUILD_DIR/ctest.log" 2>&1 || status=1
tail -5 "$BUILD_DIR/ctest.log"

echo "== pytest (bad-input matrix against the sanitized server)"
rm -rf "$BUILD_DIR/pytest"
FLASHSERVE_BIN="$BUILD_DIR/server/flashserve" "$PYTHON" -m pytest -q -p no:cacheprovider \
  --tb=line -rxX --basetemp="$BUILD_DIR/pytest" tests/python/test_bad_input_matrix.py "$@" 2>&1 | tee "$BUILD_DIR/pytest.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# Any report in any server's stderr (or a unit test's output) fails the run, even if the process
# lived on (a report in a thread that did not halt, or one printed at exit).
pattern='ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|SUMMARY: UndefinedBehaviorSanitizer|WARNING: ThreadSanitizer'
reports=$(grep -lE "$pattern" "$BUILD_DIR"/pytest -r --include='*.stderr' --include='*.stdout' 2>/dev/null || true)
if grep -qE "$pattern" "$BUILD_DIR/ctest.log"; then reports="$reports $BUILD_DIR/ctest.log"; fi
servers=$(find "$BUILD_DIR/pytest" -name '*.stderr' | wc -l)
if [ -n "${reports// /}" ]; then
  echo "!! sanitizer reports in:"
  for f in $reports; do echo "  $f"; grep -m3 -E "$pattern" "$f" | sed 's/^/    /'; done
  status=1
fi
suppressed=$(grep -h -A3 'Suppressions used' "$BUILD_DIR"/pytest -r --include='*.stderr' 2>/dev/null | grep -E '^ *[0-9]+ +[0-9]+ ' | sort | uniq -c || true)
[ -n "$suppressed" ] && echo "LeakSanitizer suppressions used (count, leaks, bytes, pattern):" && echo "$suppressed"
if [ "$status" -eq 0 ]; then
  echo "run_asan_matrix.sh: passed; $servers sanitized server processes, no sanitizer reports"
else
  echo "run_asan_matrix.sh: FAILED"
fi
exit "$status"
