"""Deterministic random-init tiny MiniMax-M3 checkpoints for CPU tests (nothing from a model hub).

``make_tiny_model(DIR)`` writes ``DIR`` for vLLM (``model_type: minimax_m3_vl`` + legacy ``text_config``,
original MiniMax weight names) and ``DIR-hf`` for transformers' ``MiniMaxM3VLForCausalLM`` (HF-internal
names; transformers converts MiniMax names only for the VL class). Both hold bit-identical tensors.
Each tensor has its own generator seeded by (seed, vLLM name), so a variant that drops tensors (e.g.
no sparse layers) keeps all the others unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

FORMAT_VERSION = 1  # bump when the layout, init or tokenizer recipe changes (invalidates caches)
MANIFEST = "tiny_model.json"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")  # they get ids 0..3
EOS_ID, PAD_ID = 2, 3  # <|im_end|>, <pad>
TOKENIZER_VOCAB = 512
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                 "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

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

# Init scales. Fan-in scaling rather than a flat 0.02, so attention, MoE and the shared expert each
# move the residual stream by O(1): a wrong op then shows in logprobs far above bf16 noise.
EMBED_STD = 1.0
LM_HEAD_STD = 0.2  # logits std ~3, mean entropy ~2.8 of 6.2 nats: peaked, not one-hot
NORM_STD = 0.1  # Gemma norms scale by (1 + w): w = 0 would hide a "* w" vs "* (1 + w)" mistake
BIAS_STD = 0.1  # correction bias comparable to sigmoid-score gaps, so ignoring it changes routing
GLU_GAIN = 2.5  # gate/up pre-activations std ~2.5: the swiglu clamp at +-7 fires now and then
OUT_GAIN = 0.5  # o_proj / down_proj / w2


class TinyModelPaths(NamedTuple):
    vllm: Path  # served checkpoint (original MiniMax names)
    hf: Path  # transformers reference copy (DIR-hf)


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


def tokenizer_corpus() -> list[str]:
    """The stdlib json package sources (sorted) plus digits/arithmetic, so numbers and operators
    get merges. It follows the Python build, so its hash goes into manifests and cache keys."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    return texts + [" ".join(str(i) for i in range(200)), "0.5 1.25 3.14159 -7 2**10 = 1024 1e-6 100% 1,000",
                    "1 + 1 = 2\n12 * 12 = 144\n(3 + 4) * 5 = 35\n81 / 9 = 9\n10 - 3 = 7\nx^2 + y^2 = z^2"]


def corpus_sha256() -> str:
    return hashlib.sha256("\0".join(tokenizer_corpus()).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def build_tokenizer_files() -> tuple[tuple[str, bytes], ...]:
    """Train the byte-level BPE; return its PreTrainedTokenizerFast files as (name, bytes). BPE
    training has nothing to seed; the tests check it gives the same bytes in fresh processes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(tokenizer_corpus(), trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[EOS_ID],
                                   pad_token=SPECIAL_TOKENS[PAD_ID], chat_template=CHAT_TEMPLATE)
    if (got := (len(fast), fast.eos_token_id, fast.pad_token_id)) != (TOKENIZER_VOCAB, EOS_ID, PAD_ID):
        raise RuntimeError(f"tokenizer (size, eos, pad) = {got}: corpus too small or specials moved")
    with tempfile.TemporaryDirectory() as d:
        fast.save_pretrained(d)
        return tuple((p.name, p.read_bytes()) for p in sorted(Path(d).iterdir()) if p.is_file())


def _dump_json(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()  # no timestamps, stable order


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


def _write_dir(path: Path, files: dict[str, bytes], tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    save_file(dict(sorted(tensors.items())), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "model.safetensors").chmod(0o644)  # save_file leaves it 0600, unlike the other files


def _hash_files(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.iterdir()) if p.is_file() and p.name != MANIFEST}


def _replace_dir(src: Path, dst: Path) -> None:  # an existing dst goes to the temp dir, deleted later
    if dst.exists():
        os.rename(dst, src.with_name(src.name + ".old"))
    os.rename(src, dst)


def make_tiny_model(out_dir, seed: int = 0, dtype: str = "bfloat16", **config_overrides) -> TinyModelPaths:
    """Write the vLLM checkpoint to ``out_dir`` and its transformers twin to ``out_dir-hf``.
    Everything is validated first; both copies are built in a temp dir beside ``out_dir``, then
    renamed into place (the manifest-bearing vLLM copy last), so a crash never leaves a checkpoint
    that looks complete but is not. Same args -> same bytes."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(DTYPES)}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed={seed!r}: must be an int")
    t = resolve_text_config(**config_overrides)
    validate_config(t)
    out = Path(out_dir).absolute()
    paths = TinyModelPaths(out, out.with_name(out.name + "-hf"))
    tok_files = dict(build_tokenizer_files())
    # Only ever replace our own output (a manifest / only our file names), never someone's data.
    ok = {"vllm": lambda d: (d / MANIFEST).is_file() or not any(d.iterdir()),
          "hf": lambda d: {p.name for p in d.iterdir()} <= {"config.json", "model.safetensors", *tok_files}}
    for kind, d in paths._asdict().items():
        if d.exists() and not (d.is_dir() and ok[kind](d)):
            raise FileExistsError(f"{d} exists and was not written by make_tiny_model")
    sd = init_weights(t, seed, dtype)
    config = {"architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3_vl",
              "dtype": dtype, "tie_word_embeddings": False, "eos_token_id": EOS_ID,
              "pad_token_id": PAD_ID, "text_config": {**t, "dtype": dtype}}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_dir(tmp / "hf", {**tok_files, "config.json": _dump_json(hf_config_json(t))},
                   to_hf_state_dict(sd, t))
        _write_dir(tmp / "vllm", {**tok_files, "config.json": _dump_json(config)}, sd)
        manifest = {"generator": "rollout.tiny_model", "format_version": FORMAT_VERSION, "seed": seed,
                    "dtype": dtype, "config_overrides": config_overrides, "torch": torch.__version__,
                    "corpus_sha256": corpus_sha256(),
                    "files": _hash_files(tmp / "vllm"), "hf_files": _hash_files(tmp / "hf")}
        (tmp / "vllm" / MANIFEST).write_bytes(_dump_json(manifest))
        _replace_dir(tmp / "hf", paths.hf)
        _replace_dir(tmp / "vllm", paths.vllm)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


