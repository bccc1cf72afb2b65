"""The trainer's MiniMax-M3: the frozen base exactly as the engine serves it, rank-r LoRA, routing and MSA replay.

Module paths are transformers' `minimax_m3_vl` paths (so LoRA tensors get peft's names); the config is
transformers' `MiniMaxM3VLTextConfig` parsed from the served checkpoint; norms and the rotary frequencies are
transformers' classes. The forward follows vLLM's op order and precision, not transformers': Gemma norms with the
fused residual add in fp32, RoPE with vLLM's model-dtype cos/sin cache, fp32 router, routed-expert weights scaled
before the fp32 weighted sum, the index q/k rounded to bf16, LoRA beside each base GEMM.

Inputs are packed without padding: `input_ids [T]` with `cu_seqlens [B+1]` (left padding would shift MSA blocks).
"""

from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch import nn
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRMSNorm

from m3.config import DTYPES
from quant.kernels import nvfp4_moe_linear, sort_by_expert
from quant.kv_cache import nvfp4_kv_qdq
from rl.model import msa
from rl.model.lean import (add_rows_, fp32_linear, fused_add_norm, lm_head_logprobs, norm_rope, weighted_rows,
                           weighted_sum)
from rl.model.lora import ExpertLoRA, LoRAConfig
from rl.model.options import AttentionImpl, Base, DType, IndexerKVDType, KVCacheDType, MoEImpl, Profile, check_choice
from rl.model.packed import host_offsets, seq_bounds, sequence_group_spans, token_positions
from rl.model.quantized_base import BaseWeights
from rl.model.routing_replay import route, routing_match_rate, validate_replay
from rl.model.swiglu_triton import swiglu_oai
from rollout.capture import DENSE_LAYER


@dataclass
class TrainerModelConfig:
    path: str  # the served checkpoint (bf16 or quantized by scripts/quantize_checkpoint.py)
    dtype: str = "bfloat16"
    base: str = "quantized"  # "quantized": NVFP4 experts + MXFP8 linears (quantized on load if stored bf16); "bf16"
    profile: str = "hopper"  # serving form: "hopper" (H100/H200, any LoRA) | "blackwell" (SM100 without LoRA)
    marlin_flush: bool = False  # zero subnormal NVFP4 block scales as vLLM's Marlin (GPU + LoRA) does
    kv_cache_dtype: str = "auto"  # "nvfp4": K/V QDQ as the engine's NVFP4 cache stores them
    indexer_kv_dtype: str = "bf16"  # "nvfp4": index keys QDQ likewise
    attention_impl: str = "auto"  # MSA: "reference" (CPU), "block" / "triton" / "flex" (GPU), "auto"
    moe_impl: str = "auto"  # routed experts: "loop" (per expert), "grouped" (CUDA bf16: Triton NVFP4 / _grouped_mm)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (long sequences)
    moe_chunk_tokens: int = 0  # > 0 (with checkpointing, MoE layers): routed experts in expert groups of ~this many
    # tokens x top_k rows and the attention half per group of whole sequences of <= this many tokens, each recomputed
    # in backward (less memory)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def validate(self) -> None:
        for key, enum in (("dtype", DType), ("base", Base), ("profile", Profile), ("kv_cache_dtype", KVCacheDType),
                          ("indexer_kv_dtype", IndexerKVDType), ("attention_impl", AttentionImpl),
                          ("moe_impl", MoEImpl)):
            check_choice(f"model.{key}", getattr(self, key), enum)
        if self.moe_chunk_tokens < 0:
            raise ValueError(f"model.moe_chunk_tokens={self.moe_chunk_tokens}: expected 0 (off) or a token count")
        self.lora.validate()


@dataclass
class ForwardStats:
    """Per layer: how often the trainer's own choice equals the one used (the engine's, under replay), and how
    often the choice used equals the replayed one (1.0 when replay works)."""
    routing_agreement: dict[int, float] = field(default_factory=dict)  # MoE layer -> own top-k == used
    block_agreement: dict[int, float] = field(default_factory=dict)  # sparse layer -> own blocks == used
    routing_replayed: dict[int, float] = field(default_factory=dict)  # MoE layer -> used == engine's
    blocks_replayed: dict[int, float] = field(default_factory=dict)  # sparse layer -> used == engine's
    keep_choices: bool = False  # also keep the discrete choices used, per layer (see M3ForTraining.replay_arrays)
    expert_ids: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [T, top_k]
    block_ids: dict[int, torch.Tensor] = field(default_factory=dict)  # sparse layer -> [T, kv heads, topk]


