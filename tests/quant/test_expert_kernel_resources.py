"""The warp-specialized Gluon NVFP4 expert GEMM (quant.kernels.nvfp4_moe_gluon, forward and input gradient)
compiled for Hopper (sm_90) on this CPU machine by scripts/expert_kernel_resources.py. Gluon has no interpreter, so
this is what `make test` sees of it: it must compile at M3's shapes, fit in shared memory, not spill in any partition,
and keep its MMAs asynchronous (ptxas reports C7514 when it serializes them). Its results are checked on the GPU
(tests/quant/test_kernels_gpu.py, *_gluon_*). The same compile checks the bf16 weight decode of the decode + cuBLAS
path (quant.kernels.nvfp4_dequant) for the properties its speed rests on: no shared memory between decode and store,
loads that coalesce; and
that the fused Triton expert GEMMs and the MXFP8 linear's kernels compile and fit. Under each supported Triton."""

import json
import sys
from pathlib import Path

from tests.triton_interpreter import HOPPER_SHARED_BYTES, run_with_triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def test_gluon_expert_gemm_compiles_for_hopper(triton_version):
    """Under the Triton of each supported torch (tests/triton_interpreter.py)."""
    report = json.loads(run_with_triton("scripts/expert_kernel_resources.py", interpret=False, triton=triton_version))
    assert {(k["BM"], k["DW"], k["PAIRS"], k["DGRAD"]) for k in report["kernels"]} == {
        (bm, dw, pairs, dgrad) for bm, dw, pairs in ((64, 4, False), (128, 4, False), (128, 8, False), (256, 4, False),
                                                     (256, 8, False), (128, 4, True), (256, 8, True))
        for dgrad in (True, False)}
    for k in report["kernels"]:
        assert k["stack_bytes"] == 0 and k["shared_bytes"] <= HOPPER_SHARED_BYTES, k
        assert not k["wgmma_serialized"], k
    # the weight decode of the decode + cuBLAS path: its layouts need no shared memory between the decode and the
    # 16-byte stores (a layout change there costs a shared-memory round trip and barriers per program)
    assert [d["EVEN"] for d in report["decode"]] == [True, False]
    for d in report["decode"]:
        assert d["shared_bytes"] == 0 and d["stack_bytes"] == 0, d
        # and its word and scale loads are flat runs with consecutive lanes on consecutive elements: coalesced under
        # every Triton (a [8, rows] tile had the lanes on the words under 3.6 but on the rows under 3.7/3.8, 32-byte
        # strided loads and 128-byte strided stores: 3.6x slower, run129)
        assert [(x["dtype"], x["shape"], x["sizePerThread"], x["threadsPerWarp"]) for x in d["loads"]] == [
            ("i32", [8 * d["R"]], [1], [32]), ("i8", [8 * d["R"]], [1], [32])], d["loads"]
    # the fused Triton expert GEMMs and the MXFP8 linear's kernels at the tiles their configs pick under this Triton:
    # they compile and fit (Triton 3.8's BM=256 forward at 3 stages needed 246 KB: nvfp4_moe_gemm.fwd_config)
    assert [(k["kernel"], k["rows"]) for k in report["triton_gemm"]] == [
        (name, rows) for name in ("_fwd_kernel", "_dgrad_kernel") for rows in (2048, 4096, 12288, 65536)]
    assert [(k["kernel"], k.get("rows")) for k in report["mxfp8"]] == [
        ("_dequant_kernel", None), ("_fwd_kernel", 64), ("_fwd_kernel", 256), ("_fwd_kernel", 4096),
        ("_dgrad_kernel", 256), ("_dgrad_kernel", 4096)]
    for k in report["triton_gemm"] + report["mxfp8"]:
        assert k["shared_bytes"] <= HOPPER_SHARED_BYTES and not k["wgmma_serialized"], k


def test_the_input_gradients_default_config_is_compiled_here_and_tested_on_the_gpu():
    """The Gluon config ``launch_dgrad`` picks by default on sm_90 is one the compile check above covers and one the
    GPU exactness tests run (CONFIG_VARIANTS), so changing the default cannot leave it unchecked."""
    from quant.kernels import nvfp4_moe_gemm as gemm
    from tests.quant.test_kernels_gpu import CONFIG_VARIANTS

    from expert_kernel_resources import CONFIGS  # scripts/, on the path (as tests/rl/test_cuda_memory_peak.py does)

    default = gemm.GLUON_DGRAD_CONFIG
    assert default.get("GLUON") and ("dgrad", default) in CONFIG_VARIANTS.values()
    assert {k: v for k, v in default.items() if k != "GLUON"} in CONFIGS
