"""The trainer's row kernels (lean backwards, SwiGLU-OAI, the LM head's softmax) and the MSA indexer's block scores
compiled for Hopper (sm_90) on this CPU machine by scripts/trainer_kernel_resources.py, under the Triton of each
supported torch (tests/triton_interpreter.py): they compile at M3's sizes and fit in shared memory. Their results
are checked under the interpreter (test_*_triton.py) and on the GPU (`-m gpu`)."""

import json

from tests.triton_interpreter import HOPPER_SHARED_BYTES, run_with_triton


def test_row_kernels_compile_for_hopper(triton_version):
    report = json.loads(run_with_triton("scripts/trainer_kernel_resources.py", interpret=False, triton=triton_version))
    assert [k["kernel"] for k in report["kernels"]] == ["_add_norm_bwd", "_norm_rope_bwd", "_weighted_rows_bwd",
                                                         "_logprobs", "_fwd", "_bwd", "_block_scores"]
    for k in report["kernels"]:
        assert k["shared_bytes"] <= HOPPER_SHARED_BYTES and not k["wgmma_serialized"], k
