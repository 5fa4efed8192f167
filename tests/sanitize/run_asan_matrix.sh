#!/usr/bin/env bash
# The server under AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer).
# Builds with -fsanitize=address,undefined (Debug, CPU backend, the default compiler) into
# build-asan, runs the C++ unit tests, then Python end-to-end tests against the sanitized server
# and, if asked, a soak (tests/soak/soak.py), and fails if a test fails or any sanitizer report
# appears in a server's stderr (the Python tests start their servers through
# tests/python/conftest.py, whose logs are kept under build-asan/pytest; the soak's log is
# build-asan/soak/soak-server.log). The build leaves the malloc replacement out (server/CMakeLists.txt
# defaults FLASHSERVE_RECEIVE_ARENA to OFF with -fsanitize and refuses ON); this script checks it.
#
#   tests/sanitize/run_asan_matrix.sh                  # C++ tests + test_bad_input_matrix.py
#   tests/sanitize/run_asan_matrix.sh tests/python/test_faults.py   # more Python files, same checks
#   ASAN_TARGETS="flashserve kvcache_test" ASAN_SOAK_MINUTES=2 tests/sanitize/run_asan_matrix.sh FILES...
#       # what .ci/run does: only the server and the *_test binaries named are built, those tests run
#       # whole, FILES are run instead of the matrix, then a 2-minute soak (RSS growth not judged:
#       # ASan's quarantine holds freed memory)
#   ASAN_BUILD_ONLY=1 ASAN_TARGETS=... tests/sanitize/run_asan_matrix.sh
#       # configure and build, then stop (.ci/run builds ahead, in the background, this way)
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
BUILD_DIR=${BUILD_DIR:-$REPO/build-asan}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
SUPPRESSIONS=$REPO/tests/sanitize/lsan.supp
TARGETS=${ASAN_TARGETS:-}              # empty: everything (server + C++ tests, then ctest)
SOAK_MINUTES=${ASAN_SOAK_MINUTES:-0}   # 0: no soak
BUILD_ONLY=${ASAN_BUILD_ONLY:-0}       # 1: stop after the build
PYTEST_FILES=("$@")
if [ -n "$TARGETS" ] && [ ${#PYTEST_FILES[@]} -eq 0 ]; then PYTEST_FILES=(tests/python/test_bad_input_matrix.py); fi
if [ -z "$TARGETS" ]; then PYTEST_FILES=(tests/python/test_bad_input_matrix.py "${PYTEST_FILES[@]}"); fi
start=$(date +%s)

mkdir -p "$BUILD_DIR"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
echo "== configure ($BUILD_DIR)"
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer" \
  -DFLASHSERVE_ENABLE_CUDA=OFF -DFLASHSERVE_BUILD_BENCH=OFF -DFLASHSERVE_BUILD_SERVER=ON \
  >"$BUILD_DIR/configure.log" 2>&1 || { cat "$BUILD_DIR/configure.log"; exit 1; }
if ! grep -q '^FLASHSERVE_RECEIVE_ARENA:BOOL=OFF' "$BUILD_DIR/CMakeCache.txt"; then
  echo "!! the sanitized build would link the malloc replacement (FLASHSERVE_RECEIVE_ARENA is not OFF)"
  exit 1
fi
echo "== build ${TARGETS:-all targets} ($(( $(date +%s) - start )) s)"
target_args=()
for t in $TARGETS; do target_args+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j"$(nproc)" "${target_args[@]}" >"$BUILD_DIR/build.log" 2>&1 || {
  tail -60 "$BUILD_DIR/build.log"; exit 1; }
if nm -C "$BUILD_DIR/server/flashserve" | grep -qE ' T (malloc|free)$'; then
  echo "!! the sanitized server defines malloc/free itself (malloc replacement linked in)"
  exit 1
fi
if [ "$BUILD_ONLY" = 1 ]; then
  echo "run_asan_matrix.sh: built ${TARGETS:-all targets} in $BUILD_DIR ($(( $(date +%s) - start )) s); ASAN_BUILD_ONLY=1: no tests run"
  exit 0
fi

# halt_on_error: the first report ends the process, so a test sees it die. detect_leaks: reports
# at exit (the server exits 0 only when it has none). The slow unwinder gives full stacks through
# the system gRPC libraries (built without frame pointers), which lsan.supp matches on.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$SUPPRESSIONS:print_suppressions=1:fast_unwind_on_malloc=0"

status=0
rm -f "$BUILD_DIR/ctest.log"
unit_tests=()
for t in $TARGETS; do [[ $t == *_test ]] && unit_tests+=("$t"); done
if [ -z "$TARGETS" ]; then
  echo "== ctest (C++ unit tests, sanitized) ($(( $(date +%s) - start )) s)"
  ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" --timeout 900 >"$BUILD_DIR/ctest.log" 2>&1 || status=1
  tail -5 "$BUILD_DIR/ctest.log"
elif ((${#unit_tests[@]})); then
  # The *_test targets named in ASAN_TARGETS (GoogleTest binaries), run whole.
  echo "== C++ unit tests, sanitized: ${unit_tests[*]} ($(( $(date +%s) - start )) s)"
  : >"$BUILD_DIR/ctest.log"
  for t in "${unit_tests[@]}"; do
    bin=$(find "$BUILD_DIR/tests" -type f -name "$t" -perm -u+x | head -n 1)
    if [ -z "$bin" ]; then echo "!! no $t built in $BUILD_DIR/tests"; status=1; continue; fi
    "$bin" >>"$BUILD_DIR/ctest.log" 2>&1 || { echo "!! $t failed"; status=1; }
    grep -E '^\[  (PASSED|FAILED) ' "$BUILD_DIR/ctest.log" | tail -n 2
  done
fi

echo "== pytest against the sanitized server: ${PYTEST_FILES[*]} ($(( $(date +%s) - start )) s)"
rm -rf "$BUILD_DIR/pytest"
# (pipefail: the pipeline fails when pytest does; `if` keeps set -e from ending the script before
# the report scan below.)
if ! FLASHSERVE_BIN="$BUILD_DIR/server/flashserve" "$PYTHON" -m pytest -q -p no:cacheprovider \
  --tb=line -rsxX --basetemp="$BUILD_DIR/pytest" "${PYTEST_FILES[@]}" 2>&1 | tee "$BUILD_DIR/pytest.log" | tail -15; then
  status=1
fi

rm -rf "$BUILD_DIR/soak"
if [ "$SOAK_MINUTES" != 0 ]; then
  echo "== soak, $SOAK_MINUTES min, against the sanitized server ($(( $(date +%s) - start )) s)"
  # RSS growth is not judged (--max-growth inf): ASan keeps freed memory in its quarantine.
  # Wrong answers, unexpected errors, a death, a non-zero exit (LeakSanitizer at exit) still fail.
  "$PYTHON" tests/soak/soak.py --minutes "$SOAK_MINUTES" --warmup 0.5 --max-growth inf \
    --binary "$BUILD_DIR/server/flashserve" --out "$BUILD_DIR/soak" >"$BUILD_DIR/soak.log" 2>&1 || status=1
  grep -E "^(soak done|RSS after|server:|FAIL|soak:)" "$BUILD_DIR/soak.log" || tail -20 "$BUILD_DIR/soak.log"
fi

# Any report in any server's stderr (or a unit test's output) fails the run, even if the process
# lived on (a report in a thread that did not halt, or one printed at exit).
pattern='ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|SUMMARY: UndefinedBehaviorSanitizer|WARNING: ThreadSanitizer'
reports=$(grep -lE "$pattern" "$BUILD_DIR"/pytest -r --include='*.stderr' --include='*.stdout' 2>/dev/null || true)
for log in "$BUILD_DIR/ctest.log" "$BUILD_DIR/soak/soak-server.log"; do
  if [ -f "$log" ] && grep -qE "$pattern" "$log"; then reports="$reports $log"; fi
done
servers=$(find "$BUILD_DIR/pytest" -name '*.stderr' | wc -l)
if [ -n "${reports// /}" ]; then
  echo "!! sanitizer reports in:"
  for f in $reports; do echo "  $f"; grep -m3 -E "$pattern" "$f" | sed 's/^/    /'; done
  status=1
fi
suppressed=$(grep -h -A3 'Suppressions used' "$BUILD_DIR"/pytest "$BUILD_DIR/soak" -r --include='*.stderr' --include='*.log' 2>/dev/null | grep -E '^ *[0-9]+ +[0-9]+ ' | sort | uniq -c || true)
[ -n "$suppressed" ] && echo "LeakSanitizer suppressions used (count, leaks, bytes, pattern):" && echo "$suppressed"
if [ "$status" -eq 0 ]; then
  echo "run_asan_matrix.sh: passed; $servers sanitized server processes (+ the soak's if run), no sanitizer reports ($(( $(date +%s) - start )) s)"
else
  echo "run_asan_matrix.sh: FAILED ($(( $(date +%s) - start )) s)"
fi
exit "$status"
