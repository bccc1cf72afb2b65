"""quant.checkpoint and scripts/quantize_checkpoint.py: the tiny M3 converted to NVFP4 experts + MXFP8 linears.

- Stored bytes equal vLLM's reference quantizers fed the same bf16 weights (``ref_nvfp4_quant`` with encode scale
  1 / weight_scale_2, ``_mxfp8_e4m3_quantize_torch``); the ModelOpt global-scale convention holds (gate and up share
  one scale); dequantized weights differ from bf16 only by each format's rounding bound.
- vLLM's own config parsing takes the output as ``modelopt_mixed`` and gives experts NVFP4, linears MXFP8.
- The reader/writer round-trips the served formats (ModelOpt NVFP4 with input_scale, ModelOpt and MiniMax-native
  MXFP8, mixed and uniform configs, sharded files) reading headers first and tensors one at a time.
- Bad checkpoints raise one CheckpointError naming the tensor and the reason.
"""

from __future__ import annotations

import importlib.util
import json
import weakref
from pathlib import Path

import pytest
import torch
from quant_oracles import assert_bitwise_equal, mxfp8_utils, nvfp4_emulation_utils
from safetensors.torch import load_file, save_file

from m3.tiny import ensure_tiny_model
from quant import checkpoint as ckpt_mod
from quant.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    QuantizedCheckpoint,
    mixed_precision_config,
    parse_quant_config,
    quantize_mxfp8,
    quantize_nvfp4,
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "quantize_checkpoint.py"
MOE = "model.layers.1.block_sparse_moe"


def load_cli():
    spec = importlib.util.spec_from_file_location("quantize_checkpoint_cli", SCRIPT)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


class SpyOpen:
    """safe_open that records every tensor read and keeps a weak reference to what it returns."""

    def __init__(self, real):
        self.real, self.reads, self.alive, self.peak_alive_experts = real, [], set(), 0

    def __call__(self, *args, **kwargs):
        spy, inner = self, self.real(*args, **kwargs)

        class Handle:
            def __enter__(self):
                self.f = inner.__enter__()
                return self

            def __exit__(self, *exc):
                return inner.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                return self.f.get_slice(name)

            def get_tensor(self, name):
                t = self.f.get_tensor(name)
                spy.reads.append(name)
                if ".experts." in name:
                    spy.alive.add(name)
                    weakref.finalize(t, spy.alive.discard, name)
                    spy.peak_alive_experts = max(spy.peak_alive_experts, len(spy.alive))
                return t

        return Handle()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    src = ensure_tiny_model(dtype="bfloat16").vllm
    out = tmp_path_factory.mktemp("convert") / "m3q"
    spy = SpyOpen(ckpt_mod.safe_open)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ckpt_mod, "safe_open", spy)
        summary = load_cli().quantize_checkpoint(src, out)
        reads_before_open = len(spy.reads)
        q = QuantizedCheckpoint(out)
        opened_reads = len(spy.reads) - reads_before_open
    return {"src": src, "out": out, "q": q, "bf16": load_file(src / "model.safetensors"), "summary": summary,
            "spy": spy, "opened_reads": opened_reads}


def test_conversion_reads_each_tensor_once_and_never_holds_more_than_one_expert_pair(converted):
    spy, src = converted["spy"], converted["bf16"]
    assert sorted(spy.reads) == sorted(src)  # every source tensor read exactly once
    assert spy.peak_alive_experts <= 2  # w1 + w3 of one expert (their shared scale), never all experts
    assert converted["opened_reads"] == 0  # opening a checkpoint reads headers only


