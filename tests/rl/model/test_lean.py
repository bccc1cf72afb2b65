"""rl.model.lean and the LoRA shrink against the plain torch expressions they replace: forward bit-equal (bf16 and
fp32, more rows than one chunk), gradients as autograd's up to fp32 summation order."""

import pytest
import torch
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRMSNorm

from m3.ops import neox_rope
from rl.model import lean
from rl.model.lora import lora_delta
from rl.model.transformer import expert_groups


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(lean, "ROWS", 7)  # several chunks and a ragged last one


def _norm(dim, g):
    norm = MiniMaxM3VLRMSNorm(dim, 1e-6)
    norm.weight = torch.nn.Parameter(torch.randn(dim, generator=g) * 0.1, requires_grad=False)
    return norm


def _plain_add_norm(norm, x, residual):
    total = x.float() + residual.float()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight.float())
    return normed.to(x.dtype), total.to(x.dtype)


def _check(fn_new, fn_old, inputs, dtype, atol):
    outs = []
    for fn in (fn_new, fn_old):
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        y = fn(*xs)
        y = y if isinstance(y, tuple) else (y,)
        g = torch.Generator().manual_seed(5)
        sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in y).backward()
        outs.append(([o.detach() for o in y], [t.grad.float() for t in xs]))
    (y_new, g_new), (y_old, g_old) = outs
    assert all(torch.equal(a, b) for a, b in zip(y_new, y_old))
    for a, b in zip(g_new, g_old):
        assert float((a - b).norm() / b.norm()) <= atol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_norm(dtype):
    g = torch.Generator().manual_seed(0)
    norm = _norm(64, g)
    x, r = (torch.randn(30, 64, generator=g).to(dtype) for _ in range(2))
    _check(lambda a, b: lean.fused_add_norm(norm, a, b), lambda a, b: _plain_add_norm(norm, a, b), [x, r], dtype,
           1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope(dtype):
    g = torch.Generator().manual_seed(1)
    norm = _norm(32, g)
    x = torch.randn(30, 3, 32, generator=g).to(dtype)
    ang = torch.randn(30, 8, generator=g)
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1).to(dtype)
    _check(lambda a: lean.norm_rope(norm, a, cos_sin, 16), lambda a: neox_rope(norm(a), cos_sin, 16), [x], dtype,
           1e-6 if dtype == torch.float32 else 1e-2)


def _by_rows(fn):
    """fn applied to lean.ROWS-row chunks of its first argument (7 here): the reference for the row-chunked GEMMs,
    whose bit-equality holds per chunk; BLAS may sum a 7-row and a 30-row GEMM in different orders (MKL on AVX-512
    does: the whole-batch expression differs in the last bit)."""
    return lambda x, *rest: torch.cat([fn(x[a:a + lean.ROWS], *rest) for a in range(0, x.shape[0], lean.ROWS)])


def test_fp32_linear():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5, 64, generator=g)
    x = torch.randn(30, 64, generator=g).to(torch.bfloat16)
    _check(lambda a: lean.fp32_linear(a, w), _by_rows(lambda a: a.float() @ w.t()), [x], torch.bfloat16, 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_shrink(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, 64, generator=g).to(dtype)
    a, b = torch.randn(4, 64, generator=g) * 0.1, torch.randn(48, 4, generator=g) * 0.1

    def plain(x, a, b):  # the shrink in lean.ROWS chunks as lora_delta runs it, the expand on all rows
        h = _by_rows(lambda x, a: (x.float() @ a.to(x.dtype).float().t()).to(x.dtype))(x, a)
        return h @ (b.to(x.dtype) * 2.0).to(x.dtype).t()

    _check(lambda *t: lora_delta(*t, 2.0), plain, [x, a, b], dtype, 1e-6 if dtype == torch.float32 else 1e-2)


def test_expert_groups():
    bounds = [0, 3, 3, 10, 11, 30, 31, 31]
    assert expert_groups(bounds, 10) == [(0, 3), (3, 4), (4, 5), (5, 7)]
    assert expert_groups(bounds, 100) == [(0, 7)]
    assert expert_groups([0, 0, 0], 4) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_logprobs(monkeypatch, dtype):
    monkeypatch.setattr(lean, "LOGIT_ROWS", 7)
    g = torch.Generator().manual_seed(4)
    h = torch.randn(30, 64, generator=g).to(dtype)
    w = torch.randn(50, 64, generator=g).to(dtype) * 0.3
    t = torch.randint(0, 50, (30,), generator=g)

    def plain(h):
        return torch.cat([(h[a:a + 7] @ w.t()).float().log_softmax(-1).gather(1, t[a:a + 7, None])[:, 0]
                          for a in range(0, 30, 7)])

    _check(lambda x: lean.lm_head_logprobs(x, w, t), plain, [h], dtype, 1e-5 if dtype == torch.float32 else 1e-2)


def test_lm_head_logprobs_without_grad_keeps_nothing(monkeypatch):
    """Without a gradient to form, the forward skips the Jacobian GEMM and returns the same values."""
    monkeypatch.setattr(lean, "LOGIT_ROWS", 7)
    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(20, 16, generator=g), torch.randn(30, 16, generator=g)
    t = torch.randint(0, 30, (20,), generator=g)
    calls = []
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: calls.append(1) or torch.matmul(a, b))
    with torch.no_grad():
        plain = lean.lm_head_logprobs(h, w, t)
    n_plain, calls[:] = len(calls), []
    assert torch.equal(plain, lean.lm_head_logprobs(h.requires_grad_(), w, t).detach())
    assert (n_plain, len(calls)) == (3, 6)  # one GEMM per chunk without a gradient, two with


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_rows_and_sum(dtype):
    """The routed experts' fp32 weighted rows and their per-token sum, bit-equal to fp32(y) * w (one fp32 product
    per element however the promotion is spelled), gradients as autograd's."""
    g = torch.Generator().manual_seed(8)
    y = torch.randn(30, 64, generator=g).to(dtype)
    w = torch.rand(30, generator=g)
    tok = torch.randint(0, 11, (30,), generator=g)
    bound = 1e-6 if dtype == torch.float32 else 1e-2
    _check(lambda a: lean.weighted_rows(a, w), lambda a: a.float() * w[:, None], [y], dtype, bound)
    _check(lambda a: lean.weighted_sum(a, w, tok, 11),
           lambda a: torch.zeros(11, 64).index_add(0, tok, a.float() * w[:, None]), [y], dtype, bound)
