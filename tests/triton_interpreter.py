"""Run Python with the full Triton that scripts/install/setup_env.sh puts outside site-packages (interpreter-only
installs of torch carry none), in a subprocess: a test file's `__main__` block under Triton's CPU interpreter
(TRITON_INTERPRET=1; its last stdout line is the kernels' JSON report), or a script that compiles kernels for a GPU
without running them."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER_SITE = ROOT / ".venv" / "triton-interpret"


def run_with_triton(script: str, *args: str, interpret: bool) -> str:
    """stdout of `python script args` from the repo root with that Triton first on the path."""
    assert (INTERPRETER_SITE / "triton").is_dir(), f"{INTERPRETER_SITE} missing: run scripts/install/setup_env.sh"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(INTERPRETER_SITE), str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def run_under_interpreter(test_file: str, *args: str) -> dict:
    return json.loads(run_with_triton(test_file, *args, interpret=True).strip().splitlines()[-1])