def _norm(norm: MiniMaxM3VLRMSNorm, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


class Rotary(nn.Module):
    """vLLM's cos/sin cache: fp32 angles, cast to the model dtype, then applied in fp32 (NeoX, partial)."""

    def __init__(self, cfg: MiniMaxM3VLTextConfig, dtype: torch.dtype):
        super().__init__()
        rope = cfg.rope_parameters
        self.rotary_dim = int(cfg.head_dim * rope.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.dtype = dtype

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None, :].to(positions.device)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(self.dtype)


class Indexer(nn.Module):
    def __init__(self, cfg, base: BaseWeights, layer: int, lora: LoRAConfig | None):
        super().__init__()
        p = f"model.layers.{layer}.self_attn"
        self.q_proj = base.linear(f"{p}.index_q_proj", lora if lora and lora.target_indexer else None)
        self.k_proj = base.linear(f"{p}.index_k_proj", lora if lora and lora.target_indexer else None)
        self.q_norm = base.norm(f"{p}.index_q_norm", cfg.rms_norm_eps)
        self.k_norm = base.norm(f"{p}.index_k_norm", cfg.rms_norm_eps)
        self.heads, self.dim = cfg.index_n_heads, cfg.index_head_dim


class Attention(nn.Module):
    def __init__(self, cfg, base: BaseWeights, layer: int, sparse: dict | None, model_cfg: TrainerModelConfig):
        super().__init__()
        p, lora = f"model.layers.{layer}.self_attn", model_cfg.lora
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            base.linear(f"{p}.{n}_proj", lora if f"{n}_proj" in lora.target_modules else None) for n in "qkvo")
        self.q_norm = base.norm(f"{p}.q_norm", cfg.rms_norm_eps)
        self.k_norm = base.norm(f"{p}.k_norm", cfg.rms_norm_eps)
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.sparse = sparse
        self.indexer = Indexer(cfg, base, layer, lora if "q_proj" in lora.target_modules else None) if sparse else None
        self.kv_nvfp4 = model_cfg.kv_cache_dtype == "nvfp4"
        self.index_nvfp4 = model_cfg.indexer_kv_dtype == "nvfp4"
        self.impl = model_cfg.attention_impl

    def forward(self, x, cos_sin, rotary_dim, cu_seqlens, positions, replay_blocks=None):
        t = x.shape[0]
        q = norm_rope(self.q_norm, self.q_proj(x).view(t, self.heads, self.head_dim), cos_sin, rotary_dim)
        k = norm_rope(self.k_norm, self.k_proj(x).view(t, self.kv_heads, self.head_dim), cos_sin, rotary_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if self.kv_nvfp4:
            k, v = nvfp4_kv_qdq(k), nvfp4_kv_qdq(v)
        own = agreement = replayed = None
        if self.indexer is not None:
            # No graph: the indexer only picks blocks (a discrete top-k), so its LoRA gets no gradient from a token
            # loss either way, and its activations would be held for nothing until the layer returns.
            with torch.no_grad():
                ix = self.indexer
                iq = norm_rope(ix.q_norm, ix.q_proj(x).view(t, ix.heads, ix.dim), cos_sin, rotary_dim)
                ik = norm_rope(ix.k_norm, ix.k_proj(x).view(t, 1, ix.dim), cos_sin, rotary_dim)[:, 0]
                ik = ik.to(torch.bfloat16)  # vLLM's index cache is bf16 even in fp32 models
                if self.index_nvfp4:
                    ik = nvfp4_kv_qdq(ik)
                own = msa.select_blocks(iq, ik, cu_seqlens, self.sparse["topk"], self.sparse["init"],
                                        self.sparse["local"], positions=positions)
                del iq, ik
            blocks = own
            if replay_blocks is not None:  # validated by M3ForTraining.hidden_states
                blocks = replay_blocks.to(own.device)
            agreement = msa.selection_match_rate(own, blocks)
            if replay_blocks is not None:
                replayed = msa.selection_match_rate(blocks, replay_blocks)
        else:
            blocks = all_visible_blocks(positions, self.kv_heads)
        out = msa.sparse_attention(q, k, v, blocks, cu_seqlens, self.head_dim ** -0.5, impl=self.impl,
                                   validate=False)
        return self.o_proj(out.reshape(t, self.heads * self.head_dim)), own, (agreement, replayed)


def all_visible_blocks(positions: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Dense causal attention as block-sparse attention that selects every visible block."""
    nb = int(positions.max()) // msa.BLOCK + 1
    ids = torch.arange(nb, device=positions.device)[None, :].expand(len(positions), nb)
    ids = torch.where(ids <= (positions // msa.BLOCK)[:, None], ids, -1).to(torch.int32)
    return ids[:, None, :].expand(len(positions), kv_heads, nb).contiguous()


class MLP(nn.Module):
    """Dense MLP / shared expert: fused gate_up -> SwiGLU-OAI (clamped) -> down."""

    def __init__(self, base: BaseWeights, prefix: str, src: str, cfg, lora: LoRAConfig):
        super().__init__()
        use = lambda n: lora if n in lora.target_modules else None  # noqa: E731
        self.gate_up_proj = base.fused_linear(f"{prefix}.gate_up_proj", [f"{src}.gate_proj", f"{src}.up_proj"],
                                              use("gate_up_proj"))
        self.down_proj = base.linear(f"{src}.down_proj", use("down_proj"), name=f"{prefix}.down_proj")
        self.alpha, self.limit, self.beta = cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_beta

    def forward(self, x):
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit, self.beta))


class MoE(nn.Module):
    def __init__(self, cfg, base: BaseWeights, layer: int, model_cfg: TrainerModelConfig):
        super().__init__()
        p = f"model.layers.{layer}.block_sparse_moe"
        self.register_buffer("gate", base.tensor(f"{p}.gate.weight").float())
        self.register_buffer("bias", base.tensor(f"{p}.e_score_correction_bias").float())
        self.experts = base.experts(f"{p}.experts", cfg.num_local_experts)
        lora = model_cfg.lora
        if lora.target_experts:  # at mlp.experts.lora: peft names it mlp.experts[.base_layer].lora_*
            self.experts.lora = ExpertLoRA(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, lora)
        self.shared_experts = MLP(base, f"model.layers.{layer}.mlp.shared_experts", f"{p}.shared_experts", cfg, lora)
        self.top_k, self.scaling = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.alpha, self.limit, self.beta = cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_beta
        self.impl, self.num_experts = model_cfg.moe_impl, cfg.num_local_experts
        self.chunk_tokens = model_cfg.moe_chunk_tokens

    def _use_grouped(self, x) -> bool:
        fits = x.is_cuda and x.dtype == torch.bfloat16
        if self.impl == "grouped" and not fits:
            raise ValueError("model.moe_impl='grouped' needs CUDA and bf16")
        return fits and self.impl != "loop"

    def forward(self, x, replay_ids=None, recompute=False):
        """recompute: this MoE is the layer's own recompute unit (DecoderLayer.forward's checkpoint_parts): the
        routed experts (in expert groups) and the shared expert are rebuilt in backward here, not by a layer-wide
        checkpoint around them."""
        logits = fp32_linear(x, self.gate)  # GateLinear: fp32 weights and output
        weights, ids, own = route(logits, self.bias, self.top_k, self.scaling, replay_ids)
        chunk = self.chunk_tokens
        if torch.is_grad_enabled() and (recompute or (chunk and x.shape[0] > chunk)):
            routed = self._routed_in_groups(x, weights, ids, chunk * self.top_k if chunk else ids.numel())
        else:
            routed = self._routed(x, weights, ids)
        if recompute and torch.is_grad_enabled():
            shared = torch.utils.checkpoint.checkpoint(self.shared_experts, x, use_reentrant=False)
        else:
            shared = self.shared_experts(x)
        return routed + shared, own, ids

    def _routed(self, x, weights, ids):
        """The routed experts' weighted sum, in x's dtype (vLLM: fp32 sum of the scaled expert outputs)."""
        order, offsets = sort_by_expert(ids, self.num_experts)
        tok = order // self.top_k
        y = self._experts(x[tok], offsets, 0, self.num_experts)
        return weighted_sum(y, weights.reshape(-1)[order], tok, x.shape[0]).to(x.dtype)

    def _routed_in_groups(self, x, weights, ids, max_rows):
        """_routed by groups of consecutive experts of about max_rows rows each, each group recomputed in backward:
        a long batch holds one group's expert activations at a time. Groups of experts rather than of tokens: each
        expert sees all its rows of the batch in one call, so the NVFP4 experts decode their weights once per pass
        and run large GEMMs (token chunks gave each expert 1/n of its rows per call, where the NVFP4 path is
        slowest: results/gpu/issue19_targets.json)."""
        order, offsets = sort_by_expert(ids, self.num_experts)
        e, n = self.experts, self.num_experts + 1
        scales = [getattr(e, f"{w}_gs").reshape(-1) for w in ("w13", "w2")] if e.quantized else []
        # One host sync per layer pass: the group boundaries and, for NVFP4, what its decode path reads on the host
        # (it would sync once per call otherwise, i.e. per group, linear and pass: ~0.1 s per 4-layer step)
        host = torch.cat([offsets.double(), *(g.double() for g in scales)]).tolist()
        bounds = [int(b) for b in host[:n]]
        tok = order // self.top_k
        w = weights.reshape(-1)[order]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e0, e1 in expert_groups(bounds, max_rows):
            lo, hi = bounds[e0], bounds[e1]
            group_host = {"bounds": [b - lo for b in bounds[e0:e1 + 1]], "w13": host[n + e0:n + e1],
                          "w2": host[2 * n - 1 + e0:2 * n - 1 + e1]} if scales else None
            part = torch.utils.checkpoint.checkpoint(self._group, x, tok[lo:hi], w[lo:hi], offsets[e0:e1 + 1] - lo,
                                                     e0, e1, group_host, use_reentrant=False)
            out = add_rows_(out, tok[lo:hi], part)  # the fp32 weighted sum, as weighted_sum's
        return out.to(x.dtype)

    def _group(self, x, tok, w, offsets, e0, e1, host):
        # recomputed in backward: NVFP4 weights decoded in the recompute serve this group's input gradient
        return weighted_rows(self._experts(x[tok], offsets, e0, e1, host, keep_decoded=True), w)

    def _experts(self, xs, offsets, e0, e1, host=None, keep_decoded=False):
        """Experts e0..e1-1 on their rows xs (sorted by expert, expert e0+i's at offsets[i]:offsets[i+1]): on CUDA in
        bf16 two grouped GEMMs, NVFP4 (quant.kernels, the same serving form as the per-expert loop) or, for the bf16
        base, torch._grouped_mm, with expert LoRA in grouped GEMMs over the same offsets
        (rl.model.lora.grouped_lora_delta; with the NVFP4 base one autograd node, ExpertLoRA.with_nvfp4_base);
        elsewhere per expert. host: the offsets ("bounds") and NVFP4 decode scales
        ("w13", "w2") of these experts as host lists, if known. keep_decoded: nvfp4_moe_linear's (only for calls
        recomputed under activation checkpointing)."""
        e, lora, sel = self.experts, getattr(self.experts, "lora", None), slice(e0, e1)
        if not self._use_grouped(xs):
            return self._per_expert(xs, offsets.tolist(), e0, e1, lora)

        def linear(inp, name, which):  # the base linear plus the LoRA delta of `which` ("gate_up" / "down")
            if e.quantized:
                weights = (e.packed(name)[sel], getattr(e, f"{name}_scale")[sel], getattr(e, f"{name}_gs")[sel])
                base = {"host": None if host is None else (host[name], host["bounds"]), "keep_decoded": keep_decoded}
                if lora is not None:  # one node: the base's input gradient added inside its GEMMs
                    return lora.with_nvfp4_base(which, inp, offsets, *weights, experts=sel, **base)
                return nvfp4_moe_linear(inp, *weights, offsets, **base)
            y = torch._grouped_mm(inp, getattr(e, name)[sel].transpose(1, 2), offs=offsets[1:])
            return y if lora is None else y + getattr(lora, f"{which}_grouped")(inp, offsets, experts=sel)

        act = swiglu_oai(linear(xs, "w13", "gate_up"), self.alpha, self.limit, self.beta)
        return linear(act, "w2", "down")

    def _per_expert(self, xs, bounds, e0, e1, lora):
        rows = []
        for i in range(e1 - e0):
            a, b = bounds[i], bounds[i + 1]
            if b == a:
                continue
            xe = xs[a:b]
            gate_up = self.experts.gate_up(xe, e0 + i)
            if lora is not None:
                gate_up = gate_up + lora.gate_up(xe, e0 + i)
            act = swiglu_oai(gate_up, self.alpha, self.limit, self.beta)
            y = self.experts.down(act, e0 + i)
            if lora is not None:
                y = y + lora.down(act, e0 + i)
            rows.append(y)
        return torch.cat(rows) if rows else xs.new_zeros(0, xs.shape[1])


def expert_groups(bounds: list[int], max_rows: int) -> list[tuple[int, int]]:
    """Ranges [e0, e1) of consecutive experts with rows (bounds: host offsets [E+1]) of at most max_rows rows each;
    an expert with more rows is a range of its own."""
    groups, e0 = [], 0
    for e in range(1, len(bounds)):
        if bounds[e] - bounds[e0] > max_rows and e - 1 > e0:
            groups.append((e0, e - 1))
            e0 = e - 1
    groups.append((e0, len(bounds) - 1))
    return [(a, b) for a, b in groups if bounds[b] > bounds[a]]


class DecoderLayer(nn.Module):
    def __init__(self, cfg, base: BaseWeights, layer: int, sparse: dict | None, is_moe: bool, mcfg):
        super().__init__()
        p = f"model.layers.{layer}"
        self.input_layernorm = base.norm(f"{p}.input_layernorm", cfg.rms_norm_eps)
        self.post_attention_layernorm = base.norm(f"{p}.post_attention_layernorm", cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, base, layer, sparse, mcfg)
        self.mlp = MoE(cfg, base, layer, mcfg) if is_moe else MLP(base, f"{p}.mlp", f"{p}.mlp", cfg, mcfg.lora)
        self.is_moe = is_moe

    def _attention_part(self, x, residual, rope, cu_seqlens, positions, replay_blocks, embed=None):
        if embed is not None:  # x holds token ids (see M3ForTraining.hidden_states)
            x = embed[x]
        if residual is None:
            residual, x = x, _norm(self.input_layernorm, x)
        else:
            x, residual = fused_add_norm(self.input_layernorm, x, residual)
        x, own_blocks, (block_agree, block_replayed) = self.self_attn(x, *rope, cu_seqlens, positions, replay_blocks)
        x, residual = fused_add_norm(self.post_attention_layernorm, x, residual)
        return x, residual, own_blocks, block_agree, block_replayed

    def _attention_in_groups(self, x, residual, rope, cu_seqlens, positions, replay_blocks, embed):
        """The attention half under one checkpoint per group of whole sequences of <= moe_chunk_tokens tokens. MSA
        never crosses a sequence and every other op is per token, so this is the math of one checkpoint over the
        batch, but its recompute and backward hold one group's q / k / v / attention activations at a time (at
        8 x 16K tokens one [T, 8192] bf16 tensor is 2.1 GB)."""
        groups = sequence_group_spans(seq_bounds(cu_seqlens), self.mlp.chunk_tokens)
        parts = []
        for s, e, sub_cu in groups:
            parts.append(torch.utils.checkpoint.checkpoint(
                self._attention_part, x[s:e], None if residual is None else residual[s:e],
                (rope[0][s:e], *rope[1:]), sub_cu, positions[s:e],
                None if replay_blocks is None else replay_blocks[s:e], embed, use_reentrant=False))
        if len(parts) == 1:
            return parts[0]
        xs, residuals, own, agree, replayed = zip(*parts)
        tokens = [e - s for s, e, _ in groups]

        def mean(values):  # the agreement over all (token, head) rows, from each group's fraction
            return None if values[0] is None else sum(v * n for v, n in zip(values, tokens)) / sum(tokens)

        return (torch.cat(xs), torch.cat(residuals), None if own[0] is None else torch.cat(own), mean(agree),
                mean(replayed))

    def forward(self, x, residual, rope, cu_seqlens, positions, replay_ids=None, replay_blocks=None,
                checkpoint_parts=False, embed=None):
        """checkpoint_parts (MoE layers, in training): recompute the attention half under checkpoints by groups of
        sequences and let the MoE recompute its own parts. A layer-wide checkpoint around chunked experts would run
        them forward three times (forward, the layer's recompute, each chunk's recompute); this way twice, with the
        same memory bound.
        embed: the embedding table, when x holds the token ids (the first layer embeds them itself)."""
        args = (x, residual, rope, cu_seqlens, positions, replay_blocks, embed)
        if checkpoint_parts:
            x, residual, own_blocks, block_agree, block_replayed = self._attention_in_groups(*args)
        else:
            x, residual, own_blocks, block_agree, block_replayed = self._attention_part(*args)
        own_ids = used_ids = None
        if self.is_moe:
            x, own_ids, used_ids = self.mlp(x, replay_ids, recompute=checkpoint_parts)
        else:
            x = self.mlp(x)
        return x, residual, (own_blocks, (block_agree, block_replayed), own_ids, used_ids)


class M3ForTraining(nn.Module):
    def __init__(self, mcfg: TrainerModelConfig, base: BaseWeights | None = None, on_layer=None):
        """base: the frozen weights (default: opened from mcfg.path); on_layer(layer): called on each decoder layer
        right after it is built, e.g. to shard it before the next one exists (full-size models)."""
        super().__init__()
        mcfg.validate()
        self.mcfg = mcfg
        self.dtype = DTYPES[mcfg.dtype]
        if base is None:
            base = BaseWeights.open(mcfg.path, self.dtype, mcfg.base, mcfg.profile, mcfg.marlin_flush)
        self.raw_config = base.text_config
        self.config = cfg = MiniMaxM3VLTextConfig(
            bos_token_id=None, **{k: v for k, v in base.text_config.items() if k not in ("dtype", "bos_token_id")})
        cfg.swiglu_beta = base.text_config.get("swiglu_beta", 1.0)  # transformers hardcodes +1; vLLM reads it
        sparse_cfg = base.text_config.get("sparse_attention_config") or {}
        self.sparse_layers = [i for i, f in enumerate(sparse_cfg.get("sparse_attention_freq", [])) if f]
        moe_freq = base.text_config.get("moe_layer_freq") or [1] * cfg.num_hidden_layers
        self.moe_layers = [i for i, f in enumerate(moe_freq) if f]
        sparse = {"topk": sparse_cfg.get("sparse_topk_blocks"), "init": sparse_cfg.get("sparse_init_block", 0),
                  "local": sparse_cfg.get("sparse_local_block", 0)}
        # transformers' layout (model.embed_tokens / model.layers / model.norm, lm_head): peft names follow it
        self.model = nn.Module()
        self.model.embed_tokens = nn.Parameter(base.tensor("model.embed_tokens.weight").to(self.dtype),
                                               requires_grad=False)
        self.model.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            layer = DecoderLayer(cfg, base, i, sparse if i in self.sparse_layers else None, i in self.moe_layers, mcfg)
            for name, p in layer.named_parameters():
                p.requires_grad_(".lora" in name or "lora_" in name)
            self.model.layers.append(layer)
            if on_layer is not None:
                on_layer(layer)
        self.model.norm = base.norm("model.norm", cfg.rms_norm_eps)
        self.lm_head = nn.Parameter(base.tensor("lm_head.weight").to(self.dtype), requires_grad=False)
        self.rotary = Rotary(cfg, self.dtype)
        self.num_experts = cfg.num_local_experts
        for name, p in self.named_parameters():
            p.requires_grad_(".lora" in name or "lora_" in name)
        assert all("lora" in n for n, p in self.named_parameters() if p.requires_grad), "only LoRA trains"

    def hidden_states(self, input_ids, cu_seqlens, routing=None, blocks=None, stats: ForwardStats | None = None):
        """Final hidden states [T, H]. routing: engine expert ids [T, num_layers, top_k] (None: own top-k);
        blocks: engine MSA block ids [T, num_sparse_layers, kv_heads, topk] (None: own selection)."""
        # Offsets on the host from here on: each layer's MSA calls (and each sequence group's) read them without a
        # device->host sync, which would drain the launch queue every time
        cu_seqlens = host_offsets(cu_seqlens)
        positions = token_positions(cu_seqlens, input_ids.device)
        if routing is not None:
            validate_replay(torch.as_tensor(routing), len(input_ids), len(self.model.layers),
                            self.config.num_experts_per_tok,
                            self.num_experts, self.moe_layers, DENSE_LAYER(self.num_experts))
            routing = torch.as_tensor(routing).long().to(input_ids.device)
        rope = (self.rotary.cos_sin(positions), self.rotary.rotary_dim)
        recompute = self.mcfg.activation_checkpointing and torch.is_grad_enabled()
        # Under recompute the first layer embeds the ids itself: its checkpoint then keeps the ids, not [T, H]
        x, residual = (input_ids if recompute else self.model.embed_tokens[input_ids]), None
        for i, layer in enumerate(self.model.layers):
            replay_ids = routing[:, i] if routing is not None and i in self.moe_layers else None
            replay_blocks = None
            if blocks is not None and i in self.sparse_layers:
                replay_blocks = torch.as_tensor(blocks)[:, self.sparse_layers.index(i)].to(input_ids.device,
                                                                                           torch.int32)
                # Checked once per forward over the whole batch, not in the layer: its recompute and its sequence
                # groups would check again, naming rows relative to a group
                msa.validate_block_ids(replay_blocks, cu_seqlens, num_heads=layer.self_attn.kv_heads)
            args = (x, residual, rope, cu_seqlens, positions, replay_ids, replay_blocks)
            embed = self.model.embed_tokens if recompute and i == 0 else None
            if recompute and layer.is_moe and layer.mlp.chunk_tokens:
                out = layer(*args, checkpoint_parts=True, embed=embed)
            elif recompute:
                out = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, embed=embed)
            else:
                out = layer(*args)
            x, residual, (own_b, (agree_b, replayed_b), own_ids, used_ids) = out
            if stats is not None and agree_b is not None:
                stats.block_agreement[i] = agree_b
                if replayed_b is not None:
                    stats.blocks_replayed[i] = replayed_b
            if stats is not None and own_ids is not None:
                stats.routing_agreement[i] = routing_match_rate(own_ids, used_ids)
                if replay_ids is not None:
                    stats.routing_replayed[i] = routing_match_rate(used_ids, replay_ids)
            if stats is not None and stats.keep_choices:
                if used_ids is not None:
                    stats.expert_ids[i] = used_ids.detach()
                if own_b is not None:
                    stats.block_ids[i] = (replay_blocks if replay_blocks is not None else own_b).detach()
        if stats is not None:  # the agreements as floats, read once the whole forward is queued
            for rates in (stats.routing_agreement, stats.block_agreement, stats.routing_replayed,
                          stats.blocks_replayed):
                rates.update({i: float(r) for i, r in rates.items()})
        x, _ = fused_add_norm(self.model.norm, x, residual)
        return x

    def replay_arrays(self, stats: ForwardStats) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The choices a forward with `stats.keep_choices` used, in the engine's capture layout (rollout.capture):
        routing [T, layers, top_k] (dense layers hold DENSE_LAYER) and blocks [T, sparse layers, kv heads, topk],
        to replay them in another forward (e.g. on another device)."""
        any_ids = next(iter(stats.expert_ids.values()))
        routing = torch.full((any_ids.shape[0], len(self.model.layers), any_ids.shape[1]),
                             DENSE_LAYER(self.num_experts), dtype=torch.long)
        for i, ids in stats.expert_ids.items():
            routing[:, i] = ids.cpu()
        blocks = torch.stack([stats.block_ids[i].cpu() for i in self.sparse_layers], 1) if self.sparse_layers else None
        return routing, blocks

    def token_logprobs(self, input_ids, cu_seqlens, targets, **kw) -> torch.Tensor:
        """log p(targets[t] | tokens <= t) for every packed position t, fp32 [T] (the logits in row chunks)."""
        return lm_head_logprobs(self.hidden_states(input_ids, cu_seqlens, **kw), self.lm_head, targets)
