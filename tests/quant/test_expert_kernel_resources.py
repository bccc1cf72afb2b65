"""The warp-specialized Gluon NVFP4 expert GEMM (quant.kernels.nvfp4_moe_gluon, forward and input gradient)
compiled for Hopper (sm_90) on this CPU machine by scripts/expert_kernel_resources.py. Gluon has no interpreter, so
this is what `make test` sees of it: it must compile at M3's shapes, fit in shared memory, not spill in any partition,
and keep its MMAs asynchronous (ptxas reports C7514 when it serializes them). Its results are checked on the GPU
(tests/quant/test_kernels_gpu.py, *_gluon_*)."""

import json

from tests.triton_interpreter import run_with_triton

HOPPER_SHARED_BYTES = 227 * 1024  # per block, opt-in maximum on sm_90


def test_gluon_expert_gemm_compiles_for_hopper():
    report = json.loads(run_with_triton("scripts/expert_kernel_resources.py", interpret=False))
    assert {(k["BM"], k["DW"], k["DGRAD"]) for k in report["kernels"]} == {
        (bm, dw, dgrad) for bm, dw in ((64, 4), (128, 4), (128, 8), (256, 4), (256, 8)) for dgrad in (True, False)}
    for k in report["kernels"]:
        assert k["stack_bytes"] == 0 and k["shared_bytes"] <= HOPPER_SHARED_BYTES, k
        assert not k["wgmma_serialized"], k
