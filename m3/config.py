"""The MiniMax-M3 text config both sides read: defaults for the tiny model, derived keys, and the validation that
names the first field vLLM's M3 classes (or transformers' twin) cannot serve. No vLLM, no trainer: the trainer
(rl/), the engine plugin (rollout/) and the scripts all import this.
"""

from __future__ import annotations

import contextlib
import copy

import torch

# The dtype names a config may give, one table for every package.
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")  # they get ids 0..3
EOS_ID, PAD_ID = 2, 3  # <|im_end|>, <pad>
TOKENIZER_VOCAB = 512

# Legacy text_config keys, i.e. what vLLM's MiniMaxM3TextConfig reads. All are written explicitly
# so its 60-layer defaults can never leak in.
DEFAULT_TEXT_CONFIG = {
    "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4, "max_position_embeddings": 4096,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "rms_norm_eps": 1e-6,
    "intermediate_size": 128,  # routed experts; vLLM's shared expert = this * n_shared_experts
    "dense_intermediate_size": 512,  # dense-MLP layers (moe_layer_freq 0)
    "rope_theta": 5000000.0, "rotary_dim": 64,  # vLLM ropes by partial_rotary_factor, not rotary_dim
    "hidden_act": "swigluoai", "swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": 7.0,
    "use_gemma_norm": True, "use_qk_norm": True, "qk_norm_type": "per_head", "attention_output_gate": False,
    "num_local_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "scoring_func": "sigmoid", "use_routing_bias": True, "routed_scaling_factor": 2.0,
    "num_mtp_modules": 0,  # no mtp.* weights are written
    "tie_word_embeddings": False, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
}
SPARSE_DEFAULTS = {"sparse_index_dim": 128, "sparse_topk_blocks": 2, "sparse_block_size": 128,
                   "sparse_init_block": 0, "sparse_local_block": 1, "sparse_score_type": "max"}
# Filled from other keys unless given explicitly (see resolve_text_config).
DERIVED_KEYS = {"partial_rotary_factor", "shared_intermediate_size", "moe_layer_freq",
                "sparse_attention_freq", "sparse_num_index_heads"}
_SPARSE_KEYS = set(SPARSE_DEFAULTS) | {k for k in DERIVED_KEYS if "sparse" in k}


def resolve_text_config(**overrides) -> dict:
    """Default text_config + ``overrides`` + derived keys. Sparse keys may be given flat
    (``sparse_topk_blocks=4``) or as a partial ``sparse_attention_config`` dict."""
    known = set(DEFAULT_TEXT_CONFIG) | set(SPARSE_DEFAULTS) | DERIVED_KEYS | {"sparse_attention_config"}
    sparse_in = overrides.get("sparse_attention_config") or {}
    if unknown := sorted(set(overrides) - known) + sorted(set(sparse_in) - _SPARSE_KEYS):
        raise ValueError(f"unknown tiny-model config key(s) {unknown}; known: {sorted(known)}")
    cfg, sparse = copy.deepcopy(DEFAULT_TEXT_CONFIG), dict(SPARSE_DEFAULTS)
    sparse.update(copy.deepcopy(sparse_in))
    for key, value in overrides.items():
        if key != "sparse_attention_config":
            (sparse if key in _SPARSE_KEYS else cfg)[key] = copy.deepcopy(value)
    # Bad values are left for validate_config to name, hence the guards.
    if isinstance(n := cfg["num_hidden_layers"], int) and n > 0:
        pattern = [0] + [1] * (n - 1)  # layer 0 dense attention + dense MLP, like the real model
        cfg.setdefault("moe_layer_freq", list(pattern))
        sparse.setdefault("sparse_attention_freq", list(pattern))
    sparse.setdefault("sparse_num_index_heads", cfg["num_key_value_heads"])
    with contextlib.suppress(TypeError, ZeroDivisionError):
        cfg.setdefault("partial_rotary_factor", cfg["rotary_dim"] / cfg["head_dim"])
    with contextlib.suppress(TypeError):
        cfg.setdefault("shared_intermediate_size", cfg["intermediate_size"] * cfg["n_shared_experts"])
    cfg["sparse_attention_config"] = dict(sorted(sparse.items()))
    return dict(sorted(cfg.items()))


_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "dense_intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rotary_dim", "num_local_experts", "num_experts_per_tok", "n_shared_experts",
                  "max_position_embeddings", "sparse_topk_blocks", "sparse_num_index_heads")
# Values transformers hardcodes (or neither side implements otherwise): anything else would make
# the HF twin a different model from the one vLLM serves.
_FIXED = (("sparse_init_block", 0, "transformers' MiniMaxM3VLIndexer has no init blocks"),
          ("sparse_score_type", "max", "transformers' indexer only max-pools"),
          ("scoring_func", "sigmoid", "transformers' router is sigmoid-only"),
          ("use_routing_bias", True, "transformers always adds e_score_correction_bias"),
          ("swiglu_beta", 1.0, "transformers hardcodes (up + 1)"),
          ("tie_word_embeddings", False, "vLLM's MiniMaxM3SparseForCausalLM loads its own lm_head"),
          ("use_gemma_norm", True, "both implement only Gemma (1 + w) norms"),
          ("use_qk_norm", True, "both always apply q/k norms"),
          ("qk_norm_type", "per_head", "both implement only per-head q/k norms"),
          ("attention_output_gate", False, "neither implements an output gate"))


