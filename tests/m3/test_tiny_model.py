"""Tiny MiniMax-M3 checkpoint builder (m3/tiny.py, m3/config.py, m3/weights.py): determinism, the vLLM and transformers
copies holding the same parameters, vLLM's own config class reading config.json, and config
validation. Other tests can share a build through ``ensure_tiny_model(cache_dir)``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from m3 import config, weights
from m3 import tiny as builder

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> builder.TinyModelPaths:
    return builder.ensure_tiny_model(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def hf_model(tiny):
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    model, info = MiniMaxM3VLForCausalLM.from_pretrained(tiny.hf, output_loading_info=True)
    return model.eval(), info


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ----------------------------------------------------------------------------- determinism
def test_same_args_give_identical_bytes_and_rerun_is_idempotent(tiny, tmp_path):
    fresh = builder.make_tiny_model(tmp_path / "m3")
    assert _files(fresh.vllm) == _files(tiny.vllm) and _files(fresh.hf) == _files(tiny.hf)
    again = builder.make_tiny_model(tmp_path / "m3")  # overwrite in place
    assert _files(again.vllm) == _files(tiny.vllm) and _files(again.hf) == _files(tiny.hf)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m3", "m3-hf"]  # no temp dirs left


def test_different_seed_changes_every_tensor_but_nothing_else(tiny, tmp_path):
    other = builder.make_tiny_model(tmp_path / "m3", seed=1)
    for a, b in ((tiny.vllm, other.vllm), (tiny.hf, other.hf)):
        fa, fb = _files(a), _files(b)
        assert [k for k in fa if fa[k] != fb[k]] == (
            ["model.safetensors", builder.MANIFEST] if builder.MANIFEST in fa else ["model.safetensors"])
    w0, w1 = load_file(tiny.vllm / "model.safetensors"), load_file(other.vllm / "model.safetensors")
    assert w0.keys() == w1.keys() and not [k for k in w0 if torch.equal(w0[k], w1[k])]


def test_tokenizer_training_is_deterministic_across_processes(tiny):
    code = ("import hashlib, json; from m3.tiny import build_tokenizer_files; "
            "print(json.dumps({n: hashlib.sha256(b).hexdigest() for n, b in build_tokenizer_files()}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    fresh = json.loads(out.strip().splitlines()[-1])
    for d in tiny:
        assert {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in fresh} == fresh


def test_tokenizer_contract(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.vllm)
    assert len(tok) == 512 and (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<pad>", 3)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>"]) == [0, 1]
    chat = tok.apply_chat_template([{"role": "user", "content": "12 * 12 = ?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\n12 * 12 = ?<|im_end|>\n<|im_start|>assistant\n"
    text = 'def f(x):\n    return json.dumps({"a": [1, 2.5]})  # ünïcode'
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: lossless


# ----------------------------------------------------------------------------- the two layouts
def test_vllm_layout_names_and_dtypes(tiny):
    w = load_file(tiny.vllm / "model.safetensors")
    fp32 = {k for k, v in w.items() if v.dtype == torch.float32}
    assert fp32 == {f"model.layers.{i}.block_sparse_moe.{n}" for i in (1, 2, 3)
                    for n in ("gate.weight", "e_score_correction_bias")}
    assert {v.dtype for k, v in w.items() if k not in fp32} == {torch.bfloat16}
    layer0, layer1 = {k for k in w if ".layers.0." in k}, {k for k in w if ".layers.1." in k}
    assert not any("index_" in k or "block_sparse_moe" in k for k in layer0)  # dense attn + MLP
    assert "model.layers.0.mlp.gate_proj.weight" in layer0
    for name in ("self_attn.index_q_proj", "self_attn.index_k_norm", "block_sparse_moe.experts.7.w2",
                 "block_sparse_moe.shared_experts.down_proj"):
        assert f"model.layers.1.{name}.weight" in layer1
    assert w["model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight"].shape == (128, 256)
    assert w["model.layers.0.mlp.gate_proj.weight"].shape == (512, 256)
    assert w["model.layers.1.self_attn.index_k_proj.weight"].shape == (128, 256)  # one shared head
    norms = [v for k, v in w.items() if "norm" in k]
    assert all(v.float().abs().mean() > 0.01 for v in norms)  # Gemma (1 + w): w must not be 0


def test_hf_copy_loads_without_missing_keys_and_equals_vllm_tensors(tiny, hf_model):
    model, info = hf_model
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    assert model.dtype == torch.float32  # exact upcast of bf16; the fp32 router is not rounded
    stored = load_file(tiny.hf / "model.safetensors")  # same storage dtypes as the vLLM copy
    assert {k for k, t in stored.items() if t.dtype == torch.float32} == {
        f"model.layers.{i}.mlp.gate.{n}" for i in (1, 2, 3) for n in ("weight", "e_score_correction_bias")}
    hf, v = model.state_dict(), load_file(tiny.vllm / "model.safetensors")
    used, checked = set(), set()

    def eq(hf_name, *parts, index=None):  # hf tensor (or a slice) == vLLM tensors concatenated
        got = hf[hf_name] if index is None else hf[hf_name][index]
        want = torch.cat([v[p] for p in parts]).float()
        assert torch.equal(got, want), hf_name
        used.update(parts)
        checked.add(hf_name)

    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        eq(name, name)
    for i in range(4):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm"):
            eq(f"{p}{n}.weight", f"{p}{n}.weight")
        if i == 0:
            eq(p + "mlp.gate_up_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            eq(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight")
            continue
        for x in ("q_proj", "k_proj", "q_norm", "k_norm"):
            eq(f"{p}self_attn.indexer.{x}.weight", f"{p}self_attn.index_{x}.weight")
        m = p + "block_sparse_moe."
        eq(p + "mlp.gate.weight", m + "gate.weight")
        eq(p + "mlp.gate.e_score_correction_bias", m + "e_score_correction_bias")
        eq(p + "mlp.shared_experts.gate_up_proj.weight", m + "shared_experts.gate_proj.weight",
           m + "shared_experts.up_proj.weight")
        eq(p + "mlp.shared_experts.down_proj.weight", m + "shared_experts.down_proj.weight")
        for e in range(8):  # w1 = gate (first half), w3 = up, w2 = down
            x = f"{m}experts.{e}."
            eq(p + "mlp.experts.gate_up_proj", x + "w1.weight", x + "w3.weight", index=e)
            eq(p + "mlp.experts.down_proj", x + "w2.weight", index=e)
    assert checked == set(hf) and used == set(v)


def test_transformers_own_minimax_conversion_of_vllm_copy_gives_the_same_model(tiny, hf_model):
    """Independent check of the renames: transformers' minimax_m3_vl conversion rules (normally
    applied only to the VL class) loaded onto the text class from the vLLM-layout copy."""
    from transformers import conversion_mapping as cm
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    rules = cm.get_checkpoint_conversion_mapping("minimax_m3_vl")
    cm.register_checkpoint_conversion_mapping("MiniMaxM3VLForCausalLM", rules, overwrite=True)
    try:
        cfg = MiniMaxM3VLTextConfig.from_pretrained(tiny.hf)
        converted, info = MiniMaxM3VLForCausalLM.from_pretrained(tiny.vllm, config=cfg,
                                                                 output_loading_info=True)
    finally:  # no public unregister; restore transformers' global state for other tests
        cm._checkpoint_conversion_mapping_cache.pop("MiniMaxM3VLForCausalLM", None)
        cm.USER_REGISTERED_MAPPINGS.discard("MiniMaxM3VLForCausalLM")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ref, got = hf_model[0].state_dict(), converted.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_hf_twin_forward_is_not_degenerate(tiny, hf_model):
    model = hf_model[0]
    ids = torch.arange(300).remainder(500).add(4)[None]  # > 2 index blocks: sparse selection runs
    routed = []
    hooks = [model.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, o: routed.append(o[2]))
             for i in (1, 2, 3)]
    with torch.no_grad():
        logits = model(ids).logits[0]
    for h in hooks:
        h.remove()
    assert torch.isfinite(logits).all() and logits.std() > 1.0  # peaked, not flat
    for idx in routed:  # every expert gets traffic, none gets most of it
        load = torch.bincount(idx.flatten(), minlength=8).float() / idx.numel()
        assert load.min() > 0 and load.max() < 0.5


# ----------------------------------------------------------------------------- vLLM's config class
def test_vllm_config_class_reads_intended_values(tiny):
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.minimax_m3 import MiniMaxM3Config, MiniMaxM3TextConfig

    cfg = get_config(str(tiny.vllm), trust_remote_code=False)  # what vLLM's ModelConfig calls
    assert isinstance(cfg, MiniMaxM3Config) and isinstance(cfg.text_config, MiniMaxM3TextConfig)
    assert cfg.architectures == ["MiniMaxM3SparseForCausalLM"] and cfg.get_text_config() is cfg.text_config
    t = cfg.text_config
    want = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=128, rotary_dim=64, partial_rotary_factor=0.5,
                rope_theta=5e6, max_position_embeddings=4096, hidden_act="swigluoai", swiglu_alpha=1.702,
                swiglu_limit=7.0, swiglu_beta=1.0, num_local_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, intermediate_size=128, dense_intermediate_size=512,
                scoring_func="sigmoid", use_routing_bias=True, routed_scaling_factor=2.0,
                moe_layer_freq=[0, 1, 1, 1], tie_word_embeddings=False, dtype=torch.bfloat16)
    assert {k: getattr(t, k) for k in want} == want
    assert t.sparse_attention_config == {
        "sparse_attention_freq": [0, 1, 1, 1], "sparse_num_index_heads": 1, "sparse_index_dim": 128,
        "sparse_topk_blocks": 2, "sparse_block_size": 128, "sparse_init_block": 0,
        "sparse_local_block": 1, "sparse_score_type": "max"}
    config.validate_config(json.loads((tiny.vllm / "config.json").read_text()))  # full config.json form


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("overrides, field", [
    ({"head_dim": 64}, "text_config.head_dim=64"),
    ({"sparse_block_size": 64}, "text_config.sparse_attention_config.sparse_block_size=64"),
    ({"sparse_index_dim": 64}, "text_config.sparse_attention_config.sparse_index_dim=64"),
    ({"sparse_num_index_heads": 2}, "text_config.sparse_attention_config.sparse_num_index_heads=2"),
    ({"rotary_dim": 60}, "text_config.rotary_dim=60"),
    ({"partial_rotary_factor": 0.25}, "text_config.partial_rotary_factor=0.25"),
    ({"num_attention_heads": 3, "num_key_value_heads": 2}, "text_config.num_attention_heads=3"),
    ({"num_experts_per_tok": 9}, "text_config.num_experts_per_tok=9"),
    ({"hidden_act": "silu"}, "text_config.hidden_act='silu'"),
    ({"moe_layer_freq": [0, 1, 1]}, "text_config.moe_layer_freq=[0, 1, 1]"),
    ({"sparse_attention_freq": [0, 1]}, "text_config.sparse_attention_config.sparse_attention_freq=[0, 1]"),
    ({"num_hidden_layers": 0}, "text_config.num_hidden_layers=0"),
    ({"shared_intermediate_size": 256}, "text_config.shared_intermediate_size=256"),
    ({"sparse_init_block": 1}, "text_config.sparse_attention_config.sparse_init_block=1"),
    ({"use_routing_bias": 1}, "text_config.use_routing_bias=1"),
    ({"vocab_size": 100}, "text_config.vocab_size=100"),
])
def test_bad_config_raises_naming_the_field_and_writes_nothing(tmp_path, overrides, field):
    with pytest.raises(ValueError) as err:
        builder.make_tiny_model(tmp_path / "m3", **overrides)
    assert str(err.value).startswith(field + ":")
    assert not any(tmp_path.iterdir())


def test_unknown_key_and_foreign_directory_are_refused(tmp_path):
    with pytest.raises(ValueError, match="hiden_size"):
        builder.make_tiny_model(tmp_path / "m3", hiden_size=64)
    with pytest.raises(ValueError, match="sparse_topk_block'"):
        builder.make_tiny_model(tmp_path / "m3", sparse_attention_config={"sparse_topk_block": 4})
    (tmp_path / "m3").mkdir()
    (tmp_path / "m3" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        builder.make_tiny_model(tmp_path / "m3")
    assert (tmp_path / "m3" / "notes.txt").read_text() == "keep me"


def test_cli_parses_overrides_and_reports_config_errors(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_cli", REPO / "scripts" / "make_tiny_model.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--out", str(tmp_path / "kv2"), "--dtype", "float32", "num_attention_heads=4",
                     "num_key_value_heads=2", "sparse_attention_freq=[0,1,0,1]"]) == 0
    t = json.loads((tmp_path / "kv2" / "config.json").read_text())["text_config"]
    assert (t["num_key_value_heads"], t["sparse_attention_config"]["sparse_num_index_heads"]) == (2, 2)
    assert t["sparse_attention_config"]["sparse_attention_freq"] == [0, 1, 0, 1] and t["dtype"] == "float32"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--out", str(tmp_path / "bad"), "hidden_act=silu"])
    assert exit_.value.code == 2 and "text_config.hidden_act='silu'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_derived_defaults_follow_overrides():
    t = config.resolve_text_config(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                               n_shared_experts=2)
    assert t["sparse_attention_config"]["sparse_num_index_heads"] == 2
    assert t["moe_layer_freq"] == t["sparse_attention_config"]["sparse_attention_freq"] == [0, 1, 1]
    assert t["shared_intermediate_size"] == 256
    config.validate_config(t)


def test_variant_without_sparse_layers_keeps_all_other_weights():
    base = weights.init_weights(config.resolve_text_config())
    dense = weights.init_weights(config.resolve_text_config(sparse_attention_freq=[0, 0, 0, 0]))
    assert set(base) - set(dense) == {k for k in base if ".self_attn.index_" in k} != set()
    assert all(torch.equal(dense[k], base[k]) for k in dense)


# ----------------------------------------------------------------------------- cache
def test_ensure_tiny_model_reuses_verified_builds_and_rebuilds_broken_ones(tmp_path):
    first = builder.ensure_tiny_model(tmp_path, dtype="float32")
    stamp = (first.vllm / "model.safetensors").stat().st_mtime_ns
    assert builder.ensure_tiny_model(tmp_path, dtype="float32") == first
    assert (first.vllm / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert load_file(first.vllm / "model.safetensors")["lm_head.weight"].dtype == torch.float32
    (first.hf / "config.json").write_text("{}")  # a damaged copy is detected through the manifest
    assert builder.ensure_tiny_model(tmp_path, dtype="float32") == first
    assert json.loads((first.hf / "config.json").read_text())["model_type"] == "minimax_m3_vl_text"


# ----------------------------------------------------------------------------- vLLM loader (slow)
_LOAD_CHECK = textwrap.dedent("""
    import os, sys, torch
    from safetensors.torch import load_file
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.models.minimax_m3.nvidia import model as m3
    # Model construction only needs the MoE backend to accept M3's activation; no forward runs.
    cpu_moe.CPUUnquantizedExperts._supports_activation = staticmethod(lambda act: True)
    ckpt = load_file(os.path.join(sys.argv[1], "model.safetensors"))
    orig, bad = m3.MiniMaxM3SparseForCausalLM.load_weights, []
    def load_weights(self, weights):
        loaded, params = orig(self, weights), dict(self.named_parameters())
        bad.extend(f"not loaded: {n}" for n in sorted(set(params) - set(loaded)))
        cat = lambda *ns: torch.cat([ckpt[n] for n in ns if n in ckpt])
        for name, p in params.items():
            base = name.rsplit(".", 2)[0]  # drops e.g. "qkv_proj.weight"
            moe = name.rsplit(".", 1)[0].replace(".routed_experts", "")
            try:
                if name.endswith("qkv_proj.weight"):
                    want = cat(*(f"{base}.{x}_proj.weight" for x in ("q", "k", "v", "index_q", "index_k")))
                elif name.endswith("gate_up_proj.weight"):
                    want = cat(f"{base}.gate_proj.weight", f"{base}.up_proj.weight")
                elif name.endswith("w13_weight"):
                    want = torch.stack([cat(f"{moe}.{e}.w1.weight", f"{moe}.{e}.w3.weight")
                                        for e in range(len(p))])
                elif name.endswith("w2_weight"):
                    want = torch.stack([ckpt[f"{moe}.{e}.w2.weight"] for e in range(len(p))])
                else:
                    want = ckpt[name]
                same = want.shape == p.shape and torch.equal(want.to(p.dtype), p.data)
            except (KeyError, RuntimeError):  # a checkpoint name vLLM expects is missing
                same = False
            if not same:
                bad.append(f"differs: {name}")
        return loaded
    m3.MiniMaxM3SparseForCausalLM.load_weights = load_weights
    from vllm import LLM
    LLM(sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=2,
        kv_cache_memory_bytes=64 << 20, seed=0)
    print("BAD", bad)
