"""M3 checkpoint tensors: the vLLM/MiniMax layout's names, shapes and init of the tiny model, and the renames
between that layout and transformers' MiniMaxM3VLForCausalLM (fused gate_up, 3D expert stacks)."""

from __future__ import annotations

import hashlib
import math

import torch

from m3.config import DTYPES

# Init scales. Fan-in scaling rather than a flat 0.02, so attention, MoE and the shared expert each
# move the residual stream by O(1): a wrong op then shows in logprobs far above bf16 noise.
EMBED_STD = 1.0
LM_HEAD_STD = 0.2  # logits std ~3, mean entropy ~2.8 of 6.2 nats: peaked, not one-hot
NORM_STD = 0.1  # Gemma norms scale by (1 + w): w = 0 would hide a "* w" vs "* (1 + w)" mistake
BIAS_STD = 0.1  # correction bias comparable to sigmoid-score gaps, so ignoring it changes routing
GLU_GAIN = 2.5  # gate/up pre-activations std ~2.5: the swiglu clamp at +-7 fires now and then
OUT_GAIN = 0.5  # o_proj / down_proj / w2


def weight_specs(t: dict) -> dict[str, tuple[tuple[int, ...], float, bool]]:
    """vLLM-layout tensor name -> (shape, init std, stored fp32)."""
    H, D, V = t["hidden_size"], t["head_dim"], t["vocab_size"]
    nq, nkv, s = t["num_attention_heads"], t["num_key_value_heads"], t["sparse_attention_config"]
    nidx, Di = s["sparse_num_index_heads"], s["sparse_index_dim"]
    E, I, S = t["num_local_experts"], t["intermediate_size"], t["shared_intermediate_size"]
    specs = {"model.embed_tokens.weight": ((V, H), EMBED_STD, False),
             "lm_head.weight": ((V, H), LM_HEAD_STD, False)}

    def lin(name, out_f, in_f, gain=1.0, fp32=False):
        specs[name + ".weight"] = ((out_f, in_f), gain / math.sqrt(in_f), fp32)

    def norms(dim, *names):
        specs.update({f"{n}.weight": ((dim,), NORM_STD, False) for n in names})

    def glu(prefix, inter, names=("gate_proj", "up_proj", "down_proj")):
        lin(f"{prefix}.{names[0]}", inter, H, GLU_GAIN)
        lin(f"{prefix}.{names[1]}", inter, H, GLU_GAIN)
        lin(f"{prefix}.{names[2]}", H, inter, OUT_GAIN)

    norms(H, "model.norm")
    for i in range(t["num_hidden_layers"]):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        norms(H, f"{p}.input_layernorm", f"{p}.post_attention_layernorm")
        norms(D, f"{a}.q_norm", f"{a}.k_norm")
        lin(f"{a}.q_proj", nq * D, H)
        lin(f"{a}.k_proj", nkv * D, H)
        lin(f"{a}.v_proj", nkv * D, H)
        lin(f"{a}.o_proj", H, nq * D, OUT_GAIN)
        if s["sparse_attention_freq"][i]:
            lin(f"{a}.index_q_proj", nidx * Di, H)
            lin(f"{a}.index_k_proj", Di, H)  # one index-key head shared by all index-q heads
            norms(Di, f"{a}.index_q_norm", f"{a}.index_k_norm")
        if t["moe_layer_freq"][i]:
            m = f"{p}.block_sparse_moe"
            lin(f"{m}.gate", E, H, fp32=True)  # router logits std ~1: sigmoid scores spread out
            specs[f"{m}.e_score_correction_bias"] = ((E,), BIAS_STD, True)
            for e in range(E):
                glu(f"{m}.experts.{e}", I, ("w1", "w3", "w2"))  # w1=gate, w3=up, w2=down
            glu(f"{m}.shared_experts", S)
        else:
            glu(f"{p}.mlp", t["dense_intermediate_size"])
    return dict(sorted(specs.items()))


