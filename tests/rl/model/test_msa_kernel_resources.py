"""The block-outer MSA kernels compiled for Hopper (sm_90) on this CPU machine by scripts/msa_kernel_resources.py.

The Gluon backward (rl.model.msa_block_outer_gluon) has no interpreter, so this is the only place `make test` sees
it: it must compile, fit in shared memory, not spill, and keep its MMAs asynchronous. ptxas serializes the wgmma
pipeline (C7514) when code reads an accumulator while its MMA may be in flight; a variant that stored dQ while the
next tile's MMAs ran did exactly that and was 5% slower on the H200 (results/gpu/run22).
"""

import json
import os
import subprocess
import sys

from tests.triton_interpreter import INTERPRETER_SITE, ROOT

HOPPER_SHARED_BYTES = 227 * 1024  # per block, opt-in maximum on sm_90


def test_hopper_compile_report():
    assert (INTERPRETER_SITE / "triton").is_dir(), f"{INTERPRETER_SITE} missing: run scripts/install/setup_env.sh"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(INTERPRETER_SITE), str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "scripts/msa_kernel_resources.py"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    kernels = {k["kernel"]: k for k in json.loads(p.stdout)["kernels"]}
    assert {"_fwd", "_bwd", "_bwd_gluon", "_merge", "_reduce_dq"} <= set(kernels)
    gluon = kernels["_bwd_gluon"]
    assert gluon["stack_bytes"] == 0 and gluon["shared_bytes"] <= HOPPER_SHARED_BYTES, gluon
    for name in ("_fwd", "_bwd", "_bwd_gluon"):
        assert not kernels[name]["wgmma_serialized"], kernels[name]
