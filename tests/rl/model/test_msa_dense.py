"""rl.model.msa_dense: where the dense path takes one varlen FlashAttention call (CPU: the rule, the call's keywords
against this torch's varlen_attn, the cached offsets). Its numbers on the GPU: tests/rl/model/test_msa_block_outer.py
(test_packed_short_sequences_take_varlen_flash_gpu) and test_short_sequences_are_causal_sdpa (SDPA per sequence)."""

import inspect

import torch

from rl.model import msa_dense


def test_varlen_flash_only_where_it_runs():
    """The dense path's varlen FlashAttention is taken only for CUDA half-precision inputs of a FlashAttention head
    dim, and for batches where SDPA per sequence would be slower; its offsets are int32 cumulative lengths, shared by
    every call of a batch layout."""
    cpu = torch.device("cpu")
    assert msa_dense._varlen(cpu, torch.bfloat16, 128) is None and msa_dense._varlen(cpu, torch.float32, 16) is None
    cu = msa_dense._cu_seqlens((250, 256, 77), cpu)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 250, 506, 583]
    assert msa_dense._cu_seqlens((250, 256, 77), cpu) is cu
    # the call as this torch's varlen_attn takes it (its keywords changed between 2.11 and 2.13)
    call = msa_dense.varlen_causal()
    inspect.signature(call.func).bind(*[None] * 7, scale=0.1, **call.keywords)
    # one varlen call from 5 sequences, or for 2-4 of at most 1,024 tokens; SDPA per sequence otherwise
    assert msa_dense.prefers_varlen([2048] * 5) and msa_dense.prefers_varlen([1024, 300])
    assert not msa_dense.prefers_varlen([1025, 300]) and not msa_dense.prefers_varlen([2048] * 4)
    assert not msa_dense.prefers_varlen([100])