def test_layout_config_and_copied_files(converted):
    q, bf16 = converted["q"], converted["bf16"]
    algos = q.modules()
    assert converted["summary"] == {"modules": {"MXFP8": 34, "W4A16_NVFP4": 72}, "copied_modules": 28}
    for prefix, algo in algos.items():
        expert = ".block_sparse_moe.experts." in prefix
        linear = prefix.endswith("_proj") and not expert
        assert algo == ("W4A16_NVFP4" if expert else "MXFP8" if linear else None), prefix
        if algo is None:
            assert_bitwise_equal(q.tensor(f"{prefix}.weight"), bf16[f"{prefix}.weight"])
    assert_bitwise_equal(q.tensor(f"{MOE}.e_score_correction_bias"), bf16[f"{MOE}.e_score_correction_bias"])
    assert q.tensor(f"{MOE}.gate.weight").dtype == torch.float32
    src_cfg = json.loads((converted["src"] / "config.json").read_text())
    out_cfg = json.loads((converted["out"] / "config.json").read_text())
    assert {k: v for k, v in out_cfg.items() if k != "quantization_config"} == src_cfg
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (converted["out"] / name).read_bytes() == (converted["src"] / name).read_bytes()
    assert not (converted["out"] / "tiny_model.json").exists()


def test_nvfp4_experts_equal_vllm_reference_quantizer_with_modelopt_global_scales(converted):
    q, bf16 = converted["q"], converted["bf16"]
    experts = [p for p, a in q.modules().items() if a == "W4A16_NVFP4"]
    assert len(experts) == 3 * 8 * 3
    for prefix in experts:
        w = q.read(prefix)
        pair = [prefix.rsplit(".", 1)[0] + f".{x}" for x in ("w1", "w3")]
        if prefix in pair:  # gate and up share max(amax_w1, amax_w3) / (6 * 448), fp32
            amax = torch.stack([bf16[f"{p}.weight"].abs().amax().float() for p in pair]).amax()
            assert torch.equal(q.read(pair[0]).global_scale, q.read(pair[1]).global_scale)
        else:
            amax = bf16[f"{prefix}.weight"].abs().amax().float()
        assert_bitwise_equal(w.global_scale, amax / 2688.0)
        vals, scale = nvfp4_emulation_utils.ref_nvfp4_quant(bf16[f"{prefix}.weight"], 1.0 / w.global_scale.reshape(1), 16)
        assert_bitwise_equal(w.scale.to(torch.float32), scale)
        assert_bitwise_equal(nvfp4_emulation_utils.break_fp4_bytes(w.packed, torch.float32), vals)
        vllm_deq = nvfp4_emulation_utils.dequantize_to_dtype(w.packed, w.scale, w.global_scale, torch.float32, 16,
                                                             swizzle=False)
        assert_bitwise_equal(q.dequantized(prefix, torch.float32), vllm_deq)


def test_mxfp8_linears_equal_vllm_quantizer(converted):
    q, bf16 = converted["q"], converted["bf16"]
    linears = [p for p, a in q.modules().items() if a == "MXFP8"]
    assert any("index_q_proj" in p for p in linears) and any("shared_experts" in p for p in linears)
    for prefix in linears:
        w = q.read(prefix)
        ref_q, ref_s = mxfp8_utils._mxfp8_e4m3_quantize_torch(bf16[f"{prefix}.weight"])
        assert_bitwise_equal(w.weight, ref_q)
        assert_bitwise_equal(w.scale, ref_s.view(torch.uint8))
        assert_bitwise_equal(q.dequantized(prefix), mxfp8_utils.dequant_mxfp8_to_bf16(w.weight, w.scale))


def test_dequantized_weights_differ_from_bf16_only_by_the_format_rounding(converted):
    q, bf16 = converted["q"], converted["bf16"]
    for prefix, algo in q.modules().items():
        if algo is None:
            continue
        x = bf16[f"{prefix}.weight"].float()
        err = (q.dequantized(prefix, torch.float32) - x).abs()
        w = q.read(prefix)
        if algo == "MXFP8":
            # RNE into E4M3 (3 mantissa bits): half an ulp <= 2^-4 |x|; subnormals: half of 2^-9 * block scale
            unit = torch.exp2(w.scale.float() - 127).repeat_interleave(32, dim=-1)
            bound = torch.maximum(x.abs() * 2**-4, unit * 2**-10)
        else:
            # E2M1 steps are 0.5 / 1 / 2 on |v| < 2 / < 4 / <= 6 (v = x / u, u = block scale * gs): half a step is
            # <= max(0.25 u, |x| / 4); the clamp at 6 after the E4M3 scale rounds down costs < 0.375 u <= |x| / 4.
            u = (w.scale.float() * w.global_scale).repeat_interleave(16, dim=-1)
            assert (w.scale.float() > 0).all()  # no underflowed block in this model (those would be all-zero)
            bound = torch.maximum(0.25 * u, x.abs() / 4)
        assert (err <= bound * (1 + 2**-20)).all(), f"{prefix}: max excess {(err - bound).max():.3g}"
        assert err.max() > 0


