"""Run a test file's `__main__` block under Triton's CPU interpreter (TRITON_INTERPRET=1), in a subprocess with the
interpreter-only Triton that scripts/install/setup_env.sh puts outside site-packages; return its last stdout line
as JSON (the kernels' report)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER_SITE = ROOT / ".venv" / "triton-interpret"


def run_under_interpreter(test_file: str, *args: str) -> dict:
    assert (INTERPRETER_SITE / "triton").is_dir(), f"{INTERPRETER_SITE} missing: run scripts/install/setup_env.sh"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(INTERPRETER_SITE), str(ROOT)]))
    p = subprocess.run([sys.executable, test_file, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
