"""Compile the warp-specialized Gluon NVFP4 expert GEMM (quant.kernels.nvfp4_moe_gluon; forward and input gradient)
for Hopper without a GPU; print registers, spills, shared memory and whether ptxas serialized the wgmma pipeline, per
config, as JSON; and the same for the bf16 weight decode of quant.kernels.nvfp4_dequant ("decode").

    PYTHONPATH=.venv/triton-interpret python scripts/expert_kernel_resources.py

Same method as scripts/msa_kernel_resources.py (whose compile_report it uses), at M3's expert shapes: every int
argument is a multiple of 16 there (N, K = 3072 or 6144; K/8 words, K/16 scales; row strides), as a launch
specializes them. "registers" is the launch's per-thread cap (maxnreg); the partitions share it out (setmaxnreg), and
a spill in any of them shows as stack bytes.
"""

import importlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from msa_kernel_resources import compile_report, tma_descriptor_type  # noqa: E402

# the configs scripts/bench_expert_gemm.py --variants times (and tests/quant/test_kernels_gpu.py checks)
CONFIGS = [dict(BM=64), dict(BM=128), dict(BM=128, DW=8, DREGS=96), dict(BM=256), dict(BM=256, DW=8, DREGS=64),
           dict(BM=128, PAIRS=True), dict(BM=256, DW=8, DREGS=64, PAIRS=True)]


def main():
    from quant.kernels import nvfp4_moe_gluon as g

    rows = []
    for dgrad in (True, False):
        for cfg in CONFIGS:
            c = g.ws_config(cfg)
            types = {"in_desc": tma_descriptor_type(c["BM"], c["BR"]), "w_ptr": "*i32", "s_ptr": "*u8",
                     "gs_ptr": "*fp32", "off_ptr": "*i64", "out_ptr": "*bf16"}
            constexprs = dict(E_P2=128, BM=c["BM"], BO=c["BO"], BR=c["BR"], S=c["S"], DGRAD=dgrad, DW=c["DW"],
                              DREGS=c["DREGS"], PAIRS=c["PAIRS"])
            report = compile_report(g._gemm_ws, types, constexprs, c["WARPS"], 1, maxnreg=g.ws_maxnreg(c),
                                    divisible=("N", "K", "KW", "KS", "stride_out"))
            rows.append(dict(report, **c, DGRAD=dgrad))
    print(json.dumps({"command": " ".join(["python"] + sys.argv), "arch": "sm_90", "kernels": rows,
                      "decode": decode_reports(), "triton_gemm": triton_gemm_reports(), "mxfp8": mxfp8_reports()},
                     indent=1))


def _config_report(kernel, types, constexprs, config, rows, divisible):
    """compile_report of a Triton kernel at a launch config (its tiles, warps and stages), with those and the rows."""
    report = compile_report(kernel, types, constexprs, config["num_warps"], config["num_stages"], divisible=divisible)
    return dict(report, rows=rows, num_stages=config["num_stages"], **{k: v for k, v in config.items() if k.isupper()})


# M3-like rows per expert for each tile bucket of nvfp4_moe_gemm.fwd_config / dgrad_config (128 experts)
BUCKET_ROWS = (16 * 128, 32 * 128, 96 * 128, 512 * 128)


def triton_gemm_reports():
    """The fused Triton NVFP4 expert GEMMs (quant.kernels.nvfp4_moe_gemm: the forward at every token count, the input
    gradient below the Gluon kernel's rows) at each tile bucket, with the default (asm) decoder."""
    from quant.kernels import nvfp4_moe_gemm as ng

    _, fwd, dgrad = ng._kernels()
    types = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "gs_ptr": "*fp32",
             "off_ptr": "*i64", "y_ptr": "*bf16", "dx_ptr": "*bf16"}
    divisible = ("N", "K", "KW", "KS", "stride_xm", "stride_ym", "stride_dym", "stride_dxm")
    rows = []
    for kernel, config in ((fwd, ng.fwd_config), (dgrad, ng.dgrad_config)):
        for m in BUCKET_ROWS:
            c = config(m, 128)
            constexprs = dict(E_P2=128, BM=c["BM"], BN=c["BN"], BK=c["BK"], WPB=c["BK"] // 8,
                              DECODE=ng.DECODERS[ng.DEFAULT_DECODER], EVEN_K=True)
            if kernel is dgrad:
                constexprs.update(EVEN_N=True, SWAP=c["SWAP"])
            rows.append(_config_report(kernel, types, constexprs, c, m, divisible))
    return rows


def mxfp8_reports():
    """The MXFP8 linear's kernels (quant.kernels.mxfp8_linear): the dequantize, and the fused forward and input
    gradient at each tile bucket of its fwd_config / dgrad_config."""
    ml = importlib.import_module("quant.kernels.mxfp8_linear")  # the package exports a function of this name

    _, dequant, fwd, dgrad = ml._kernels()
    types = {"q_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16", "total": "i64", "x_ptr": "*bf16", "b_ptr": "*bf16",
             "y_ptr": "*bf16", "dy_ptr": "*bf16", "dx_ptr": "*bf16"}
    divisible = ("N", "K", "total", "stride_xm", "stride_ym", "stride_dym", "stride_dxm")
    rows = [dict(compile_report(dequant, types, dict(BLOCK_E=4096), 8, 3, divisible=divisible), BLOCK_E=4096)]
    for kernel, config, buckets in ((fwd, ml.fwd_config, (64, 256, 4096)), (dgrad, ml.dgrad_config, (256, 4096))):
        for m in buckets:
            c = config(m)
            constexprs = dict(BM=c["BM"], BN=c["BN"], BK=c["BK"], GROUP=c["GROUP"], EVEN_K=True)
            constexprs.update(HAS_BIAS=False) if kernel is fwd else constexprs.update(EVEN_N=True)
            rows.append(_config_report(kernel, types, constexprs, c, m, divisible))
    return rows


def decode_reports():
    """The decode + cuBLAS path's weight decode (quant.kernels.nvfp4_dequant) at its default tile, asm branch, with
    and without masks: its layouts are chosen so that no shared memory moves the decoded tile (run77: 3.9 TB/s) and
    consecutive lanes load consecutive words (its loads' layouts; run129: 3.6x slower under Triton 3.8 without)."""
    from quant.kernels import nvfp4_dequant as nd

    _, kernel = nd._kernel()
    types = {"w_ptr": "*i32", "p_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16"}
    return [dict(compile_report(kernel, types, dict(R=nd.ROWS, ASM=True, EVEN=even), nd.WARPS, 3,
                                divisible=("groups",), loads=True), R=nd.ROWS, EVEN=even) for even in (True, False)]


if __name__ == "__main__":
    main()