def init_weights(t: dict, seed: int = 0, dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """Random vLLM-layout state dict; values are rounded once to the checkpoint dtype."""
    out = {}
    for name, (shape, std, fp32) in weight_specs(t).items():
        name_seed = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")
        w = torch.randn(shape, generator=torch.Generator().manual_seed(name_seed >> 1)) * std
        out[name] = w if fp32 else w.to(DTYPES[dtype])
    return out


_HF_RENAMES = (  # order matters: the bias rename must run before the generic MoE rename
    (".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
    (".block_sparse_moe.", ".mlp."),
    (".self_attn.index_q_proj.", ".self_attn.indexer.q_proj."),
    (".self_attn.index_k_proj.", ".self_attn.indexer.k_proj."),
    (".self_attn.index_q_norm.", ".self_attn.indexer.q_norm."),
    (".self_attn.index_k_norm.", ".self_attn.indexer.k_norm."),
)


def to_hf_state_dict(sd: dict[str, torch.Tensor], t: dict) -> dict[str, torch.Tensor]:
    """vLLM/MiniMax names -> transformers' MiniMaxM3VLForCausalLM names. Gate comes first in
    every fused gate_up, as in transformers' own minimax_m3_vl conversion."""
    hf = {}
    for name, w in sd.items():
        if ".block_sparse_moe.experts." in name or name.endswith(".up_proj.weight"):
            continue  # stacked below / merged with its gate_proj
        if name.endswith(".gate_proj.weight"):
            w = torch.cat([w, sd[name.replace(".gate_proj.", ".up_proj.")]], dim=0)
            name = name.replace(".gate_proj.", ".gate_up_proj.")
        for old, new in _HF_RENAMES:
            name = name.replace(old, new)
        hf[name] = w
    for i in (i for i, moe in enumerate(t["moe_layer_freq"]) if moe):
        src, experts = f"model.layers.{i}.block_sparse_moe.experts", range(t["num_local_experts"])
        hf[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{src}.{e}.w1.weight"], sd[f"{src}.{e}.w3.weight"]]) for e in experts])
        hf[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
            [sd[f"{src}.{e}.w2.weight"] for e in experts])
    return dict(sorted(hf.items()))


def from_hf_state_dict(hf: dict[str, torch.Tensor], t: dict) -> dict[str, torch.Tensor]:
    """The inverse of ``to_hf_state_dict``: transformers' names (fused gate_up, 3D experts) -> vLLM/MiniMax names.
    Used to serve a model trained with transformers (the embedded default's supervised warm-up)."""
    sd = {}
    moe = {i for i, f in enumerate(t["moe_layer_freq"]) if f}
    for name, w in hf.items():
        if ".mlp.experts." in name:
            continue
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        for old, new in _HF_RENAMES:
            if old == ".block_sparse_moe." and layer not in moe:
                continue  # dense layers keep `mlp` in both layouts
            name = name.replace(new, old)
        if name.endswith(".gate_up_proj.weight"):
            gate, up = w.chunk(2, dim=0)
            sd[name.replace(".gate_up_proj.", ".gate_proj.")] = gate.contiguous()
            sd[name.replace(".gate_up_proj.", ".up_proj.")] = up.contiguous()
            continue
        sd[name] = w
    for i, is_moe in enumerate(t["moe_layer_freq"]):
        if not is_moe:
            continue
        gate_up, down = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"], hf[f"model.layers.{i}.mlp.experts.down_proj"]
        for e in range(t["num_local_experts"]):
            w1, w3 = gate_up[e].chunk(2, dim=0)
            dst = f"model.layers.{i}.block_sparse_moe.experts.{e}"
            sd[f"{dst}.w1.weight"], sd[f"{dst}.w3.weight"] = w1.contiguous(), w3.contiguous()
            sd[f"{dst}.w2.weight"] = down[e].contiguous()
    return dict(sorted(sd.items()))