def _is_complete(paths: TinyModelPaths) -> bool:
    try:
        m = json.loads((paths.vllm / MANIFEST).read_bytes())
        return m["files"] == _hash_files(paths.vllm) and m["hf_files"] == _hash_files(paths.hf)
    except (OSError, ValueError, KeyError):
        return False


def ensure_tiny_model(cache_dir=None, seed: int = 0, dtype: str = "bfloat16",
                      **config_overrides) -> TinyModelPaths:
    """``cache_dir/m3tiny-<key>`` (+ ``-hf``), built unless a copy matching its manifest exists.
    ``cache_dir`` defaults to $M3RL_TINY_MODEL_CACHE, else <repo>/cache/tiny_models (git-ignored).
    The key hashes everything that determines the files (resolved config, seed, dtype, recipe
    version, corpus, torch version). A lock file serialises concurrent builders (xdist workers)."""
    cache = Path(cache_dir or os.environ.get("M3RL_TINY_MODEL_CACHE")
                 or Path(__file__).resolve().parents[1] / "cache" / "tiny_models").absolute()
    blob = json.dumps({"v": FORMAT_VERSION, "seed": seed, "dtype": dtype, "torch": torch.__version__,
                       "text_config": resolve_text_config(**config_overrides),
                       "corpus": corpus_sha256()}, sort_keys=True)
    out = cache / f"m3tiny-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
    paths = TinyModelPaths(out, out.with_name(out.name + "-hf"))
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        return paths if _is_complete(paths) else make_tiny_model(out, seed, dtype, **config_overrides)


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


def write_served_copy(src: TinyModelPaths, out_dir, hf_state: dict[str, torch.Tensor], dtype: str) -> Path:
    """A vLLM-layout checkpoint with ``src``'s config and tokenizer and the given (trained) transformers weights."""
    cfg = json.loads((src.vllm / "config.json").read_text())
    t = cfg["text_config"]
    sd = from_hf_state_dict(hf_state, t)
    keep_fp32 = ("block_sparse_moe.gate.weight", "e_score_correction_bias")  # vLLM's router is fp32
    sd = {k: (v.float() if k.endswith(keep_fp32) else v.to(DTYPES[dtype])).contiguous() for k, v in sd.items()}
    cfg["dtype"] = cfg["text_config"]["dtype"] = dtype
    files = {p.name: p.read_bytes() for p in src.vllm.iterdir() if p.is_file()
             and p.name not in ("config.json", "model.safetensors", MANIFEST)}
    out = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    _write_dir(tmp / "ckpt", {**files, "config.json": _dump_json(cfg)}, sd)
    if out.exists():
        shutil.rmtree(out)
    (tmp / "ckpt").rename(out)
    tmp.rmdir()
    return out
