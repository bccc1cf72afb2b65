"""The trainer on the H200 (marker `gpu`): the grouped NVFP4 expert kernels and FlexAttention MSA give the same
token logprobs and LoRA gradients as the CPU reference paths, on the quantized tiny M3 in bf16."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_gpu_fast_paths_match_cpu_reference(tmp_path):
    from quant.convert import quantize_checkpoint
    from rl.lora import lora_parameters
    from rl.model import M3ForTraining, TrainerModelConfig
    from rollout.tiny_model import ensure_tiny_model

    src = ensure_tiny_model(tmp_path / "cache", dtype="bfloat16")
    quantize_checkpoint(src.vllm, tmp_path / "q")
    g = torch.Generator().manual_seed(0)
    lengths = [300, 700, 128]
    ids = torch.randint(10, 500, (sum(lengths),), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = {}
    for device in ("cpu", os.environ.get("M3RL_TEST_DEVICE", "cuda")):  # "cpu": a dry run of the test logic
        model = M3ForTraining(TrainerModelConfig(path=str(tmp_path / "q"), dtype="bfloat16"))
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in lora_parameters(model):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        model.to(device)
        lp = model.token_logprobs(ids.to(device), cu.to(device), ids.roll(-1).to(device))
        lp.sum().backward()
        out[device] = (lp.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()
                                           if p.requires_grad and p.grad is not None})
    lp_cpu, g_cpu = out["cpu"]
    lp_gpu, g_gpu = out[list(out)[-1]]
    assert (lp_cpu - lp_gpu).abs().median() <= 0.02 and (lp_cpu - lp_gpu).abs().mean() <= 0.05
    for name in g_cpu:
        a, b = g_cpu[name].float(), g_gpu[name].float()
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99, name