def validate_config(cfg: dict) -> None:
    """Raise one ValueError naming the first field vLLM (or the HF twin) cannot handle.
    ``cfg`` is a config.json dict (with ``text_config``) or a text_config dict."""
    t = cfg.get("text_config", cfg)
    s = t.get("sparse_attention_config") or {}
    g = {k: s.get(k) for k in _SPARSE_KEYS} | {k: v for k, v in t.items() if k not in _SPARSE_KEYS}

    def check(ok, name, why):
        if not ok:
            where = "sparse_attention_config." if name in _SPARSE_KEYS else ""
            raise ValueError(f"text_config.{where}{name}={g.get(name)!r}: {why}")

    for name in _POSITIVE_INTS:  # later checks may then do arithmetic on these (bool is no int here)
        check(type(g.get(name)) is int and g[name] > 0, name, "must be a positive int")
    n, kv, rot = g["num_hidden_layers"], g["num_key_value_heads"], g["rotary_dim"]
    check(g["head_dim"] == 128, "head_dim", "vLLM's MiniMax-M3 sparse backend supports only 128")
    check(g.get("sparse_block_size") == 128, "sparse_block_size",
          "vLLM's MiniMax-M3 sparse backend and Triton kernels support only 128")
    check(g.get("sparse_index_dim") == 128, "sparse_index_dim",
          "vLLM's fused QKV+indexer projection needs index dim == head_dim == 128")
    check(g["sparse_num_index_heads"] == kv, "sparse_num_index_heads",
          f"vLLM requires index heads == num_key_value_heads ({kv})")
    check(g["num_attention_heads"] % kv == 0, "num_attention_heads",
          f"must be a multiple of num_key_value_heads ({kv})")
    check(rot % 8 == 0 and rot <= g["head_dim"], "rotary_dim",
          "must be a multiple of 8 and <= head_dim (vLLM's fused q/k-norm + RoPE op)")
    check(g.get("partial_rotary_factor") == rot / g["head_dim"], "partial_rotary_factor",
          "must equal rotary_dim / head_dim (vLLM ropes by the factor, not by rotary_dim)")
    check(g["num_experts_per_tok"] <= g["num_local_experts"], "num_experts_per_tok",
          f"must be <= num_local_experts ({g['num_local_experts']})")
    check(g.get("hidden_act") == "swigluoai", "hidden_act", "vLLM's MiniMaxM3MLP supports only swigluoai")
    for name in ("moe_layer_freq", "sparse_attention_freq"):
        v = g.get(name)
        check(isinstance(v, list) and len(v) == n and all(x in (0, 1) for x in v), name,
              f"must list num_hidden_layers={n} entries, each 0 or 1")
    check(g["vocab_size"] >= TOKENIZER_VOCAB, "vocab_size", f"must cover the {TOKENIZER_VOCAB} tokens")
    check(g.get("shared_intermediate_size") == g["intermediate_size"] * g["n_shared_experts"],
          "shared_intermediate_size", "must equal intermediate_size * n_shared_experts: vLLM sizes "
          "the shared expert that way and ignores this key; transformers reads only this key")
    check(g.get("sparse_local_block") in range(g["sparse_topk_blocks"] + 1), "sparse_local_block",
          "must be in [0, sparse_topk_blocks] (more forced local blocks would tie in the top-k)")
    for name, want, why in _FIXED:  # the type check keeps 1 from passing for True
        check(type(g.get(name)) is type(want) and g[name] == want, name, f"must be {want!r}: {why}")


def hf_config_json(t: dict) -> dict:
    """The same model as transformers' MiniMaxM3VLTextConfig (flat index_* / *layer_types keys)."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    s = t["sparse_attention_config"]
    same = ("vocab_size", "hidden_size", "intermediate_size", "dense_intermediate_size", "head_dim",
            "shared_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "rotary_dim", "swiglu_alpha", "swiglu_limit",
            "num_local_experts", "num_experts_per_tok", "routed_scaling_factor", "tie_word_embeddings",
            "eos_token_id", "pad_token_id")
    cfg = MiniMaxM3VLTextConfig(
        **{k: t[k] for k in same}, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"],
                         "partial_rotary_factor": t["partial_rotary_factor"]},
        mlp_layer_types=["sparse" if f else "dense" for f in t["moe_layer_freq"]],
        layer_types=["minimax_m3_sparse" if f else "full_attention" for f in s["sparse_attention_freq"]],
        index_n_heads=s["sparse_num_index_heads"], index_head_dim=s["sparse_index_dim"],
        index_block_size=s["sparse_block_size"], index_topk_blocks=s["sparse_topk_blocks"],
        index_local_blocks=s["sparse_local_block"])
    # transformers keeps no module in fp32, so loading at the bf16 checkpoint dtype would round the
    # fp32 router. Declaring fp32 makes a plain from_pretrained the exact (upcast) reference.
    return {**cfg.to_dict(), "architectures": ["MiniMaxM3VLForCausalLM"], "dtype": "float32"}
