# shellcheck shell=bash
# Sourced by the GPU benchmark scripts (run_on_gpu.sh, run_decode_on_gpu.sh) from the repository root:
# finds the relocatable bundle that scripts/bundle made here and carried along.
#   bundle_root EXTRACT_DIR
# sets ROOT to the bundle's top directory (bin/, lib/): the first flashserve-*-linux-*.tar.gz under
# $BUNDLE_DIR (default .bundle-bench) unpacked into EXTRACT_DIR (emptied first), else, with no tarball
# there, the first flashserve-*-linux-* tree under $BUNDLE_DIR (a --no-tar bundle) in place.
# ls | head (the first match) as the scripts had it; ROOT is the function's output.
# shellcheck disable=SC2012,SC2034
bundle_root() {
  local extract_dir=$1 tarball
  BUNDLE_DIR=${BUNDLE_DIR:-.bundle-bench}
  tarball=$(ls "$BUNDLE_DIR"/flashserve-*-linux-*.tar.gz 2>/dev/null | head -n 1)
  if [[ -n $tarball ]]; then
    rm -rf "$extract_dir" && mkdir -p "$extract_dir"
    tar -xzf "$tarball" -C "$extract_dir"
    ROOT=$(ls -d "$extract_dir"/flashserve-*)
  else
    ROOT=$(ls -d "$BUNDLE_DIR"/flashserve-*-linux-* | head -n 1)
  fi
}
