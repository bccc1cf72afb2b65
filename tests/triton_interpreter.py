"""Run Python with a full Triton that scripts/install/setup_env.sh puts outside site-packages (interpreter-only
installs of torch carry none), in a subprocess: a test file's `__main__` block under Triton's CPU interpreter
(TRITON_INTERPRET=1; its last stdout line is the kernels' JSON report), or a script that compiles kernels for a GPU
without running them.

The trainer's kernels must work with the Triton of every torch it supports, 2.11 through 2.14; tests run under each
(the `triton_version` fixture of tests/conftest.py). Triton 3.6.0 (torch 2.11) is the H200's, where the kernels'
speed was measured."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOPPER_SHARED_BYTES = 227 * 1024  # per block, opt-in maximum on sm_90 (the compile reports' limit)
MEASURED = "3.6.0"
SITES = {  # Triton version -> its `pip install --target` folder; the torch releases that require it
    MEASURED: ROOT / ".venv" / "triton-interpret",  # torch 2.11
    "3.7.1": ROOT / ".venv" / "triton-3.7.1",  # torch 2.13 (2.12: 3.7.0)
    "3.8.0": ROOT / ".venv" / "triton-3.8.0",  # torch 2.14, the GPU profile's
}


def run_with_triton(script: str, *args: str, interpret: bool, triton: str = MEASURED) -> str:
    """stdout of `python script args` from the repo root with Triton `triton` first on the path."""
    site = SITES[triton]
    assert (site / "triton").is_dir(), f"{site} missing: run scripts/install/setup_env.sh"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def run_under_interpreter(test_file: str, *args: str, triton: str = MEASURED) -> dict:
    return json.loads(run_with_triton(test_file, *args, interpret=True, triton=triton).strip().splitlines()[-1])
