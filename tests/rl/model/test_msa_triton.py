"""rl.model.msa_triton (the per-token block-sparse MSA kernels) against the reference attention.

CPU: the kernels run under Triton's interpreter (TRITON_INTERPRET=1) in a subprocess that puts a Triton install made
by scripts/install/setup_env.sh on its path, each supported one (tests/triton_interpreter.py); fp32, exact math, so
the bounds are fp32 rounding. In `make test`: the index-score kernel's block selection (the default on CUDA). `slow`: the
per-token attention kernels (not the default: CUDA bf16 runs rl.model.msa_block_outer; ~55 s under the interpreter)
on packed sequences whose token groups straddle a sequence boundary, 1 and 2 tokens per group, popular blocks split
over several dK/dV programs (atomic adds).
GPU (`-m gpu`): bf16 at 4K, packed and 32K tokens with M3's 64 q / 4 KV heads, through `msa.sparse_attention`.
"""

import json
import sys

import pytest
import torch

from tests.triton_interpreter import run_under_interpreter


def _case(lengths, hq, hkv, dim, topk, tokens_per_group, chunk_groups=None, seed=0):
    from rl.model import msa, msa_triton

    if chunk_groups is not None:
        msa_triton.CHUNK_GROUPS = chunk_groups
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = sum(lengths)
    ids = msa.select_blocks(torch.randn(total, hkv, 64, generator=g), torch.randn(total, 64, generator=g), cu, topk,
                            0, 1)
    q, k, v = (torch.randn(total, h, dim, generator=g).requires_grad_() for h in (hq, hkv, hkv))
    go = torch.randn(total, hq, dim, generator=g)
    ref = msa.sparse_attention(q, k, v, ids, cu, impl="reference")
    out = msa_triton.sparse_attention(q, k, v, ids, cu, dim ** -0.5, tokens_per_group=tokens_per_group)
    grads = [torch.autograd.grad(o, (q, k, v), go) for o in (ref, out)]
    plan = msa_triton.build_plan(ids, cu, tokens_per_group)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    return {"out": rel(out, ref), **{f"d{n}": rel(b, a) for n, a, b in zip("qkv", *grads)},
            "programs_dkdv": plan.chunk_kb.numel(), "key_blocks": plan.kstart.numel() * hkv}


def _selection(lengths, heads, dim, topk, init_blocks, local_blocks, seed=1):
    from rl.model import msa

    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    iq, ik = torch.randn(sum(lengths), heads, dim, generator=g), torch.randn(sum(lengths), dim, generator=g)
    ref = msa.select_blocks(iq, ik, cu, topk, init_blocks, local_blocks, impl="reference")
    got = msa.select_blocks(iq, ik, cu, topk, init_blocks, local_blocks, impl="triton")
    given = msa.select_blocks(iq, ik, cu, topk, init_blocks, local_blocks, impl="triton",
                              positions=msa.token_positions(cu))  # the trainer's layers hand their positions in
    return {"agreement": msa.selection_agreement(ref, got), "same_shape": list(ref.shape) == list(got.shape),
            "positions_given_equal": bool(torch.equal(given, got))}


CASES = {  # name -> _case kwargs
    "packed_tt2": dict(lengths=[300, 200], hq=4, hkv=2, dim=32, topk=2, tokens_per_group=2),
    "tt1": dict(lengths=[260], hq=2, hkv=1, dim=16, topk=2, tokens_per_group=1),
    "split_chunks": dict(lengths=[400], hq=2, hkv=1, dim=16, topk=3, tokens_per_group=4, chunk_groups=8),
}

if __name__ == "__main__":  # the interpreter subprocess: `python FILE selection|attention`
    if sys.argv[1] == "selection":
        report = _selection([300, 520, 90], heads=2, dim=32, topk=3, init_blocks=1, local_blocks=1)
    else:
        report = {name: _case(**kw) for name, kw in CASES.items()}
    print(json.dumps(report))
    sys.exit(0)


def test_selection_kernel_under_the_interpreter_matches_reference(triton_version):
    # Index scores of bf16 values summed in fp32 (exactly, under the interpreter): the same blocks everywhere.
    report = run_under_interpreter(__file__, "selection", triton=triton_version)
    assert report == {"agreement": 1.0, "same_shape": True, "positions_given_equal": True}


@pytest.mark.slow
def test_attention_kernels_under_the_interpreter_match_reference(triton_version):
    report = run_under_interpreter(__file__, "attention", triton=triton_version)
    print(json.dumps(report, indent=1))
    assert set(report) == set(CASES)
    for name, r in report.items():
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= 1e-5, (name, key, r)
    assert report["split_chunks"]["programs_dkdv"] > report["split_chunks"]["key_blocks"]  # lists were split


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16"])  # fp32: exact under the CPU interpreter above; on CUDA msa uses flex
@pytest.mark.parametrize("lengths", [[4096], [1000, 3000, 96], [32768]], ids=["4k", "packed", "32k"])
def test_triton_matches_reference_gpu(lengths, dtype):
    """Same bound as FlexAttention's bf16 test (tests/rl/model/test_msa.py): 2^-6 relative max, 5e-3 relative norm; both
    round probabilities to bf16 before P@V."""
    from rl.model import msa

    dt = {"bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(5)
    total, hq, hkv, dim = sum(lengths), 64, 4, 128
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = msa.select_blocks(torch.randn(total, hkv, 128, generator=g).cuda(), torch.randn(total, 128, generator=g).cuda(),
                            cu, 16, 0, 1)
    q, k, v = (torch.randn(total, h, dim, generator=g).cuda().to(dt).requires_grad_() for h in (hq, hkv, hkv))
    go = torch.randn(total, hq, dim, generator=g).cuda().to(dt)
    res = {}
    for impl in ("reference", "triton"):
        out = msa.sparse_attention(q, k, v, ids, cu, impl=impl, validate=False)
        res[impl] = (out, *torch.autograd.grad(out, (q, k, v), go))
    bound, norm_bound = 2 ** -6, 5e-3
    for name, a, b in zip(("out", "dq", "dk", "dv"), res["reference"], res["triton"]):
        a, b = a.float(), b.float()
        rel_max = float((a - b).abs().max() / a.abs().max())
        rel_norm = float((a - b).norm() / a.norm())
        assert rel_max <= bound and rel_norm <= norm_bound, (name, rel_max, rel_norm)


@pytest.mark.gpu
def test_triton_selection_agrees_gpu():
    """The index-score kernel sums in another order than the reference: only near-tied blocks may swap."""
    from rl.model import msa

    g = torch.Generator().manual_seed(9)
    lengths = [32768, 5000, 300]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    iq = torch.randn(sum(lengths), 4, 128, generator=g).cuda()
    ik = torch.randn(sum(lengths), 128, generator=g).cuda()
    ref = msa.select_blocks(iq, ik, cu, 16, 0, 1, impl="reference")
    got = msa.select_blocks(iq, ik, cu, 16, 0, 1)  # auto: triton on CUDA
    msa.validate_block_ids(got, cu, topk=16, init_blocks=0, local_blocks=1)
    assert msa.selection_agreement(ref, got) >= 0.999
