"""The block-outer MSA kernels compiled for Hopper (sm_90) on this CPU machine by scripts/msa_kernel_resources.py.

The Gluon kernels (rl.model.msa_block_outer_gluon) have no interpreter, so this is the only place `make test` sees
it: it must compile, fit in shared memory, not spill, and keep its MMAs asynchronous. ptxas serializes the wgmma
pipeline (C7514) when code reads an accumulator while its MMA may be in flight; a variant that stored dQ while the
next tile's MMAs ran did exactly that and was 5% slower on the H200 (results/gpu/run22).
"""

import functools
import json

from tests.triton_interpreter import HOPPER_SHARED_BYTES, MEASURED, run_with_triton

KERNELS = {"_plan_keys", "_plan_index", "_fwd", "_fwd_gluon", "_fwd_gluon_ws", "_bwd", "_bwd_gluon", "_bwd_gluon_ws",
           "_merge", "_reduce_grads"}


@functools.lru_cache(maxsize=None)
def _report(triton: str) -> dict:
    return json.loads(run_with_triton("scripts/msa_kernel_resources.py", interpret=False, triton=triton))


def test_every_kernel_compiles_for_hopper(triton_version):
    """Under the Triton of each supported torch: Gluon's API moves between releases (3.7 renamed thread_barrier)."""
    report = _report(triton_version)
    assert {k["kernel"] for k in report["kernels"]} == KERNELS
    for k in report["kernels"]:
        assert k["shared_bytes"] <= HOPPER_SHARED_BYTES, k


def test_hopper_compile_report():
    """Resources as measured fast on the H200 (its Triton); other Tritons' reports: results/triton_versions.json."""
    report = _report(MEASURED)
    kernels = {k["kernel"]: k for k in report["kernels"]}
    for name in ("_fwd_gluon", "_bwd_gluon"):
        gluon = kernels[name]
        assert gluon["stack_bytes"] == 0 and gluon["shared_bytes"] <= HOPPER_SHARED_BYTES, gluon
    # two forward programs per SM: their K/V blocks and double-buffered rows in half of the shared memory
    assert kernels["_fwd_gluon"]["shared_bytes"] <= HOPPER_SHARED_BYTES // 2, kernels["_fwd_gluon"]
    # the warp-specialized backward (the default), dQ stored by TMA and from registers, its causal tiles split off
    # or every tile masked: 4 loader warps at 24 registers each, so that the math warps get 240; and the
    # warp-specialized forward (the default), one program per SM
    ws = [k for k in report["kernels"] if k["kernel"] == "_bwd_gluon_ws"]
    assert sorted((k["DQ_TMA"], k["SPLIT"]) for k in ws) == [(False, False), (False, True), (True, False),
                                                             (True, True)], ws
    ws.append(kernels["_fwd_gluon_ws"])
    for k in ws:
        assert k["stack_bytes"] == 0 and k["shared_bytes"] <= HOPPER_SHARED_BYTES, k
    for k in [kernels[name] for name in ("_fwd", "_fwd_gluon", "_bwd", "_bwd_gluon")] + ws:
        assert not k["wgmma_serialized"], k
    for k in [kernels["_fwd_gluon"], kernels["_bwd_gluon"]] + ws:  # and none inside the loops that issue the MMAs
        assert k["mma_loop_spills"] == 0, k
    # the plan kernel sorting 1K item rows (4K tokens) and the most it sorts into their launch order in one
    # program's registers
    index = [k for k in report["kernels"] if k["kernel"] == "_plan_index"]
    assert sorted(k["NP"] for k in index) == [1024, 2048], index
    for k in index:
        assert k["stack_bytes"] == 0 and k["shared_bytes"] <= HOPPER_SHARED_BYTES, k


def test_every_tile_masked_backward_does_not_spill_in_its_mma_loop(triton_version):
    """Config.bwd_loops='masked' is the backward's form without spills in its MMA loop under every supported Triton:
    under 3.8 (torch 2.14) the split form's loops spill (52 local loads and stores per tile, TMA dQ stores;
    results/triton_versions.json), and which of the two is faster there is for the H200 to measure."""
    ws = [k for k in _report(triton_version)["kernels"] if k["kernel"] == "_bwd_gluon_ws" and not k["SPLIT"]]
    assert len(ws) == 2, ws
    for k in ws:
        assert k["mma_loop_spills"] == 0 and not k["wgmma_serialized"], k