""")


@pytest.mark.slow
def test_vllm_loader_consumes_every_tensor_into_the_right_place(tiny, tmp_path):
    """vLLM's own load_weights drops unknown names silently, so check what it actually loaded."""
    stub = tmp_path / "stub"  # torchvision is imported for a type hint by vLLM's M3 processor
    (stub / "torchvision" / "transforms" / "v2").mkdir(parents=True)
    (stub / "torchvision" / "io").mkdir()
    (stub / "torchvision-0.0.1.dist-info").mkdir()
    (stub / "torchvision-0.0.1.dist-info" / "METADATA").write_text("Name: torchvision\nVersion: 0.0.1\n")
    for rel, src in {"__init__.py": "from . import transforms, io\n",
                     "transforms/__init__.py": "import enum\nfrom . import functional, v2\n"
                     "InterpolationMode = enum.Enum('InterpolationMode', "
                     "'NEAREST NEAREST_EXACT BILINEAR BICUBIC BOX HAMMING LANCZOS')\n",
                     "transforms/functional.py": "def pil_to_tensor(*a, **k): raise NotImplementedError\n",
                     "transforms/v2/__init__.py": "from . import functional\n",
                     "transforms/v2/functional.py": "",
                     "io/__init__.py": "import enum\nImageReadMode = enum.Enum('ImageReadMode', 'RGB')\n"
                     "def decode_image(*a, **k): raise NotImplementedError\n"}.items():
        (stub / "torchvision" / rel).write_text(src)
    env = {**os.environ, "PYTHONPATH": f"{stub}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "2",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = subprocess.run([sys.executable, "-c", _LOAD_CHECK, str(tiny.vllm)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert "BAD []" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
