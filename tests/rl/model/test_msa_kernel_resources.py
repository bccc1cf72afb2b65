"""The block-outer MSA kernels compiled for Hopper (sm_90) on this CPU machine by scripts/msa_kernel_resources.py.

The Gluon kernels (rl.model.msa_block_outer_gluon) have no interpreter, so this is the only place `make test` sees
it: it must compile, fit in shared memory, not spill, and keep its MMAs asynchronous. ptxas serializes the wgmma
pipeline (C7514) when code reads an accumulator while its MMA may be in flight; a variant that stored dQ while the
next tile's MMAs ran did exactly that and was 5% slower on the H200 (results/gpu/run22).
"""

import json

from tests.triton_interpreter import run_with_triton

HOPPER_SHARED_BYTES = 227 * 1024  # per block, opt-in maximum on sm_90


def test_hopper_compile_report():
    report = json.loads(run_with_triton("scripts/msa_kernel_resources.py", interpret=False))
    kernels = {k["kernel"]: k for k in report["kernels"]}
    assert {"_fwd", "_fwd_gluon", "_bwd", "_bwd_gluon", "_merge", "_reduce_dq"} <= set(kernels)
    for name in ("_fwd_gluon", "_bwd_gluon"):
        gluon = kernels[name]
        assert gluon["stack_bytes"] == 0 and gluon["shared_bytes"] <= HOPPER_SHARED_BYTES, gluon
    # two forward programs per SM: their K/V blocks and double-buffered rows in half of the shared memory
    assert kernels["_fwd_gluon"]["shared_bytes"] <= HOPPER_SHARED_BYTES // 2, kernels["_fwd_gluon"]
    for name in ("_fwd", "_fwd_gluon", "_bwd", "_bwd_gluon", "_bwd_gluon_ws"):
        assert not kernels[name]["wgmma_serialized"], kernels[name]
    # the warp-specialized backward: 4 loader warps at 24 registers each, so that the math warps get 240
    ws = kernels["_bwd_gluon_ws"]
    assert ws["stack_bytes"] == 0 and ws["shared_bytes"] <= HOPPER_SHARED_BYTES, ws
    for name in ("_fwd_gluon", "_bwd_gluon", "_bwd_gluon_ws"):  # and none inside the loops that issue the MMAs
        assert kernels[name]["mma_loop_spills"] == 0, kernels[name]