def test_vllm_parses_the_config_as_modelopt_mixed_nvfp4_experts_mxfp8_linears(converted, monkeypatch):
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization import get_quantization_config, modelopt
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp8Static

    qcfg = json.loads((converted["out"] / "config.json").read_text())["quantization_config"]
    method = modelopt.ModelOptMixedPrecisionConfig.override_quantization_method(qcfg, None)
    assert method == "modelopt_mixed"
    cfg = get_quantization_config(method).from_config(qcfg)
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    linear = LinearBase.__new__(LinearBase)  # only its type is consulted
    vllm_linears = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"]
    for i in (1, 2, 3):
        vllm_linears += [f"model.layers.{i}.self_attn.qkv_proj", f"model.layers.{i}.self_attn.o_proj",
                         f"model.layers.{i}.block_sparse_moe.shared_experts.gate_up_proj",
                         f"model.layers.{i}.block_sparse_moe.shared_experts.down_proj"]
    for prefix in vllm_linears:
        m = cfg.get_quant_method(linear, prefix)
        assert type(m).__name__ == "ModelOptLinearMethod" and m.spec.weight == kMxfp8Static, prefix
    for prefix in ("lm_head", f"{MOE}.gate"):
        assert isinstance(cfg.get_quant_method(linear, prefix), UnquantizedLinearMethod)
    # The expert method is only recorded: vLLM's own constructor picks a CUDA backend (none on CPU).
    monkeypatch.setattr(modelopt, "ModelOptNvFp4FusedMoE", lambda quant_config, moe_config: quant_config)
    experts = RoutedExperts.__new__(RoutedExperts)
    object.__setattr__(experts, "moe_config", None)
    for i in (1, 2, 3):
        sub = cfg.get_quant_method(experts, f"model.layers.{i}.block_sparse_moe.experts")
        assert isinstance(sub, modelopt.ModelOptNvFp4Config)
        assert (sub.quant_method, sub.group_size, sub.is_checkpoint_nvfp4_serialized) == ("W4A16_NVFP4", 16, True)


# ---- reader / writer on small synthetic checkpoints -------------------------------------------------------


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"e": torch.randn(32, 64, generator=g).to(torch.bfloat16), "q": torch.randn(16, 64, generator=g),
            "norm": torch.randn(64, generator=g).to(torch.bfloat16)}


def _write(d: Path, tensors: dict, qcfg) -> Path:
    d.mkdir()
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({} if qcfg is None else {"quantization_config": qcfg}))
    return d


def _valid(algo: str = "W4A16_NVFP4"):
    w = _weights()
    nv = quantize_nvfp4(w["e"], input_scale=torch.tensor(0.01) if algo == "NVFP4" else None)
    mx = quantize_mxfp8(w["q"])
    t = {"m.experts.0.w1.weight": nv.packed, "m.experts.0.w1.weight_scale": nv.scale,
         "m.experts.0.w1.weight_scale_2": nv.global_scale, "m.q_proj.weight": mx.weight,
         "m.q_proj.weight_scale": mx.scale, "m.norm.weight": w["norm"]}
    if nv.input_scale is not None:
        t["m.experts.0.w1.input_scale"] = nv.input_scale
    return t, mixed_precision_config({"m.experts.0.w1": algo, "m.q_proj": "MXFP8"}), (nv, mx)


