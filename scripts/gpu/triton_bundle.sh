#!/usr/bin/env bash
# Pack one Triton release for the H200, whose only Triton is torch 2.11's 3.6.0, so that the trainer's kernels can be
# timed there under the Triton of another torch (3.8.0: torch 2.14, the GPU profile's) in the same device call:
#   bash scripts/gpu/triton_bundle.sh 3.8.0      ->  .whl/triton-3.8.0-cp312-sm90.tar.xz
#   then on the device: TRITON=3.8.0 bash scripts/gpu/run.sh STEP...   (scripts/gpu/lib.sh unpacks it)
# The wheel (248 MB) is over a device call's 64 MiB; what sm_90 needs of it is not: libtriton.so without its debug
# sections (482 -> 183 MB), ptxas, cuobjdump and the nvdisasm it runs for SASS, the CUDA headers and libdevice the
# launcher and the compiler read. Left out: Blackwell's ptxas, CUPTI and the profiler (proton), the MLIR plugins,
# test libraries.
set -euo pipefail
cd "$(dirname "$0")/../.."
v=${1:?usage: triton_bundle.sh VERSION [PYTHON_VERSION]}
py=${2:-3.12}  # the H200's Python
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp" "triton==$v"
mkdir "$tmp/site"
python3 -m zipfile -e "$tmp"/triton-"$v"-*.whl "$tmp/site"
t="$tmp/site/triton"
rm -rf "$t"/backends/nvidia/lib/cupti* "$t"/backends/nvidia/bin/ptxas-blackwell "$t"/_C/libproton.so "$t"/profiler \
    "$t"/instrumentation "$t"/FileCheck "$t"/plugins
strip --strip-unneeded "$t/_C/libtriton.so"
chmod +x "$t"/backends/nvidia/bin/*  # zipfile drops the execute bits
mkdir -p .whl
out=".whl/triton-$v-cp${py/./}-sm90.tar.xz"
tar -C "$tmp/site" -c triton "triton-$v.dist-info" | xz -T0 -9 > "$out"
ls -l "$out"
