#!/usr/bin/env bash
# Runs on a GPU machine that has no gRPC C++ libraries (e.g. through the device tool): unpacks the
# relocatable bundle made by scripts/bundle, installs carried Python wheels (.whl/: grpcio,
# grpcio-tools, grpcio-health-checking, grpcio-reflection matching the stubs), and runs the Python
# end-to-end suite against the bundled server -- the GPU tests (CUDA backend, autotuning) and the
# CPU-backend suite -- then a small flashserve-tune grid. Logs go to $OUT (default /tmp/flashserve-e2e).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flashserve-e2e}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/client/python
rm -rf /tmp/flashserve-bundle && mkdir -p /tmp/flashserve-bundle
tar -xzf .bundle/flashserve-*-linux-*.tar.gz -C /tmp/flashserve-bundle
BIN_DIR=$(dirname "$(ls /tmp/flashserve-bundle/*/bin/flashserve)")
nvidia-smi -L | tee "$OUT/device.txt"
"$BIN_DIR/flashserve-check-bundle" 2>&1 | tail -3 || true
export PYTHONUNBUFFERED=1
status=0
FLASHSERVE_BIN="$BIN_DIR/flashserve" python3 -m pytest -q -p no:cacheprovider tests/python \
  -k "not prometheus" 2>&1 | tee "$OUT/pytest.log" || status=1
# A small grid with the tuning CLI (the whole default grid takes longer; see bench/results).
start=$(date +%s)
"$BIN_DIR/flashserve-tune" --tune_cache="$OUT/tune-cache.json" --dtypes=bf16 --head_dims=64,128 \
  --causal=both --seqlens=1024,4096 2>&1 | tee "$OUT/tune.log" || status=1
echo "flashserve-tune small grid: $(( $(date +%s) - start )) s" | tee -a "$OUT/tune.log"
exit $status
