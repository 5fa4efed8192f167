#!/usr/bin/env bash
# The local-transport benchmark in one GPU call: run_on_gpu.sh (attention: gRPC inline, gRPC + system/CUDA shm, and
# the local socket's echo floor / inline / system / CUDA shm cells, with the issue-18 targets) into $OUT/service,
# then run_decode_on_gpu.sh (decode step: the existing rows plus the C++ variants gRPC/local x inline/system/CUDA
# shm, with the issue-20 targets) into $OUT/decode. Needs what those two need (the bundle under $BUNDLE_DIR with
# flashserve-decode-loadgen copied into its bin/, and build-decode-py from make_py_stubs.sh). SKIP_SERVICE=1 or
# SKIP_DECODE=1 runs only the other; $SERVICE_ARGS / $DECODE_ARGS replace each one's default arguments.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flashserve-local-bench}
mkdir -p "$OUT"
status=0
if [[ ${SKIP_SERVICE:-0} != 1 ]]; then
  start=$(date +%s)
  # shellcheck disable=SC2086  # word splitting of the argument lists is wanted
  OUT=$OUT/service SERVER_FLAGS="--allow_client_shm ${SERVER_FLAGS:-}" bash bench/service/run_on_gpu.sh \
    ${SERVICE_ARGS:---shapes=small,medium,large --concurrency=1,4,16 --duration_s=1.5 --stripes=1 --stripe_reps=1 --shm=system,cuda} \
    >"$OUT/service.log" 2>&1 || status=$?
  echo "service: exit $status after $(( $(date +%s) - start )) s"; tail -n 5 "$OUT/service.log"
fi
if [[ ${SKIP_DECODE:-0} != 1 ]]; then
  start=$(date +%s)
  decode_status=0
  # shellcheck disable=SC2086
  OUT=$OUT/decode bash bench/service/run_decode_on_gpu.sh ${DECODE_ARGS:-} >"$OUT/decode.log" 2>&1 || decode_status=$?
  echo "decode: exit $decode_status after $(( $(date +%s) - start )) s"; tail -n 5 "$OUT/decode.log"
  (( status == 0 )) && status=$decode_status
fi
exit $status
