#!/usr/bin/env bash
# CPU smoke of the load generators' command line (no GPU): an unknown or malformed flag is refused with exit 2, and
# against a CPU server started with a bearer token (--auth_token_file), flashserve-loadgen and
# flashserve-decode-loadgen are refused without --token and measure every path with it: flashserve-loadgen's unary
# grid (and the echo beside it), striped streaming (K=1,2), system shm over KServe gRPC and the local socket (Hello,
# inline, system shm); flashserve-decode-loadgen over gRPC (also with each step split in two calls, and the echo) and
# over the local socket with system shm. Fails unless
# every such row was measured without an error. Numbers are not checked (a shared 2-core box), only that they exist.
#   bench/service/smoke_cli_cpu.sh [BUILD_DIR, default build]   (FLASHSERVE_BIN overrides the server binary)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
BUILD=${1:-build}
BIN=${FLASHSERVE_BIN:-$BUILD/server/flashserve}
LOADGEN=$BUILD/bench/service/flashserve-loadgen
DECODE=$BUILD/bench/service/flashserve-decode-loadgen
ECHO=$BUILD/bench/service/flashserve-echo
for b in "$BIN" "$LOADGEN" "$DECODE" "$ECHO"; do [[ -x $b ]] || { echo "smoke: $b missing"; exit 2; }; done
WORK=$(mktemp -d /tmp/fs-smoke-cli.XXXXXX)
fail=0
check() { [[ $1 == 0 ]] || { echo "smoke: FAIL: $2"; fail=1; }; }

# Bad command lines: usage on stderr, exit 2, before any connection is made.
for args in "--durration_s=1" "--concurrency=1,x" "--duration_s=fast" "--target" "--shapes=tiny"; do
  "$LOADGEN" "$args" >/dev/null 2>"$WORK/bad.log"
  rc=$?; grep -q '^usage: flashserve-loadgen' "$WORK/bad.log"; check $((rc != 2 || $?)) "loadgen $args: exit $rc"
done
for args in "--steps=1O" "--sequence=4" "--mode=full" "--split=0" "--split=9"; do
  "$DECODE" "$args" >/dev/null 2>"$WORK/bad.log"
  rc=$?; grep -q '^usage: flashserve-decode-loadgen' "$WORK/bad.log"; check $((rc != 2 || $?)) "decode $args: exit $rc"
done
"$ECHO" --port=80x >/dev/null 2>&1; check $(($? != 2)) "echo --port=80x"

TOKEN=smoke-token-$RANDOM-$RANDOM-0123456789
printf '%s' "$TOKEN" >"$WORK/token"
SOCK=$WORK/fs.sock
source "$(dirname "${BASH_SOURCE[0]}")/free_ports.sh"
read -r GRPC HTTP METRICS <<<"$(free_ports 3)"
"$BIN" --backend=cpu --host=127.0.0.1 --grpc_port="$GRPC" --http_port="$HTTP" --metrics_port="$METRICS" \
  --auth_token_file="$WORK/token" --allow_client_shm --local_socket="$SOCK" --kv_cache_bytes=$((256 << 20)) \
  --log_level=warn >"$WORK/server.log" 2>&1 &
SERVER=$!
"$ECHO" --host=127.0.0.1 --port=0 >"$WORK/echo.log" 2>&1 &
ECHO_PID=$!
trap 'kill $SERVER $ECHO_PID 2>/dev/null; wait $SERVER $ECHO_PID 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 1 100); do [[ -S $SOCK ]] && grep -q '^listening on' "$WORK/echo.log" && break; sleep 0.1; done
[[ -S $SOCK ]] || { echo "smoke: no socket at $SOCK"; cat "$WORK/server.log"; exit 1; }
ECHO_PORT=$(sed -n 's/^listening on //p' "$WORK/echo.log")

lg=("$LOADGEN" --target="127.0.0.1:$GRPC" --echo="127.0.0.1:$ECHO_PORT" --shapes=small "--concurrency=1,2"
  --duration_s=0.3 "--stripes=1,2" --stripe_reps=1 --striped_shapes=small --shm=system --local_socket="$SOCK"
  --local_shm=system --csv="$WORK/s.csv" --md="$WORK/s.md")
"${lg[@]}" >/dev/null 2>"$WORK/no-token.log"
rc=$?; grep -q 'warm-up failed: 16: ' "$WORK/no-token.log"; check $((rc == 0 || $?)) "loadgen without --token: exit $rc"
"${lg[@]}" --token="$TOKEN" >/dev/null 2>"$WORK/token.log"; check $? "loadgen --token: exit $?"
# CSV rows: target, shape, concurrency, channels, ok, errors, ...: two rows (c=1,2) per path, each ok > 0, 0 errors.
for target in flashserve echo shm_system local_inline local_system; do
  good=$(awk -F, -v t="$target" '$1 == t && $5 > 0 && $6 == 0' "$WORK/s.csv" | wc -l)
  check $((good != 2)) "loadgen --token: $target: $good good rows of 2"
done
striped=$(awk '/^### /{on = /^### Striped/} on' "$WORK/s.md" | grep -cE '^\| small \| [12] \| [0-9.]+ \|')
check $((striped != 2)) "loadgen --token: striped: $striped rows of 2"
grep -E 'failed|O check' "$WORK/s.md" && check 1 "loadgen --token: a failed row"

dec=("$DECODE" --target="127.0.0.1:$GRPC" --context=64 --sequences=4 "--concurrency=1,2" --steps=5 --warmup=1)
out=$("${dec[@]}" 2>&1); check $(($? == 0)) "decode without --token succeeded: $out"
for variant in "" "--local_socket=$SOCK --shm=system"; do
  # shellcheck disable=SC2086
  out=$("${dec[@]}" --token="$TOKEN" $variant 2>&1)
  rc=$?; check $((rc != 0 || $(grep -c '"p50_ms"' <<<"$out") != 2)) "decode --token $variant: exit $rc: $out"
done
# Split steps (each client's step as 2 calls at once) and their echo: 4 rows (c=1,2 x split 1,2), each with its echo.
out=$("${dec[@]}" --token="$TOKEN" "--split=1,2" --echo="127.0.0.1:$ECHO_PORT" 2>&1)
rc=$?; check $((rc != 0 || $(grep -c '"echo_p50_ms"' <<<"$out") != 4 || $(grep -c 'split 2"' <<<"$out") != 2)) \
  "decode --token --split=1,2: exit $rc: $out"
(( fail )) && { tail -n 20 "$WORK/token.log"; echo "smoke: FAILED"; exit 1; }
echo "smoke: command line and bearer token OK"
