"""Per-GPU memory of MiniMax-M3 RL: the FSDP2 trainer shards and the vLLM rollout engine (the dry run's plan,
rl/plan.py, and the CLI):

    python scripts/size_m3.py [--recipe recipes/dapo_math_minimax_m31_flash.yaml] [--gpus 16] [--seq-len 22528]
                              [--batch 1024] [--json out.json]

Shapes come from the installed vLLM's ``MiniMaxM3TextConfig`` defaults (the MiniMax-M3 checkpoint's
``text_config``), or from a checkpoint ``config.json`` via ``--config``. Bytes use GB = 1e9. What is
assumed, and which numbers are estimates, is listed in recipes/README.md ("Sizing") and in the JSON's
``assumptions``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from rl.config import register, world_size

GB = 1e9
# Per parameter, scales included: NVFP4 = 4-bit E2M1 + one E4M3 byte per 16; MXFP8 = 1 byte + one E8M0 per 32.
BYTES_PER_PARAM = {"nvfp4": 0.5 + 1 / 16, "mxfp8": 1 + 1 / 32, "fp8": 1.0, "bf16": 2.0, "fp32": 4.0}


def kv_bytes_per_head(dtype: str, head_dim: int) -> float:
    """Cache bytes of one head for one token: nvfp4 packs 2 values a byte plus an E4M3 scale per 16
    (vLLM ``nvfp4_kv_cache_full_dim`` = d/2 + d/16 = 72 at d=128); global scales are per layer."""
    return {"nvfp4": head_dim / 2 + head_dim / 16, "fp8": head_dim, "bf16": 2 * head_dim,
            "auto": 2 * head_dim, "none": 0}[dtype]


def load_m3_config(path: str | None = None) -> dict:
    """vLLM's MiniMaxM3TextConfig defaults, updated from a checkpoint config.json (its text_config) if given.
    The config module is loaded from its file: it needs only transformers, and ``import vllm`` costs ~6 s."""
    spec = importlib.util.find_spec("vllm")
    src = os.path.join(list(spec.submodule_search_locations)[0], "transformers_utils", "configs", "minimax_m3.py")
    mspec = importlib.util.spec_from_file_location("m3rl_vllm_minimax_m3_config", src)
    module = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(module)
    overrides = {}
    if path:
        raw = json.loads(Path(path).read_text())
        overrides = raw.get("text_config", raw)
    return module.MiniMaxM3TextConfig(**overrides).to_dict()


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_inter: int
    dense_inter: int
    shared_inter: int  # vLLM builds the shared expert as intermediate_size * n_shared_experts
    layer_kinds: tuple[tuple[str, int], ...]  # ("dense_full", 3), ("moe_sparse", 57): FFN kind x attention kind
    index_heads: int
    index_dim: int
    mtp_modules: int
    tied: bool

    @classmethod
    def from_config(cls, c: dict) -> Shape:
        sparse = c["sparse_attention_config"]
        sparse_freq = sparse["sparse_attention_freq"] if sparse.get("use_sparse_attention") else [0] * 1000
        kinds = [("moe" if m else "dense") + ("_sparse" if a else "_full")
                 for m, a in zip(c["moe_layer_freq"], sparse_freq[:c["num_hidden_layers"]])]
        if len(kinds) != c["num_hidden_layers"]:
            raise ValueError(f"moe_layer_freq has {len(c['moe_layer_freq'])} entries "
                             f"for {c['num_hidden_layers']} layers")
        return cls(vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                   heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                   experts=c["num_local_experts"], top_k=c["num_experts_per_tok"], expert_inter=c["intermediate_size"],
                   dense_inter=c["dense_intermediate_size"],
                   shared_inter=c["intermediate_size"] * (c.get("n_shared_experts") or 0),
                   layer_kinds=tuple(sorted(Counter(kinds).items())),
                   index_heads=sparse["sparse_num_index_heads"], index_dim=sparse["sparse_index_dim"],
                   mtp_modules=c.get("num_mtp_modules", 0), tied=bool(c.get("tie_word_embeddings")))

    def count(self, ffn: str = "", attn: str = "") -> int:
        """Layers whose kind matches, e.g. count(ffn="moe"), count(attn="sparse")."""
        return sum(n for k, n in self.layer_kinds if k.startswith(ffn) and k.endswith(attn))

    @property
    def moe_layers(self) -> int:
        return self.count(ffn="moe")

    @property
    def sparse_layers(self) -> int:
        return self.count(attn="sparse")


@dataclass(frozen=True)
class Tensor:
    """A weight matrix (or a vector, in_f=1) repeated ``count`` times across the model."""
    name: str
    in_f: int
    out_f: int
    count: int
    fmt: str
    tp: str  # col | row | kv (split by KV head, replicated past kv_heads) | rep | vocab
    expert: bool = False
    lora: bool = False
    layer_kind: str = "moe_sparse"  # a Shape.layer_kinds name, or "model" (embed/head/final norm)

    @property
    def numel(self) -> int:
        return self.in_f * self.out_f * self.count


def tensors(s: Shape, expert_fmt: str = "nvfp4", linear_fmt: str = "mxfp8") -> list[Tensor]:
    """The served M3 text model (vLLM ``nvidia/model.py``); the MTP head is left out (``mtp_params``)."""
    H = s.hidden
    q, kv, iq = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.index_heads * s.index_dim
    t = [Tensor("embed_tokens", H, s.vocab, 1, "bf16", "vocab", layer_kind="model"),
         Tensor("norm", 1, H, 1, "bf16", "rep", layer_kind="model")]
    if not s.tied:
        t.append(Tensor("lm_head", H, s.vocab, 1, "bf16", "vocab", layer_kind="model"))
    for kind, n in s.layer_kinds:
        def add(name, in_f, out_f, fmt, tp, count=n, **kw):
            t.append(Tensor(f"{kind}.{name}", in_f, out_f, count, fmt, tp, layer_kind=kind, **kw))

        add("layernorms", 1, 2 * H, "bf16", "rep")
        add("q_k_norm", 1, 2 * s.head_dim, "bf16", "rep")
        add("q_proj", H, q, linear_fmt, "col", lora=True)
        add("k_proj", H, kv, linear_fmt, "kv", lora=True)
        add("v_proj", H, kv, linear_fmt, "kv", lora=True)
        add("o_proj", q, H, linear_fmt, "row", lora=True)
        if kind.endswith("sparse"):  # index_q shards like the KV heads; index_k is one replicated head
            add("index_q_proj", H, iq, linear_fmt, "kv", lora=True)
            add("index_k_proj", H, s.index_dim, linear_fmt, "rep", lora=True)
            add("index_norms", 1, 2 * s.index_dim, "bf16", "rep")
        if kind.startswith("dense"):
            add("mlp.gate_up_proj", H, 2 * s.dense_inter, linear_fmt, "col", lora=True)
            add("mlp.down_proj", s.dense_inter, H, linear_fmt, "row", lora=True)
            continue
        add("gate", H, s.experts, "fp32", "rep")  # router kept in fp32 (GateLinear)
        add("e_score_correction_bias", 1, s.experts, "fp32", "rep")
        add("experts.gate_up_proj", H, 2 * s.expert_inter, expert_fmt, "col", count=n * s.experts, expert=True,
            lora=True)
        add("experts.down_proj", s.expert_inter, H, expert_fmt, "row", count=n * s.experts, expert=True, lora=True)
        if s.shared_inter:
            add("shared_experts.gate_up_proj", H, 2 * s.shared_inter, linear_fmt, "col", lora=True)
            add("shared_experts.down_proj", s.shared_inter, H, linear_fmt, "row", lora=True)
    return t


def mtp_params(s: Shape) -> int:
    """One MTP module: enorm/hnorm, eh_proj (2H -> H), a sparse+MoE decoder layer, its own embedding."""
    one = Shape(**{**asdict(s), "layers": 1, "layer_kinds": (("moe_sparse", 1),), "tied": True})
    layer = sum(x.numel for x in tensors(one) if x.layer_kind == "moe_sparse")
    return s.mtp_modules * (layer + 2 * s.hidden * s.hidden + 3 * s.hidden + s.vocab * s.hidden)


def lora_params(x: Tensor, rank: int) -> int:
    # peft layout: A [r, in], B [out, r]; routed experts per expert (3D target_parameters), fused gate_up
    # gets one A/B pair, as the trainer saves them (rollout/plugin/lora.py).
    return rank * (x.in_f + x.out_f) * x.count if x.lora else 0


def per_token_layer_activation_bytes(s: Shape, rank: int) -> float:
    """Tensors autograd keeps for one MoE + sparse-attention layer, per token, bf16 (the layer being
    recomputed under activation checkpointing). An estimate: fused kernels save less, eager code more."""
    H, k = s.hidden, s.top_k
    q, kv, iq = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.index_heads * s.index_dim
    attn = (H + q + 2 * kv + iq + s.index_dim  # normed input; q, k, v, index_q, index_k
            + q + s.heads * 2  # attention output; fp32 log-sum-exp
            + 6 * rank + H)  # LoRA A outputs; o_proj output
    moe = (H + 2 * s.experts  # normed input; fp32 router logits
           + k * (H + 2 * s.expert_inter + s.expert_inter + H + 2 * rank)  # per routed copy: in, gate_up, act, out
           + 2 * s.shared_inter + s.shared_inter + H + 2 * rank + H)  # shared expert; block output
    return 2.0 * (attn + moe)


@dataclass
class Setup:
    gpus: int = 16
    gpu_mem_gb: float = 288.0  # GB300: 288 GB HBM3e
    seq_len: int = 22528  # prompt 2048 + response 20480 (verl's DAPO recipe)
    micro_batch: int = 1  # sequences per GPU per forward/backward
    tokens_per_gpu: int | None = None  # overrides seq_len * micro_batch (verl dynamic batching)
    batch: int = 1024  # rollout sequences per step (train_batch_size * n)
    lora_rank: int = 32
    expert_format: str = "nvfp4"
    linear_format: str = "mxfp8"
    trainer_ep: int = 1  # expert-parallel degree inside the trainer (1 = FSDP2 shards experts too)
    fsdp_prefetch: int = 2  # units unsharded at once (current + next)
    expert_dequant: str = "fused"  # fused: no bf16 copy of experts; per_layer: dequantize a layer at a time
    linear_dequant: str = "per_layer"  # per_layer: MXFP8 linears to bf16 a layer at a time; none: read as MXFP8
    lora_param_bytes: float = 4.0  # fp32 master
    lora_grad_bytes: float = 4.0
    optim_bytes: float = 8.0  # AdamW m, v in fp32
    logits_chunk_tokens: int = 0  # 0 = full logits for the micro-batch, as verl's default path
    trainer_reserve_gb: float = 8.0  # CUDA context, NCCL buffers, allocator slack [estimate]
    engine_tp: int = 4
    engine_dp: int = 1  # DP attention ranks per engine (DEP when > 1 with engine_ep)
    engine_ep: bool = False
    kv_dtype: str = "nvfp4"
    indexer_dtype: str = "nvfp4"
    block_size: int = 128
    context: int | None = None  # tokens per sequence for the concurrency figure (default seq_len)
    gpu_mem_util: float = 0.85
    max_num_seqs: int = 256  # per DP rank; 0 = no limit (and no logits buffer)
    num_spec_tokens: int = 7
    draft_params_b: float = 0.0  # DSpark drafter weights (billions of bf16 params); not published
    draft_kv_bytes_per_token: float = 0.0  # DSpark drafter cache per token per GPU; not published
    draft_window: int = 4096  # the drafter's sliding window caps its cache
    engine_reserve_gb: float = 10.0  # activations, CUDA graphs, workspaces [estimate]
    colocate: bool = True  # verl's hybrid engine: trainer and engine share the GPUs
    trainer_offload: bool = False  # trainer params/optimizer moved to CPU while the engine runs


def size(s: Shape, u: Setup) -> dict:
    ts = tensors(s, u.expert_format, u.linear_format)
    bpp = BYTES_PER_PARAM
    params = {"total": sum(x.numel for x in ts), "routed_experts": sum(x.numel for x in ts if x.expert),
              "embed_lm_head": sum(x.numel for x in ts if x.name in ("embed_tokens", "lm_head")),
              u.linear_format + "_linears": sum(x.numel for x in ts if x.fmt == u.linear_format and not x.expert),
              "router_fp32": sum(x.numel for x in ts if x.fmt == "fp32"),
              "mtp_not_loaded": mtp_params(s)}
    lora_total = sum(lora_params(x, u.lora_rank) for x in ts)
    base_bytes = sum(x.numel * bpp[x.fmt] for x in ts)

    # ---------------- trainer (FSDP2 over all GPUs; optional expert parallelism) ----------------
    if u.expert_dequant not in ("fused", "per_layer") or u.linear_dequant not in ("per_layer", "none"):
        raise ValueError(f"expert_dequant {u.expert_dequant!r} (fused|per_layer), "
                         f"linear_dequant {u.linear_dequant!r} (per_layer|none)")
    N, ep = u.gpus, u.trainer_ep
    if N % ep or s.experts % ep:
        raise ValueError(f"trainer_ep={ep} must divide gpus={N} and experts={s.experts}")
    units = {}  # FSDP units (one per decoder layer, plus embed and lm_head), unsharded bytes on one GPU
    for kind, n in s.layer_kinds:
        units[kind] = sum(x.numel / n * bpp[x.fmt] / (ep if x.expert else 1) for x in ts if x.layer_kind == kind)
    for x in ts:
        if x.name in ("embed_tokens", "lm_head"):
            units[x.name] = x.numel * bpp[x.fmt]
    gather = u.fsdp_prefetch * max(units.values())
    big = max(s.layer_kinds, key=lambda kn: units[kn[0]])  # the layer kind with the largest unit
    big_layer = [x for x in ts if x.layer_kind == big[0]]
    dequant = 0.0
    if u.linear_dequant == "per_layer":
        dequant += sum(x.numel / big[1] * 2 for x in big_layer
                       if x.fmt == u.linear_format and not x.expert)
    if u.expert_dequant == "per_layer":
        dequant += sum(x.numel / big[1] * 2 / ep for x in big_layer if x.expert)
    lora_layer = sum(lora_params(x, u.lora_rank) / (ep if x.expert else 1) for x in big_layer) / big[1]
    lora_state = lora_total * (u.lora_param_bytes + u.lora_grad_bytes + u.optim_bytes) / N
    # bf16 compute copies of the unsharded units' adapters + one layer of unreduced fp32 grads
    lora_transient = lora_layer * (2 * u.fsdp_prefetch + u.lora_grad_bytes)
    T = u.tokens_per_gpu or u.seq_len * u.micro_batch
    logit_tokens = min(T, u.logits_chunk_tokens) if u.logits_chunk_tokens else T
    act = {"checkpointed_layer_inputs": s.layers * T * s.hidden * 2.0,
           "recomputed_layer": T * per_token_layer_activation_bytes(s, u.lora_rank),
           # bf16 logits + fp32 log-softmax + fp32 grad of the logits
           "logits": logit_tokens * s.vocab * (2 + 4 + 4.0),
           "ep_all_to_all": (T * s.top_k * s.hidden * 2.0 * 2) if ep > 1 else 0.0}
    trainer = {"base_weights_shard": base_bytes / N, "lora_params_grads_adamw": lora_state,
               "fsdp_unshard_buffers": gather, "dequant_transient": dequant, "lora_transient": lora_transient,
               **{f"act_{k}": v for k, v in act.items()}, "reserve": u.trainer_reserve_gb * GB}
    trainer_peak = sum(trainer.values())
    trainer_resident = 0.0 if u.trainer_offload else trainer["base_weights_shard"] + lora_state

    # ---------------- engine (vLLM replicas of TP x DP GPUs) ----------------
    tp, dp = u.engine_tp, u.engine_dp
    group = tp * dp
    if N % group:
        raise ValueError(f"engine tp*dp={group} must divide gpus={N}")
    if u.engine_ep and s.experts % group:
        raise ValueError(f"experts={s.experts} not divisible by the EP group {group}")
    kv_per_rank = max(1, s.kv_heads // tp)

    def share(x: Tensor) -> float:
        """Fraction of a tensor one GPU holds (split along its output, or its input for row-parallel)."""
        if x.expert and u.engine_ep:
            return 1 / group  # whole experts per rank
        return {"col": 1 / tp, "row": 1 / tp, "vocab": 1 / tp, "kv": kv_per_rank / s.kv_heads, "rep": 1.0}[x.tp]

    weights = sum(x.numel * share(x) * bpp[x.fmt] for x in ts)
    lora_gpu = 0.0
    for x in (x for x in ts if x.lora):
        a, b = u.lora_rank * x.in_f, u.lora_rank * x.out_f  # A [r, in], B [out, r]
        if x.expert and u.engine_ep:
            a, b = a * share(x), b * share(x)
        elif x.tp == "row":  # vLLM splits A along the sharded input and keeps B whole
            a = a * share(x)
        else:  # column-like: A whole, B split with the output
            b = b * share(x)
        lora_gpu += (a + b) * x.count * 2.0  # bf16, one adapter slot (max_loras=1)
    draft = u.draft_params_b * 1e9 * 2.0 / tp
    logits_buf = u.max_num_seqs * (1 + u.num_spec_tokens) * s.vocab * 4.0  # fp32 logits for verification
    cap = u.gpu_mem_util * u.gpu_mem_gb * GB
    limited_by_trainer = u.colocate and trainer_resident + cap > u.gpu_mem_gb * GB
    if limited_by_trainer:
        cap = u.gpu_mem_gb * GB - trainer_resident
    kv_budget = cap - weights - lora_gpu - draft - logits_buf - u.engine_reserve_gb * GB
    main_kv = s.layers * 2 * kv_per_rank * kv_bytes_per_head(u.kv_dtype, s.head_dim)  # K and V
    index_kv = s.sparse_layers * kv_bytes_per_head(u.indexer_dtype, s.index_dim)  # one key head, replicated
    ctx = u.context or u.seq_len
    alloc = math.ceil(ctx / u.block_size) * u.block_size
    draft_tokens = math.ceil(min(ctx, u.draft_window) / u.block_size) * u.block_size
    per_seq = alloc * (main_kv + index_kv) + draft_tokens * u.draft_kv_bytes_per_token
    kv_limited = max(0, math.floor(kv_budget / per_seq)) if kv_budget > 0 else 0
    per_rank = min(kv_limited, u.max_num_seqs) if u.max_num_seqs else kv_limited  # each DP rank schedules alone
    replicas = N // group
    concurrency = per_rank * dp * replicas
    engine = {"weights": weights, "lora_adapter": lora_gpu, "draft_weights": draft, "logits_buffer": logits_buf,
              "reserve": u.engine_reserve_gb * GB, "kv_budget": kv_budget}
    return {
        "shape": asdict(s), "setup": asdict(u),
        "params": params, "lora_params": lora_total,
        "checkpoint_bytes": base_bytes,
        "trainer": {"per_gpu": trainer, "peak": trainer_peak, "resident_during_rollout": trainer_resident,
                    "tokens_per_gpu": T, "fits": trainer_peak <= u.gpu_mem_gb * GB},
        "engine": {"per_gpu": engine, "cap": cap, "cap_limited_by_trainer": limited_by_trainer,
                   "kv_bytes_per_token_model": {
                       "main": s.layers * 2 * s.kv_heads * kv_bytes_per_head(u.kv_dtype, s.head_dim),
                       "indexer": index_kv},
                   "kv_bytes_per_token_gpu": main_kv + index_kv, "context": ctx, "bytes_per_seq_gpu": per_seq,
                   "kv_limited_seqs_per_dp_rank": kv_limited, "seqs_per_dp_rank": per_rank, "replicas": replicas,
                   "concurrency": concurrency,
                   "rollout_waves": math.ceil(u.batch / concurrency) if concurrency else None},
        "assumptions": ASSUMPTIONS,
    }


ASSUMPTIONS = [
    "shapes: installed vLLM MiniMaxM3TextConfig defaults unless --config; MTP head not loaded (DSpark drafts)",
    "bytes/param: NVFP4 0.5625 (E4M3 scale per 16), MXFP8 1.03125 (E8M0 per 32), bf16 embed/lm_head/norms, "
    "fp32 router",
    "trainer: FSDP2 shards the quantized base and the LoRA state over all GPUs; with --trainer-ep the experts of "
    "a layer are split over the EP group, the rest stays FSDP-sharded",
    "LoRA: rank r on q/k/v/o, indexer q/k, dense+shared gate_up/down, every routed expert's gate_up/down; "
    "fp32 params + fp32 grads + AdamW m,v fp32",
    "activations: full checkpointing per decoder layer (layer inputs kept, one layer recomputed), "
    "unchunked fp32 logits unless --logits-chunk-tokens; per-layer tensor list is an estimate",
    "engine: vLLM TP splits heads (KV heads replicated past TP=kv_heads), index_k and router replicated, "
    "embed/lm_head vocab-parallel; EP puts whole experts on ranks; one LoRA slot in bf16",
    "KV: every layer caches K+V; sparse layers add one index-key head; pages of block_size tokens",
    "colocated: the engine's memory is capped so the trainer's resident shard (weights + LoRA state) still fits",
    "DSpark drafter weights/cache: zero unless given (not published)",
]


def setup_from_config(cfg) -> dict:
    """Setup values from a composed rl.train config (a recipe)."""
    ek = cfg.rollout.engine_kwargs
    spec = ek.get("speculative_config") or {}  # null: unset by a derived recipe
    gpus, tp = world_size(cfg), cfg.rollout.tensor_model_parallel_size
    # the trainer's sequences per forward/backward: the micro-batch, else a rank's whole share of the step (prompts
    # split over the engine replicas, then over each engine's ranks: rl.train.generate)
    per_replica = -(-cfg.data.train_batch_size // max(1, gpus // tp))
    share = -(-per_replica // tp) * cfg.rollout.n
    return {"gpus": gpus, "seq_len": cfg.data.max_prompt_length + cfg.data.max_response_length,
            "micro_batch": cfg.actor.ppo_micro_batch_size_per_gpu or share,
            "tokens_per_gpu": cfg.actor.ppo_max_token_len_per_gpu if cfg.actor.use_dynamic_bsz else None,
            "batch": cfg.data.train_batch_size * cfg.rollout.n, "lora_rank": cfg.model.lora.rank,
            "engine_tp": cfg.rollout.tensor_model_parallel_size, "engine_ep": cfg.rollout.enable_expert_parallel,
            "gpu_mem_util": cfg.rollout.gpu_memory_utilization, "max_num_seqs": cfg.rollout.max_num_seqs,
            "kv_dtype": str(cfg.model.kv_cache_dtype), "indexer_dtype": str(cfg.model.indexer_kv_dtype),
            "block_size": ek.get("block_size") or 16, "num_spec_tokens": spec.get("num_speculative_tokens") or 0}


def compose_recipe(path: str, overrides: list[str] = ()):
    """A recipe file composed as rl.train composes it (its ??? keys filled with placeholders)."""
    from hydra import compose, initialize_config_dir

    register()
    p = Path(path).resolve()
    with initialize_config_dir(config_dir=str(p.parent), version_base=None):
        return compose(p.stem, overrides=["model.path=/ckpt", "data.train_files=/train.parquet",
                                          "data.val_files=/val.parquet", *overrides])


def _table(out: dict) -> str:
    g = lambda b: f"{b / GB:10.2f}"  # noqa: E731
    p, tr, en = out["params"], out["trainer"], out["engine"]
    lines = [f"params: total {p['total'] / 1e9:.2f} B (routed experts {p['routed_experts'] / 1e9:.2f} B), "
             f"LoRA {out['lora_params'] / 1e9:.3f} B, weights {out['checkpoint_bytes'] / GB:.1f} GB",
             f"\ntrainer per GPU ({out['setup']['gpus']} GPUs, {tr['tokens_per_gpu']} tokens/GPU)   GB"]
    lines += [f"  {k:<36}{g(v)}" for k, v in tr["per_gpu"].items()]
    lines += [f"  {'peak':<36}{g(tr['peak'])}  ({'fits' if tr['fits'] else 'DOES NOT FIT'})",
              f"  {'resident while rolling out':<36}{g(tr['resident_during_rollout'])}",
              f"\nengine per GPU (TP{out['setup']['engine_tp']} DP{out['setup']['engine_dp']}"
              f"{' EP' if out['setup']['engine_ep'] else ''}, cap {en['cap'] / GB:.1f} GB"
              f"{' limited by trainer' if en['cap_limited_by_trainer'] else ''})   GB"]
    lines += [f"  {k:<36}{g(v)}" for k, v in en["per_gpu"].items()]
    kvm = en["kv_bytes_per_token_model"]
    lines += [f"  KV bytes/token: model K+V {kvm['main']:,.0f} + indexer {kvm['indexer']:,.0f}; "
              f"per GPU {en['kv_bytes_per_token_gpu']:,.0f}",
              f"  context {en['context']}: {en['bytes_per_seq_gpu'] / GB:.3f} GB/seq/GPU, "
              f"KV room for {en['kv_limited_seqs_per_dp_rank']} seqs per DP rank, {en['seqs_per_dp_rank']} scheduled "
              f"(max_num_seqs), {en['replicas']} replicas, concurrency {en['concurrency']}, "
              f"rollout waves for {out['setup']['batch']} seqs: {en['rollout_waves']}"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", help="take GPUs, lengths, batch, rank and engine settings from this recipe YAML")
    p.add_argument("--config", help="checkpoint config.json (text_config) instead of vLLM's defaults")
    p.add_argument("--json", help="write the full result here")
    bools = {"engine_ep", "colocate", "trainer_offload"}
    for f in Setup.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        if f.name in bools:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"str": str, "float": float}.get(str(f.type).split(" ")[0], int)
            p.add_argument(flag, type=kind, default=None)
    args = vars(p.parse_args(argv))
    values = setup_from_config(compose_recipe(args["recipe"])) if args["recipe"] else {}
    values.update({k: v for k, v in args.items() if k in Setup.__dataclass_fields__ and v is not None})
    out = size(Shape.from_config(load_m3_config(args["config"])), Setup(**values))
    print(_table(out))
    if args["json"]:
        Path(args["json"]).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
