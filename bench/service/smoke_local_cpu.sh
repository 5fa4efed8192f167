#!/usr/bin/env bash
# CPU smoke of the load generators' local-transport and shared-memory modes (no GPU): starts a CPU server with
# --allow_client_shm --local_socket and a KV cache, runs flashserve-loadgen's local cells (small shape: echo floor,
# inline, system shm) and flashserve-decode-loadgen's variants (local, local + system shm, gRPC + system shm) for a
# moment each, and fails unless every row was measured without an error and O landed in the regions (the loadgens
# poison the output regions and check them). Numbers are not checked (a shared 2-core box), only that they exist.
#   bench/service/smoke_local_cpu.sh [BUILD_DIR, default build]   (FLASHSERVE_BIN overrides the server binary)
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
BIN=${FLASHSERVE_BIN:-$BUILD/server/flashserve}
LOADGEN=$BUILD/bench/service/flashserve-loadgen
DECODE=$BUILD/bench/service/flashserve-decode-loadgen
for b in "$BIN" "$LOADGEN" "$DECODE"; do [[ -x $b ]] || { echo "smoke: $b missing"; exit 2; }; done
WORK=$(mktemp -d /tmp/fs-smoke-local.XXXXXX)
SOCK=$WORK/fs.sock
source "$(dirname "${BASH_SOURCE[0]}")/free_ports.sh"
read -r GRPC HTTP METRICS <<<"$(free_ports 3)"
"$BIN" --backend=cpu --host=127.0.0.1 --grpc_port="$GRPC" --http_port="$HTTP" --metrics_port="$METRICS" \
  --allow_client_shm --local_socket="$SOCK" --kv_cache_bytes=$((256 << 20)) --log_level=warn \
  ${SERVER_FLAGS:-} >"$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 1 100); do [[ -S $SOCK ]] && break; sleep 0.1; done
[[ -S $SOCK ]] || { echo "smoke: no socket at $SOCK"; cat "$WORK/server.log"; exit 1; }
fail=0
"$LOADGEN" --target="127.0.0.1:$GRPC" --shapes=small --concurrency=1,2 --duration_s=0.3 --stripes= \
  --local_socket="$SOCK" --local_shm=system --csv="$WORK/s.csv" --md="$WORK/s.md" >/dev/null 2>"$WORK/lg.log" || fail=1
for path in "local echo (inline request bytes)" "local inline" "local echo (shm request bytes)" "local system"; do
  rows=$(grep -cF "| small | $path | " "$WORK/s.md")
  bad=$(grep -F "| small | $path | " "$WORK/s.md" | grep -cvE '\| 0 \|$')  # last column: errors
  if [[ $rows != 2 || $bad != 0 ]]; then echo "smoke: loadgen '$path': $rows rows, $bad with errors"; fail=1; fi
done
grep -E 'failed|O check' "$WORK/s.md" && fail=1
for variant in "--local_socket=$SOCK" "--local_socket=$SOCK --shm=system" "--shm=system"; do
  # shellcheck disable=SC2086
  out=$("$DECODE" --target="127.0.0.1:$GRPC" --context=64 --sequences=4 --concurrency=1,2 --steps=5 --warmup=1 \
    $variant 2>&1)
  if [[ $? != 0 || $(grep -c '"p50_ms"' <<<"$out") != 2 ]]; then echo "smoke: decode $variant: $out"; fail=1; fi
done
(( fail )) && { tail -n 20 "$WORK/lg.log"; echo "smoke: FAILED"; exit 1; }
echo "smoke: local transport and shm modes OK"
