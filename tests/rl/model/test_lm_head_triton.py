"""rl.model.lm_head_triton (the LM head's log-softmax and softmax - onehot in one kernel) against rl.model.lean's
torch chain, and lm_head_logprobs with it against lm_head_logprobs without it.

CPU: the kernel under Triton's interpreter (a subprocess under each supported Triton, tests/triton_interpreter.py), fp32
and bf16 logits, a vocab that is not a multiple of the kernel's block (several blocks per row), targets at both ends and
inside, one outside the vocab (NaN, not a read out of bounds), and without the Jacobian the logits left as they were.
GPU (`-m gpu`): the same at M3's vocab (200,064) and 1,027 rows, and lm_head_logprobs' values and input gradient at
M3's width with the kernel vs the torch chain.
"""

import json
import sys

import pytest
import torch

from tests.triton_interpreter import run_under_interpreter


def _torch_chain(logits, t):
    """rl.model.lean's torch path for one chunk: (logp at the targets, softmax - onehot in the logits' dtype)."""
    logp = logits.float().log_softmax(-1)
    d = logp.exp().scatter_add_(1, t[:, None], torch.full((len(t), 1), -1.0, device=t.device))
    return logp.gather(1, t[:, None])[:, 0], d.to(logits.dtype)


def _cases(device, rows, vocab, block):
    from rl.model import lm_head_triton

    gen = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(rows, vocab, generator=gen) * 4).to(device, dtype)
        t = torch.randint(0, vocab, (rows,), generator=gen)
        t[0], t[1], t[2] = 0, vocab - 1, block  # the first and last columns, the second block's first
        t = t.to(device)
        ref_lp, ref_d = _torch_chain(logits, t)
        name = str(dtype)[6:]
        kept = logits.clone()
        lp = lm_head_triton.logprobs_(kept, t, False, block)
        out[f"{name}_no_jacobian_leaves_logits"] = bool(torch.equal(kept, logits))
        out[f"{name}_logp_without_jacobian_equal"] = bool(torch.equal(lp, lm_head_triton.logprobs_(
            logits.clone(), t, True, block)))
        d = logits.clone()
        lp = lm_head_triton.logprobs_(d, t, True, block)
        out[f"{name}_logp_max_abs"] = float((lp - ref_lp).abs().max())
        diff = (d.float() - ref_d.float()).abs()
        out[f"{name}_d_max_abs"] = float(diff.max())
        out[f"{name}_d_equal_fraction"] = float((diff == 0).float().mean())
        out[f"{name}_target_column"] = float((d.float().gather(1, t[:, None]) - ref_d.float().gather(
            1, t[:, None])).abs().max())
        bad = t.clone()
        bad[3], bad[4] = vocab, -1
        lp = lm_head_triton.logprobs_(logits.clone(), bad, False, block)
        out[f"{name}_outside_is_nan"] = bool(lp[3:5].isnan().all() and lp[5:].isfinite().all())
    return out


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(_cases("cpu", 6, 1000, 256)))
    sys.exit(0)


def _check(report, logp_bound):
    for name, r in report.items():
        if isinstance(r, bool):
            assert r is True, (name, report)
        elif name.endswith("_logp_max_abs"):  # fp32 sums in another order: ~1 ulp of log(sum)
            assert r <= logp_bound, (name, r)
        elif name.endswith("_d_max_abs") or name.endswith("_target_column"):
            # softmax values < 1 differ by at most one rounding of the dtype (fp32: an ulp of exp(logp))
            assert r <= (2 ** -8 if name.startswith("bfloat16") else 1e-6), (name, r)
        elif name.endswith("_d_equal_fraction") and name.startswith("bfloat16"):  # fp32: an ulp apart is common
            assert r >= 0.99, (name, r)


def test_logprobs_kernel_under_the_interpreter_matches_torch(triton_version):
    _check(run_under_interpreter(__file__, triton=triton_version), 2e-6)


@pytest.mark.gpu
def test_logprobs_kernel_matches_torch_gpu():
    report = _cases("cuda", 1027, 200064, 4096)
    print(json.dumps(report))
    _check(report, 1e-5)  # |logp| up to ~25 here: a few fp32 ulps


@pytest.mark.gpu
def test_lm_head_logprobs_with_the_kernel_gpu(monkeypatch):
    """lm_head_logprobs at M3's width (hidden 6144, vocab 200,064), bf16, 2,500 rows (three chunks, the last short):
    the kernel's logprobs and input gradient against the torch chain's."""
    from rl.model import lean, lm_head_triton

    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2500, 6144, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(200064, 6144, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    t = torch.randint(0, 200064, (2500,), generator=gen).to("cuda")
    g = torch.randn(2500, generator=gen).to("cuda")

    def run():
        x = h.clone().requires_grad_()
        lp = lean.lm_head_logprobs(x, w, t)
        lp.backward(g)
        return lp.detach(), x.grad

    lp, gx = run()
    monkeypatch.setattr(lm_head_triton, "usable", lambda logits: False)
    ref_lp, ref_gx = run()
    report = {"logp_max_abs": float((lp - ref_lp).abs().max()),
              "grad_rel_norm": float((gx.float() - ref_gx.float()).norm() / ref_gx.float().norm()),
              "grad_equal_fraction": float((gx == ref_gx).float().mean())}
    print(json.dumps(report))
    assert report["logp_max_abs"] <= 1e-5, report
    assert report["grad_rel_norm"] <= 1e-3, report  # d rounded to bf16 the same way but for the sum's order
