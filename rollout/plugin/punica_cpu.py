"""Punica LoRA ops for vLLM's CPU wrapper as one GEMM per adapter slot instead of per-token weight gathers.

vLLM's torch ops (`vllm.lora.ops.torch_ops`, used by `PunicaWrapperCPU`) gather each token's `[out, in]` LoRA
matrix (`weights[indices]`) and run a batched matvec: at the embedded default's step that is 68% of the engine's
CPU time. Here each slot's rows run as one `x @ W^T`. Precision is the same as vLLM's ops: inputs and weights are
cast to the output buffer's dtype (fp32 shrink buffer, activation-dtype expand), products accumulate in that dtype;
only the summation order of the dot products differs.

Tokens with index -1 (requests without an adapter) get no delta, as in vLLM's GPU kernels; vLLM's torch ops
instead read the last slot for them (`weights[-1]`).
"""

import torch


def _grouped_matmul(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """`out[t] = inputs[t] @ weights[indices[t]]^T` in `dtype`; zero rows where indices[t] < 0."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights  # [slots, 1, out, in] -> [slots, out, in]
    x = inputs.to(dtype)
    indices = indices[: x.shape[0]]
    slots = torch.unique(indices).tolist()
    if len(slots) == 1 and slots[0] >= 0:  # the common case: every token on one adapter
        return x @ w[slots[0]].to(dtype).t()
    out = x.new_zeros(x.shape[0], w.shape[1])
    for s in slots:
        if s >= 0:
            rows = (indices == s).nonzero(as_tuple=True)[0]
            out[rows] = x[rows] @ w[s].to(dtype).t()
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    # `lora_b_weights` (the A matrices here) is vLLM's parameter name: ours must accept the same keywords
    out = _grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : out.shape[1]] = scaling * out


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    out = _grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if out.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(out.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common] += out[:limit, :common]
    else:
        output_tensor[:, :common] = out[:limit, :common]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    out = _grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += out
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = out


def _explode(lora_indices_tensor, seq_len_tensor):
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _explode(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, lora_b_weights, output_tensor, _explode(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, _explode(lora_indices_tensor, seq_len_tensor),
                      slice_offset, slice_size, add_inputs)


OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")