def test_writer_reader_round_trip_sharded_modelopt_and_minimax_names(tmp_path):
    w = _weights()
    nv = quantize_nvfp4(w["e"], input_scale=torch.tensor(0.02))
    mx = quantize_mxfp8(w["q"])
    with CheckpointWriter(tmp_path / "a", max_shard_bytes=1024) as wr:
        wr.add_module("m.experts.0.w1", nv)
        wr.add_module("m.q_proj", mx, mxfp8_scale_name="weight_scale_inv")
        wr.add_module("m.norm", w["norm"])
    (tmp_path / "a" / "config.json").write_text(json.dumps({"quantization_config": mixed_precision_config(
        {"m.experts.0.w1": "NVFP4", "m.q_proj": "MXFP8"})}))
    assert len(list((tmp_path / "a").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "a" / ckpt_mod.INDEX_FILE).is_file()
    q = QuantizedCheckpoint(tmp_path / "a")
    got = q.read("m.experts.0.w1")
    for a, b in zip((got.packed, got.scale, got.global_scale, got.input_scale),
                    (nv.packed, nv.scale, nv.global_scale, nv.input_scale)):
        assert_bitwise_equal(a, b)
    got = q.read("m.q_proj")
    assert_bitwise_equal(got.weight, mx.weight) and assert_bitwise_equal(got.scale, mx.scale)
    assert_bitwise_equal(q.read("m.norm"), w["norm"])
    names = dict(q.iter_dequantized(torch.float32))
    assert sorted(names) == ["m.experts.0.w1.weight", "m.norm.weight", "m.q_proj.weight"]
    assert_bitwise_equal(names["m.q_proj.weight"], mx.dequantize(torch.float32))


@pytest.mark.parametrize("qcfg,where", [
    ({"quant_method": "mxfp8", "ignored_layers": ["m.skip"]}, "config"),  # MiniMax-native
    ({"quant_method": "modelopt", "quant_algo": "mxfp8", "ignore": ["m.skip"]}, "config"),  # ModelOpt, config.json
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "MXFP8", "exclude_modules": ["m.skip"]}},
     "hf_quant_config.json"),  # legacy file
])
def test_uniform_mxfp8_configs(tmp_path, qcfg, where):
    w = _weights()
    mx = quantize_mxfp8(w["q"])
    t = {"m.q_proj.weight": mx.weight, "m.q_proj.weight_scale_inv": mx.scale.view(torch.float8_e8m0fnu),
         "m.skip.weight": w["q"].to(torch.bfloat16), "m.norm.weight": w["norm"]}
    d = _write(tmp_path / "c", t, qcfg if where == "config" else None)
    if where != "config":
        (d / where).write_text(json.dumps(qcfg))
    q = QuantizedCheckpoint(d)
    assert q.modules() == {"m.q_proj": "MXFP8", "m.skip": None, "m.norm": None}
    assert_bitwise_equal(q.read("m.q_proj").scale, mx.scale)


def _mutate(kind: str):
    t, qcfg, (nv, mx) = _valid("NVFP4" if kind == "w4a4 without input_scale" else "W4A16_NVFP4")
    e, layers = "m.experts.0.w1", qcfg["quantized_layers"]
    if kind == "missing global scale":
        del t[f"{e}.weight_scale_2"]
    elif kind == "scale dtype":
        t[f"{e}.weight_scale"] = nv.scale.float()
    elif kind == "scale shape":
        t[f"{e}.weight_scale"] = nv.scale[:, :-1].contiguous()
    elif kind == "nvfp4 K not a block multiple":
        t[f"{e}.weight"], t[f"{e}.weight_scale"] = nv.packed[:, :12].contiguous(), nv.scale[:, :1].contiguous()
    elif kind == "mxfp8 K not a block multiple":
        t["m.q_proj.weight"], t["m.q_proj.weight_scale"] = mx.weight[:, :48].contiguous(), mx.scale[:, :1].contiguous()
    elif kind == "mxfp8 scale missing":
        del t["m.q_proj.weight_scale"]
    elif kind == "both mxfp8 scale names":
        t["m.q_proj.weight_scale_inv"] = mx.scale
    elif kind == "w4a4 without input_scale":
        del t[f"{e}.input_scale"]
    elif kind == "unknown quant method":
        qcfg = {"quant_method": "gptq", "bits": 4}
    elif kind == "unknown algo":
        layers["m.q_proj"]["quant_algo"] = "FP8"
    elif kind == "group size":
        layers["m.q_proj"]["group_size"] = 16
    elif kind == "scales on an unlisted module":
        del layers["m.q_proj"]
    elif kind == "listed module missing":
        layers["m.k_proj"] = {"quant_algo": "MXFP8"}
    elif kind == "orphan scale":
        t["m.ghost.weight_scale"] = mx.scale
    elif kind == "bf16 weight declared mxfp8":
        t["m.q_proj.weight"] = mx.dequantize()
    return t, qcfg


