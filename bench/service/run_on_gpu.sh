#!/usr/bin/env bash
# The service benchmark on a GPU machine (no gRPC C++ libraries there): takes the relocatable bundle made
# here by scripts/bundle (tarball or --no-tar tree under $BUNDLE_DIR, default .bundle-bench/) whose bin/ holds
# flashserve, flashserve-loadgen and flashserve-echo, starts flashserve --backend=cuda and the echo server on
# free loopback ports, runs the load generator grid and writes service.md, service.csv and logs to $OUT.
# Extra arguments go to flashserve-loadgen (e.g. --duration_s=1.5 --stripes=1,2,4,8); extra server flags in
# $SERVER_FLAGS (e.g. SERVER_FLAGS="--copy_threads=0"); $SERVER_WRAP is put before the server's command line
# (e.g. SERVER_WRAP="taskset -c 3" to confine the server to one core). Shared-memory paths (issue 18):
# SERVER_FLAGS="--allow_client_shm" ... run_on_gpu.sh --shm=system,cuda (--shm_max_bytes if regions pass 64 GiB).
# Local transport: when the server knows --local_socket (LOCAL=0 turns this off), it is started with
# --allow_client_shm --local_socket=<a socket under /tmp> and the load generator adds the local cells (echo floor,
# inline, and the shm paths in $LOCAL_SHM, default system,cuda) to service.md, with the issue-18 targets.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flashserve-service-bench}
mkdir -p "$OUT"
# shellcheck source=bench/service/bundle_env.sh
source bench/service/bundle_env.sh
bundle_root /tmp/flashserve-bench-bundle
BIN=$ROOT/bin
for b in flashserve flashserve-loadgen flashserve-echo; do
  [[ -x $BIN/$b ]] || { echo "run_on_gpu: $BIN/$b missing (see bench/service/README in the report)"; exit 1; }
done
"$BIN/flashserve-check-bundle" | tail -n 4
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv; nproc; } >"$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

LOCAL_SERVER_FLAGS=() LOCAL_ARGS=()
SOCK=/tmp/flashserve-bench-$$.sock  # short: a Unix socket path has at most 107 bytes
if [[ ${LOCAL:-1} == 1 ]]; then
  # (the help text first: grep -q closing the pipe early would fail the pipeline under pipefail)
  if grep -q -- '--local_socket ' <<<"$("$BIN/flashserve" --help 2>&1)"; then
    LOCAL_SERVER_FLAGS=(--allow_client_shm --local_socket="$SOCK")
    LOCAL_ARGS=(--local_socket="$SOCK" --local_shm="${LOCAL_SHM:-system,cuda}")
  else
    echo "run_on_gpu: this server has no --local_socket: the local-transport cells are skipped"
  fi
fi

source "$(dirname "${BASH_SOURCE[0]}")/free_ports.sh"
read -r GRPC HTTP METRICS ECHO <<<"$(free_ports 4)"
# Large requests at concurrency 16 hold 8 GiB of tensors: no inflight-bytes cap, a deep queue, a pinned
# pool big enough for each of them (537 MB rounds up to a 1 GiB size class) and a receive arena that
# holds the read buffers of medium requests at concurrency 64 (3 GiB) and of large ones at 16 (~8 GiB). No gRPC
# memory quota either (the default, a quarter of host memory up to 4 GiB, resets large uploads at c=16).
${SERVER_WRAP:-} "$BIN/flashserve" --backend=cuda --host=127.0.0.1 --grpc_port="$GRPC" --http_port="$HTTP" --metrics_port="$METRICS" \
  --max_inflight_bytes=0 --queue_capacity=256 --pinned_pool_bytes=$((24 << 30)) --receive_arena_bytes=$((8 << 30)) \
  --grpc_memory_quota_bytes=0 \
  --log_level=warn "${LOCAL_SERVER_FLAGS[@]}" \
  ${SERVER_FLAGS:-} >"$OUT/server.log" 2>&1 &
SERVER=$!
"$BIN/flashserve-echo" --host=127.0.0.1 --port="$ECHO" >"$OUT/echo.log" 2>&1 &
ECHO_PID=$!
cleanup() { kill "$SERVER" "$ECHO_PID" 2>/dev/null; wait "$SERVER" "$ECHO_PID" 2>/dev/null; rm -f "$SOCK"; }
trap cleanup EXIT
for _ in $(seq 1 300); do
  python3 -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:$HTTP/v2/health/ready', timeout=1).status == 200 else 1)" \
    2>/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { echo "flashserve died:"; cat "$OUT/server.log"; exit 1; }
  sleep 0.1
done
if [[ ${#LOCAL_ARGS[@]} -gt 0 && ! -S $SOCK ]]; then
  echo "run_on_gpu: the server is ready but $SOCK is not a socket: the local-transport cells are skipped"
  LOCAL_ARGS=()
fi
start=$(date +%s)
"$BIN/flashserve-loadgen" --target="127.0.0.1:$GRPC" --echo="127.0.0.1:$ECHO" --csv="$OUT/service.csv" \
  --md="$OUT/service.md" "${LOCAL_ARGS[@]}" "$@" 2>"$OUT/loadgen.log"
status=$?
echo "loadgen: exit $status after $(( $(date +%s) - start )) s"
# The server's own view of the run (how requests reached the device, receive arena and pool use).
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$METRICS/metrics', timeout=5).read().decode())" \
  >"$OUT/metrics.txt" 2>&1
grep -E '^flashserve_(request_inputs_total|receive_arena_bytes|pinned_memory_pool_bytes)' "$OUT/metrics.txt"
tail -n 30 "$OUT/loadgen.log"
tail -n 5 "$OUT/server.log"
exit $status
