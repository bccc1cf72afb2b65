"""Compile the Gluon NVFP4 expert GEMM (quant.kernels.nvfp4_moe_gluon; forward and input gradient) for Hopper without
a GPU; print registers, spills, shared memory and whether ptxas serialized the wgmma pipeline, per config, as JSON.

    PYTHONPATH=.venv/triton-interpret python scripts/expert_kernel_resources.py

Same method as scripts/msa_kernel_resources.py (whose compile_report it uses), at M3's expert shapes: every int
argument is a multiple of 16 there (N, K = 3072 or 6144; K/2, K/16; row strides), as a launch specializes them.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from msa_kernel_resources import compile_report  # noqa: E402

CONFIGS = [dict(BM=bm, BO=128, BR=128, DGRAD=dgrad) for dgrad in (True, False) for bm in (128, 64)]


def main():
    from quant.kernels import nvfp4_moe_gluon as g

    types = {"in_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "gs_ptr": "*fp32", "off_ptr": "*i64",
             "out_ptr": "*bf16"}
    ints = ("N", "K", "KB", "KS", "stride_in", "stride_out")
    rows = [dict(compile_report(g._gemm_gluon, types, dict(cfg, E_P2=128), cfg["BM"] // 16, 1, divisible=ints),
                 **cfg) for cfg in CONFIGS]
    print(json.dumps({"command": " ".join(["python"] + sys.argv), "arch": "sm_90", "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