BAD = {
    "missing global scale": r"^m\.experts\.0\.w1\.weight_scale_2: missing",
    "scale dtype": r"^m\.experts\.0\.w1\.weight_scale: dtype F32",
    "scale shape": r"^m\.experts\.0\.w1\.weight_scale: shape \(32, 3\); expected \(32, 4\)",
    "nvfp4 K not a block multiple": r"^m\.experts\.0\.w1\.weight: .*K=24, not a multiple of the NVFP4 block 16",
    "mxfp8 K not a block multiple": r"^m\.q_proj\.weight: shape \(16, 48\); MXFP8 .* multiple of its block 32",
    "mxfp8 scale missing": r"^m\.q_proj\.weight_scale: missing",
    "both mxfp8 scale names": r"^m\.q_proj\.weight_scale: both weight_scale and weight_scale_inv",
    "w4a4 without input_scale": r"^m\.experts\.0\.w1\.input_scale: missing \(quant_algo NVFP4 is W4A4",
    "unknown quant method": r"quant_method='gptq': unknown quant method",
    "unknown algo": r"quantized_layers\['m\.q_proj'\]\.quant_algo='FP8': unknown quant algo",
    "group size": r"quantized_layers\['m\.q_proj'\]\.group_size=16: MXFP8 uses blocks of 32",
    "scales on an unlisted module": r"^m\.q_proj\.weight_scale: quantization tensor on an unquantized module",
    "listed module missing": r"^m\.k_proj\.weight: missing",
    "orphan scale": r"^m\.ghost\.weight_scale: quantization scale without its weight",
    "bf16 weight declared mxfp8": r"^m\.q_proj\.weight: dtype BF16; expected F8_E4M3 \(MXFP8 weight",
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_checkpoint_raises_one_error_naming_the_tensor(tmp_path, kind):
    t, qcfg = _mutate(kind)
    d = _write(tmp_path / "bad", t, qcfg)
    with pytest.raises(CheckpointError, match=BAD[kind]):
        QuantizedCheckpoint(d)


def test_the_valid_base_of_the_bad_cases_reads(tmp_path):
    for algo in ("W4A16_NVFP4", "NVFP4"):
        t, qcfg, _ = _valid(algo)
        q = QuantizedCheckpoint(_write(tmp_path / algo, t, qcfg))
        assert q.modules() == {"m.experts.0.w1": algo, "m.q_proj": "MXFP8", "m.norm": None}


def test_bad_values_and_bad_inputs_to_the_quantizers(tmp_path):
    t, qcfg, _ = _valid()
    t["m.experts.0.w1.weight_scale_2"] = torch.tensor(0.0)
    q = QuantizedCheckpoint(_write(tmp_path / "zero", t, qcfg))
    with pytest.raises(CheckpointError, match=r"^m\.experts\.0\.w1\.weight_scale_2: 0\.0; a global scale must be"):
        q.read("m.experts.0.w1")
    with pytest.raises(CheckpointError, match=r"^x\.weight: shape \(4, 48\); MXFP8 needs"):
        quantize_mxfp8(torch.randn(4, 48), name="x.weight")
    bad = torch.randn(4, 32)
    bad[1, 2] = float("nan")
    with pytest.raises(CheckpointError, match=r"^y\.weight: holds NaN/Inf"):
        quantize_nvfp4(bad, name="y.weight")
    with pytest.raises(CheckpointError, match=r"^quantization_config\.quant_method='awq'"):
        parse_quant_config({"quant_method": "awq"})


def test_cli_refuses_an_already_quantized_input(converted, tmp_path, capsys):
    assert load_cli().main(["--in", str(converted["out"]), "--out", str(tmp_path / "again")]) == 2
    assert "already has a quantization_config" in capsys.readouterr().err
