"""Compile the trainer's row kernels (rl.model.lean_triton, swiglu_triton, lm_head_triton) and the MSA indexer's block
scores (rl.model.msa_triton) for Hopper without a GPU, at M3's sizes, as the launches specialize them; print each
kernel's registers, spills and shared memory as JSON. Their results are checked under Triton's interpreter and on the
GPU (tests/rl/model/test_*_triton.py); this is what shows that the Triton of each supported torch compiles them.

    PYTHONPATH=.venv/triton-interpret python scripts/trainer_kernel_resources.py

Same method as scripts/msa_kernel_resources.py (whose compile_report it uses).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from msa_kernel_resources import compile_report  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, KV_HEADS, INDEX_DIM = 6144, 64, 128, 4, 128  # M3


def main():
    from triton import next_power_of_2 as p2  # as the launches pass the blocks

    from rl.model import lean_triton as lean
    from rl.model import lm_head_triton as lm
    from rl.model import msa_triton as mt
    from rl.model import swiglu_triton as sw

    bf16 = {n: "*bf16" for n in ("x_ptr", "r_ptr", "gn_ptr", "gr_ptr", "gx_ptr", "y_ptr", "gy_ptr", "gu_ptr",
                                 "out_ptr", "g_gu_ptr", "q_ptr", "k_ptr", "cs_ptr")}  # cos_sin: the model dtype
    fp32 = {n: "*fp32" for n in ("w1_ptr", "rs_ptr", "w_ptr", "gw_ptr")}
    fp32.update(alpha="fp32", limit="fp32", beta="fp32")  # the SwiGLU's scalars
    rows = [
        compile_report(lean._add_norm_bwd, {**bf16, **fp32}, dict(HAS_GN=True, HAS_GR=True, BLOCK=p2(HIDDEN)), 8, 3,
                       divisible=("h",)),
        compile_report(lean._norm_rope_bwd, {**bf16, **fp32, "g_ptr": "*bf16"},
                       dict(TO_BF16=True, BLOCK_H=p2(HEADS), BLOCK_D=p2(HEAD_DIM)), 8, 3, divisible=()),
        compile_report(lean._weighted_rows_bwd, {**bf16, **fp32, "g_ptr": "*fp32"},
                       dict(TO_BF16=True, BLOCK=p2(HIDDEN)), 8, 3, divisible=("h",)),
        compile_report(lm._logprobs, {"x_ptr": "*bf16", "t_ptr": "*i64", "out_ptr": "*fp32"},
                       dict(JAC=True, TO_BF16=True, LIBDEVICE=True, BLOCK=lm.BLOCK), 8, 3, divisible=()),
        compile_report(sw._fwd, {**bf16, **fp32}, dict(EXPF=True, BLOCK_R=sw.BLOCK_R, BLOCK_C=sw.BLOCK_C), 4, 3,
                       divisible=("inter",)),
        compile_report(sw._bwd, {**bf16, **fp32, "g_ptr": "*bf16"},
                       dict(EXPF=True, BLOCK_R=sw.BLOCK_R, BLOCK_C=sw.BLOCK_C), 4, 3, divisible=("inter",)),
        compile_report(mt._block_scores, {**bf16, "out_ptr": "*fp32", "tile_q0_ptr": "*i32", "tile_q1_ptr": "*i32",
                                          "tile_s0_ptr": "*i32"},
                       dict(HI=KV_HEADS, D=INDEX_DIM, BQ=64, PREC="tf32"), 4, 3, divisible=()),
    ]
    print(json.dumps({"command": " ".join(["python"] + sys.argv), "arch": "sm_90", "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
