"""quant/ on CUDA computes bit for bit what it computes on CPU (marker `gpu`, run on the H200).

The CPU results are asserted bit-exact against vLLM's own functions in the other tests of this folder (which need
vLLM, absent on the GPU machine); this file closes the loop on the device: same inputs, same bits. The inputs
cover the edge families of the notes (E2M1 ties and their neighbours, the 448/464 boundary, 464.1, zero/tiny and
subnormal-scale blocks, NaN/Inf, E8M0 corners) plus random tensors. Torch's float8 casts differ between versions
(2.11 turns 464.1/inf into NaN) and devices; the explicit clamps make both agree.
"""

import os

import pytest
import torch

from quant import kv_cache, mxfp8, nvfp4, serving

pytestmark = pytest.mark.gpu

TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def edge_tensor(rows: int = 64, k: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g) * 3
    ties = torch.tensor(TIES + [-t for t in TIES])
    x[0, :len(ties)] = ties
    x[1, :len(ties)] = torch.nextafter(ties, torch.full_like(ties, 1e9))
    x[2, :len(ties)] = torch.nextafter(ties, torch.full_like(ties, -1e9))
    x[3, :16] = torch.tensor([6.0, 6.0001, 1e30, 448.0, 456.0, 464.0, 464.1, 1e9, -0.0, 0.0, -1e-9, 2.0**-10,
                              2.0**-9 * 1.5, 2.0**-9 * 0.5, 7 * 2.0**-9, 2.0**-11])
    x[4] = 0.0  # zero blocks
    x[5] = 1e-6  # tiny blocks (subnormal or zero scales)
    x[6, :32] = 2.0**-9 * torch.arange(32)  # subnormal E4M3 scales
    x[7, :16] = float("nan")
    x[8, :16] = float("inf")
    x[9, :32] = 448.0 * 1.75
    x[10, :32] = 1.7578125 * 2.0**5
    return x


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits; NaN matches NaN (devices write different NaN payloads, e.g. 0x7fc0 vs 0xffc0)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    nan_a = torch.isnan(a.float()) if a.is_floating_point() else torch.zeros(a.shape, dtype=torch.bool)
    nan_b = torch.isnan(b.float()) if b.is_floating_point() else torch.zeros(b.shape, dtype=torch.bool)
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(view)[~nan_a], b.view(view)[~nan_b])


@pytest.fixture(scope="module")
def cuda():
    device = torch.device(os.environ.get("M3RL_TEST_DEVICE", "cuda"))  # "cpu": a dry run of the test logic
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.fail("marker gpu: needs CUDA")
    return device


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_quantize_dequantize(cuda, dtype):
    x = edge_tensor().to(dtype)
    finite = torch.isfinite(x).all(-1)
    x = x[finite]  # NaN/Inf blocks: covered by the activation QDQ and KV tests below
    for gs in (torch.tensor(1.0), x.float().abs().amax() / 2688):
        cpu_q, cpu_s = nvfp4.quantize(x, gs)
        gpu_q, gpu_s = nvfp4.quantize(x.to(cuda), gs.to(cuda))
        assert bits_equal(cpu_q, gpu_q) and bits_equal(cpu_s, gpu_s)
        assert bits_equal(nvfp4.dequantize(cpu_q, cpu_s, gs, dtype),
                          nvfp4.dequantize(gpu_q, gpu_s, gs.to(cuda), dtype))


def test_nvfp4_activation_qdq_and_kv_qdq(cuda):
    x = edge_tensor().to(torch.bfloat16)
    gs_enc = torch.tensor(2688.0 / 100.0)
    assert bits_equal(nvfp4.qdq_activation(x, gs_enc), nvfp4.qdq_activation(x.to(cuda), gs_enc.to(cuda)))
    assert bits_equal(kv_cache.nvfp4_kv_qdq(x), kv_cache.nvfp4_kv_qdq(x.to(cuda)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp8_quantize_dequantize_qdq(cuda, dtype):
    x = edge_tensor().to(dtype)
    x = x[torch.isfinite(x).all(-1)]
    cpu_q, cpu_s = mxfp8.quantize(x)
    gpu_q, gpu_s = mxfp8.quantize(x.to(cuda))
    assert bits_equal(cpu_q, gpu_q) and bits_equal(cpu_s, gpu_s)
    assert bits_equal(mxfp8.dequantize(cpu_q, cpu_s, dtype), mxfp8.dequantize(gpu_q, gpu_s, dtype))
    assert bits_equal(mxfp8.qdq(x), mxfp8.qdq(x.to(cuda)))


def test_serving_forms_agree_where_the_gemm_is_exact(cuda):
    """GEMMs with exactly representable sums (small integers) leave no room for accumulation order: equal bits."""
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-6, 7, (64, 256), generator=g).float() / 2  # E2M1-representable values
    packed, scale = nvfp4.quantize(w, torch.tensor(1.0))
    x = torch.randint(-4, 5, (32, 256), generator=g).to(torch.bfloat16)
    gs = torch.tensor(0.5)
    for profile in ("hopper",):
        cpu = serving.nvfp4_linear(x, packed, scale, gs, profile)
        gpu = serving.nvfp4_linear(x.to(cuda), packed.to(cuda), scale.to(cuda), gs.to(cuda), profile)
        assert bits_equal(cpu, gpu)
    q, s = mxfp8.quantize(w)
    assert bits_equal(serving.mxfp8_linear(x, q, s), serving.mxfp8_linear(x.to(cuda), q.to(cuda), s.to(cuda)))


def test_serving_forms_on_random_weights_within_bf16_accumulation_order(cuda):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(512, 1024, generator=g)
    gs = w.abs().amax() / 2688
    packed, scale = nvfp4.quantize(w, gs)
    x = torch.randn(64, 1024, generator=g).to(torch.bfloat16)
    cpu = serving.nvfp4_linear(x, packed, scale, gs, "hopper").float()
    gpu = serving.nvfp4_linear(x.to(cuda), packed.to(cuda), scale.to(cuda), gs.to(cuda), "hopper").float().cpu()
    assert ((cpu - gpu).abs() <= 2 ** -7 * cpu.abs().clamp(min=1e-3)).all()  # one bf16 ulp of the output
