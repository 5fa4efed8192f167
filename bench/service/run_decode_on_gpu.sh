#!/usr/bin/env bash
# Decode-step benchmark on a GPU machine (issue 20). Needs, carried from the build machine:
#   - the relocatable bundle made by scripts/bundle (tarball or tree under $BUNDLE_DIR, default .bundle-bench/),
#     or $FLASHSERVE_BIN pointing at a CUDA-enabled server binary;
#   - a Python client copy with stubs that load there: bench/service/make_py_stubs.sh build-decode-py
#     (carry build-decode-py; $DECODE_PY overrides the path);
#   - optional, the C++ client flashserve-decode-loadgen (scripts/bundle ships it in bin/ when the build has it;
#     else set $DECODE_LOADGEN). With it the Sequences and (a) rows are measured
#     from C++; PYTHON_CLIENT=1 adds the Python client's Sequences rows; SHM=0 drops the shared-memory rows.
# Local transport and C++ shared-memory rows: with the C++ client, and when the server knows --local_socket, each
# server also listens on a Unix socket and decode_bench.py adds the rows of $CPP_VARIANTS (default
# grpc+system,grpc+cuda,local,local+system,local+cuda: DecodeStep over gRPC or the socket, q/k/v/O inline or in a
# system / same-device CUDA region; CPP_VARIANTS= drops them). A variant the server refuses (e.g. CUDA regions for
# Sequences before the server accepts them) shows as a "failed: <code>: <message>" row; the other rows still run.
# CLIENT_SPIN_US=0,1000 runs each local variant once per value, back to back (flashserve-decode-loadgen
# --client_spin_us: the C++ client polls for its reply that long before blocking in recv; rows "..., client spin N us").
# The raw gRPC floor: with the C++ client, flashserve-echo (bin/ of the bundle, or $ECHO_BIN) runs on a free port and
# every gRPC Sequences row also gets the echo of its same request bytes (column "gRPC echo of the same bytes p50 ms").
# Starts two CUDA servers with a KV pool, one without batching and one with --batch_when_busy (or, with $WINDOW_US,
# --batch_window_us=$WINDOW_US), runs
# bench/service/decode_bench.py against both (full-K/V path (a) against the first, torch SDPA (c) in-process) and
# writes decode.md, decode.json and logs to $OUT. Extra arguments go to decode_bench.py (e.g. --steps=100); extra
# server flags in $SERVER_FLAGS (a dry run on a machine without a GPU: SERVER_FLAGS=--backend=cpu
# KV_CACHE_BYTES=1073741824 ... --contexts=128 --sequences=8).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flashserve-decode-bench}
mkdir -p "$OUT"
if [[ -z ${FLASHSERVE_BIN:-} ]]; then
  # shellcheck source=bench/service/bundle_env.sh
  source bench/service/bundle_env.sh
  bundle_root /tmp/flashserve-decode-bundle
  FLASHSERVE_BIN=$ROOT/bin/flashserve
fi
DECODE_LOADGEN=${DECODE_LOADGEN:-$(dirname "$FLASHSERVE_BIN")/flashserve-decode-loadgen}
CLIENT_ARGS=()
[[ -x $DECODE_LOADGEN ]] && CLIENT_ARGS+=(--cpp_loadgen "$DECODE_LOADGEN")
[[ ${PYTHON_CLIENT:-0} == 1 ]] && CLIENT_ARGS+=(--python_client)
[[ ${SHM:-1} == 1 ]] && CLIENT_ARGS+=(--shm)  # the shared-memory rows (Python client, system regions)
[[ -x $FLASHSERVE_BIN ]] || { echo "run_decode_on_gpu: no server binary at $FLASHSERVE_BIN"; exit 1; }
LOCAL_FLAGS=0
if [[ -x $DECODE_LOADGEN && -n ${CPP_VARIANTS-grpc+system,grpc+cuda,local,local+system,local+cuda} ]]; then
  VARIANTS=${CPP_VARIANTS-grpc+system,grpc+cuda,local,local+system,local+cuda}
  if ! grep -q -- '--local_socket ' <<<"$("$FLASHSERVE_BIN" --help 2>&1)"; then  # not a pipe: pipefail
    echo "run_decode_on_gpu: this server has no --local_socket: only the gRPC variants run"
    VARIANTS=$(tr ',' '\n' <<<"$VARIANTS" | grep -v '^local' | paste -sd, -)
  elif [[ $VARIANTS == *local* ]]; then
    LOCAL_FLAGS=1
  fi
  [[ -n $VARIANTS ]] && CLIENT_ARGS+=(--cpp_variants "$VARIANTS")
  [[ -n ${CLIENT_SPIN_US:-} ]] && CLIENT_ARGS+=(--client_spin_us "$CLIENT_SPIN_US")
fi
echo "clients: ${CLIENT_ARGS[*]:-Python only}"
export PYTHONPATH=${DECODE_PY:-$PWD/build-decode-py}
# The client's stubs are checked against this tree's protos: without this, a copy of the tree two levels under
# another checkout (e.g. /work/main/.kvperf) has flashserve._pb find <that checkout>/proto and regenerate stale stubs.
export FLASHSERVE_PROTO_ROOT=${FLASHSERVE_PROTO_ROOT:-$PWD/proto}
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv; nproc; } >"$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

