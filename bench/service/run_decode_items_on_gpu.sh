#!/usr/bin/env bash
# decode_items.py on a GPU machine: one CUDA server on loopback (the flags of run_decode_on_gpu.sh, window 0),
# 64 sequences at each context, DecodeStep items inline / in a system region / in a CUDA region, in turns.
#   FLASHSERVE_BIN=<bundle>/bin/flashserve OUT=<dir> bench/service/run_decode_items_on_gpu.sh [decode_items.py args]
# The Python client (flashserve, grpcio, numpy, torch with CUDA) must be importable.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${FLASHSERVE_BIN:?}" "${OUT:?}"
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/free_ports.sh"
read -r grpc http metrics <<<"$(free_ports 3)"
"$FLASHSERVE_BIN" --backend=cuda --host=127.0.0.1 --grpc_port="$grpc" --http_port="$http" --metrics_port="$metrics" \
  --kv_cache_bytes=${KV_CACHE_BYTES:-$((6 << 30))} --kv_page_tokens=64 --max_sequence_tokens=16384 --batch_window_us=0 \
  --max_request_bytes=2147483647 --max_inflight_bytes=0 --grpc_memory_quota_bytes=0 --queue_capacity=256 \
  --log_level=warn --allow_client_shm >"$OUT/server-items.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait 2>/dev/null' EXIT
for _ in $(seq 1 300); do
  python3 -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:$http/v2/health/ready', timeout=1).status == 200 else 1)" \
    2>/dev/null && break
  sleep 0.1
done
python3 bench/service/decode_items.py --target "127.0.0.1:$grpc" --md "$OUT/decode-items.md" --json "$OUT/decode-items.json" "$@"