source "$(dirname "${BASH_SOURCE[0]}")/free_ports.sh"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -f /tmp/flashserve-decode-$$-*.sock; }
trap cleanup EXIT
# Not called in $(...): the server's pid must reach PIDS in this shell for the cleanup.
start_server() {  # name window_us [flags...] -> sets PORT to the server's gRPC port, SOCKET to its socket (or "")
  local name=$1 window=$2 grpc http metrics local_flags=()
  local extra=("${@:3}")
  read -r grpc http metrics <<<"$(free_ports 3)"
  SOCKET=""
  if [[ $LOCAL_FLAGS == 1 ]]; then
    SOCKET=/tmp/flashserve-decode-$$-$name.sock  # short: a Unix socket path has at most 107 bytes
    local_flags=(--local_socket="$SOCKET")
  fi
  # KV pool 8 GiB (64 x 8k tokens of one layer = 2.1 GB); (a) needs requests up to 2 GiB and no inflight cap.
  "$FLASHSERVE_BIN" --backend=cuda --host=127.0.0.1 --grpc_port="$grpc" --http_port="$http" --metrics_port="$metrics" \
    --kv_cache_bytes=${KV_CACHE_BYTES:-$((8 << 30))} --kv_page_tokens=64 --max_sequence_tokens=16384 --batch_window_us="$window" \
    --max_request_bytes=2147483647 --max_tensor_elements=1099511627776 --max_inflight_bytes=0 \
    --grpc_memory_quota_bytes=0 --queue_capacity=256 --pinned_pool_bytes=$((8 << 30)) --log_level=warn --allow_client_shm \
    "${local_flags[@]}" "${extra[@]}" ${SERVER_FLAGS:-} >"$OUT/server-$name.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 300); do
    python3 -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:$http/v2/health/ready', timeout=1).status == 200 else 1)" \
      2>/dev/null && { PORT=$grpc; echo "$metrics" >"$OUT/metrics-port-$name"; return 0; }
    sleep 0.1
  done
  echo "server $name not ready:" >&2; cat "$OUT/server-$name.log" >&2; return 1
}
# The second server batches: by default --batch_when_busy (calls that arrive while a launch runs go together as the
# next one); WINDOW_US=N makes it --batch_window_us=N instead (the earlier tables' 200).
if [[ -n ${WINDOW_US:-} ]]; then
  BATCH_NAME="w$WINDOW_US" BATCH_LABEL="batch_window_us=$WINDOW_US" BATCH_WINDOW=$WINDOW_US
else
  BATCH_NAME=busy BATCH_LABEL=batch_when_busy BATCH_WINDOW=0 BATCH_FLAGS=--batch_when_busy
fi
start_server w0 0 || exit 1
P0=$PORT S0=$SOCKET
start_server "$BATCH_NAME" "$BATCH_WINDOW" ${BATCH_FLAGS:-} || exit 1
PW=$PORT SW=$SOCKET
if [[ $LOCAL_FLAGS == 1 ]]; then
  CLIENT_ARGS+=(--local_socket "batch_window_us=0=$S0" --local_socket "$BATCH_LABEL=$SW")
fi
ECHO_BIN=${ECHO_BIN:-$(dirname "$FLASHSERVE_BIN")/flashserve-echo}
if [[ -x $DECODE_LOADGEN && -x $ECHO_BIN ]]; then  # port 0: it prints the one it got
  "$ECHO_BIN" --host=127.0.0.1 --port=0 >"$OUT/echo.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 100); do grep -q '^listening on' "$OUT/echo.log" && break; sleep 0.1; done
  ECHO_PORT=$(sed -n 's/^listening on //p' "$OUT/echo.log")
  if [[ -n $ECHO_PORT ]]; then CLIENT_ARGS+=(--echo_target "127.0.0.1:$ECHO_PORT"); else
    echo "run_decode_on_gpu: flashserve-echo did not start (no echo column):"; cat "$OUT/echo.log"; fi
elif [[ -x $DECODE_LOADGEN ]]; then
  echo "run_decode_on_gpu: no flashserve-echo at $ECHO_BIN: no echo column"
fi
start=$(date +%s)
python3 bench/service/decode_bench.py --target "batch_window_us=0=127.0.0.1:$P0" \
  --target "$BATCH_LABEL=127.0.0.1:$PW" --md "$OUT/decode.md" --json "$OUT/decode.json" \
  "${CLIENT_ARGS[@]}" "$@" \
  2>"$OUT/decode_bench.log"
status=$?
echo "decode_bench: exit $status after $(( $(date +%s) - start )) s"
for f in "$OUT"/metrics-port-*; do
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$(cat "$f")/metrics', timeout=5).read().decode())" \
    >"${f/metrics-port-/metrics-}.txt" 2>&1
done
tail -n 30 "$OUT/decode_bench.log"
exit $status
