"""rl.model.msa_block_outer (KV-block-outer MSA kernels) against the reference attention.

CPU: the kernels run under Triton's interpreter (tests/triton_interpreter.py) in fp32 with exact dots, so the bound is
fp32 rounding (1e-5 relative to the largest value). Cases cover packed sequences (one shorter than a block), the
dense prefix through SDPA and without it (then -1 padded slots reach the kernels), forced init blocks, lists split
into many work items (dK/dV summed over items), 64-key backward programs, atomic dQ, and G = 3 query heads per KV
head (padded tile rows).
GPU (`-m gpu`): bf16 at M3's shapes (64 q / 4 KV heads, d 128, top-16) at 4K, packed, 32K, with -1 padding and
forced blocks, through `rl.model.msa.sparse_attention` (the default path), each partial/dQ variant and each kernel
(Gluon and Triton, forward and backward); packed short sequences through varlen FlashAttention.
"""

import json
import sys

import pytest
import torch

from tests.triton_interpreter import run_under_interpreter


def _inputs(lengths, hq, hkv, dim, topk, init, local, seed, device="cpu", dtype=torch.float32, index_dim=64):
    from rl.model import msa

    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = sum(lengths)
    iq, ik = torch.randn(total, hkv, index_dim, generator=g), torch.randn(total, index_dim, generator=g)
    ids = msa.select_blocks(iq.to(device), ik.to(device), cu, topk, init, local)
    msa.validate_block_ids(ids, cu, num_heads=hkv, topk=topk, init_blocks=init, local_blocks=local)
    ids = ids.transpose(0, 1).contiguous().transpose(0, 1)  # strided as the CUDA selection returns them
    q, k, v = (torch.randn(total, h, dim, generator=g).to(device, dtype).requires_grad_() for h in (hq, hkv, hkv))
    go = torch.randn(total, hq, dim, generator=g).to(device, dtype)
    return cu, ids, q, k, v, go


def _case(lengths, hq, hkv, dim, topk, init=0, local=1, seed=0, **config):
    from rl.model import msa, msa_block_outer as mbo

    cu, ids, q, k, v, go = _inputs(lengths, hq, hkv, dim, topk, init, local, seed)
    cfg = mbo.Config(part_dtype="fp32", row_tile=256, **config)
    ref = msa.sparse_attention(q, k, v, ids, cu, impl="reference")
    out = mbo.sparse_attention(q, k, v, ids, cu, dim ** -0.5, cfg)
    grads = [torch.autograd.grad(o, (q, k, v), go) for o in (ref, out)]
    plan = mbo.build_plan(ids, cu, cfg)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    return {"out": rel(out, ref), **{f"d{n}": rel(b, a) for n, a, b in zip("qkv", *grads)},
            "items": int((plan.item_hi > plan.item_lo).sum()), "keys": plan.nkb * hkv,
            "dense_tokens": plan.dense_idx.numel(), "plan_mismatch": _plan_mismatch(ids, cu, cfg),
            "empty_kernel_slots": int((ids < 0).sum((1, 2)).index_fill(0, plan.dense_idx, 0).sum())}


def _plan_mismatch(ids, cu, cfg):
    """Names of the tables where a Triton-built plan (interpreter) differs from the torch-built one: items put in
    launch order by the plan kernel, and by torch.sort (as past KERNEL_SORT_MAX item rows)."""
    from rl.model import msa_block_plan as mbp
    from rl.model.packed import seq_bounds

    seq, kstart, kend, prefixes, nkb = mbp._host_tables(seq_bounds(cu), ids.shape[2], cfg.dense_prefix_min)
    seq_d = torch.tensor([x for row in seq for x in row], dtype=torch.int32)
    n_max = ids.shape[1] * nkb + -(-ids.numel() // cfg.item_tokens)
    names = ("slot_gid", "slot_pos", "entries", "item_key", "lo", "hi", "order", "key_item0")
    ref = mbp._plan_torch(ids, seq_d, len(seq), nkb, n_max, cfg)
    bad, sort_max = [], mbp.KERNEL_SORT_MAX
    try:
        for mbp.KERNEL_SORT_MAX in (sort_max, 0):
            pairs = zip(names, mbp._plan_triton(ids, seq_d, len(seq), nkb, n_max, cfg), ref)
            bad += [f"{n} (sort max {mbp.KERNEL_SORT_MAX})" for n, a, b in pairs
                    if a.dtype != b.dtype or not torch.equal(a, b)]
    finally:
        mbp.KERNEL_SORT_MAX = sort_max
    return bad


CASES = {  # name -> _case kwargs; tiny, as the interpreter runs every program in Python
    # topk 2: positions < 256 are the dense prefix; the 77-token sequence is dense throughout
    "packed_dense_prefix": dict(lengths=[300, 77, 260], hq=4, hkv=2, dim=16, topk=2, dense_prefix_min=1,
                                item_tokens=16, dkdv_cols=4),  # the dK/dV sum in 4 programs per key block
    "no_prefix_init_split": dict(lengths=[300, 100], hq=2, hkv=1, dim=16, topk=3, init=1, dense_prefix_min=0,
                                 item_tokens=16, fwd_rows=16, bwd_rows=8),
    "bwd_half_blocks": dict(lengths=[260], hq=2, hkv=1, dim=16, topk=2, dense_prefix_min=0, bwd_keys=64,
                            item_tokens=64, order="size"),
    "atomic_dq_g3": dict(lengths=[200, 60], hq=6, hkv=2, dim=16, topk=2, dense_prefix_min=0, dq="atomic",
                         fwd_rows=12, bwd_rows=12, order="key"),  # items launched in key order (no sort)
    # three kernel calls ([300], [77, 260], [290]), each with its own plan and dense prefix, in one autograd node;
    # the 77-token sequence's prefix is under dense_prefix_min, so the middle call's one prefix starts at its token 77
    "sequence_groups": dict(lengths=[300, 77, 260, 290], hq=4, hkv=2, dim=16, topk=2, dense_prefix_min=100,
                            item_tokens=16, group_tokens=340),
}

if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps({name: _case(**kw) for name, kw in CASES.items()}))
    sys.exit(0)


def test_block_outer_under_the_interpreter_matches_reference(triton_version):
    report = run_under_interpreter(__file__, triton=triton_version)
    print(json.dumps(report, indent=1))
    assert set(report) == set(CASES)
    for name, r in report.items():
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= 1e-5, (name, key, r)
        assert r["plan_mismatch"] == [], (name, r)
    # the cases reach what they are named for
    assert report["packed_dense_prefix"]["dense_tokens"] == 256 + 77 + 256
    assert report["sequence_groups"]["dense_tokens"] == 256 + 256 + 256  # (one plan over all: the same count)
    assert report["no_prefix_init_split"]["empty_kernel_slots"] > 0  # -1 padding inside the kernels
    assert report["no_prefix_init_split"]["items"] > 2 * report["no_prefix_init_split"]["keys"]  # lists split


def test_sequence_groups():
    from rl.model.packed import sequence_groups

    bounds = [(0, 300), (300, 377), (377, 637), (637, 637), (637, 927)]
    assert sequence_groups(bounds, 340) == [(0, 300), (300, 637), (637, 927)]
    assert sequence_groups(bounds, 0) == [(0, 927)]
    assert sequence_groups(bounds, 200) == [(0, 300), (300, 377), (377, 637), (637, 927)]


def test_config_rejects_unknown_choices():
    from rl.model import msa_block_outer as mbo

    for bad in (dict(bwd_kernel="glu0n"), dict(fwd_kernel="cuda"), dict(dq="atomics"), dict(order="lpt"),
                dict(part_dtype="fp16"), dict(bwd_keys=96), dict(dq_store="smem"), dict(dkdv_cols=24),
                dict(bwd_loops="two")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            mbo.Config(**bad)


def test_gluon_kernels_resolve_per_device():
    """'auto' falls back to the Triton kernels off Hopper (here: CPU tensors); an explicit 'gluon' request that cannot
    run fails up front, naming the field."""
    from rl.model import msa_block_outer as mbo

    q, k = torch.zeros(8, 4, 128, dtype=torch.bfloat16), torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    resolved = mbo._kernels(q, k, mbo.Config())
    assert (resolved.fwd_kernel, resolved.bwd_kernel) == ("triton", "triton")
    for name, value in (("fwd_kernel", "gluon"), ("fwd_kernel", "gluon_ws"), ("bwd_kernel", "gluon"),
                        ("bwd_kernel", "gluon_ws")):
        with pytest.raises(ValueError, match=f"Config.{name}='{value}' needs"):
            mbo._kernels(q, k, mbo.Config(**{name: value}))


def test_warp_specialized_kernels_take_only_the_tiles_they_fit():
    """ws_fits decides 'auto' on Hopper: whole-token tiles, TMA boxes of G rows only for G a multiple of 8 (the
    tiny model's G=2 fell over in the compiler, results/gpu/run47), partials in the operand type."""
    from rl.model import msa_block_outer as mbo

    assert mbo.ws_fits(mbo.Config(), 16) == {"fwd_kernel": True, "bwd_kernel": True, "dq_tma": True}  # M3
    assert mbo.ws_fits(mbo.Config(), 2) == {"fwd_kernel": False, "bwd_kernel": True, "dq_tma": False}
    assert mbo.ws_fits(mbo.Config(), 3) == {"fwd_kernel": False, "bwd_kernel": False, "dq_tma": False}
    assert mbo.ws_fits(mbo.Config(part_dtype="fp32"), 16) == {"fwd_kernel": False, "bwd_kernel": True,
                                                              "dq_tma": False}
    assert not mbo.ws_fits(mbo.Config(fwd_rows=128), 16)["fwd_kernel"]
    assert not mbo.ws_fits(mbo.Config(bwd_rows=16), 16)["bwd_kernel"]  # one token per tile: no whole-token halves
    assert not mbo.ws_fits(mbo.Config(dq_store="registers"), 16)["dq_tma"]


def test_backward_loops_follow_the_dq_store_and_triton_unless_asked(monkeypatch):
    """'auto' keeps each dQ store's measured form under Triton 3.6/3.7 (TMA: the causal tiles split off; registers:
    every tile masked) and masks every tile under 3.8+ (the split form spills there, run126); an explicit choice is
    kept (bench_msa --config bwd_loops=... times the other forms)."""
    from rl.model import msa_block_outer as mbo

    for version in ((3, 6), (3, 7)):
        assert mbo.bwd_loops("auto", "tma", version) == "split"
        assert mbo.bwd_loops("auto", "registers", version) == "masked"
    for version in ((3, 8), (3, 9), (4, 0)):
        assert [mbo.bwd_loops("auto", store, version) for store in ("tma", "registers")] == ["masked", "masked"]
    # without a version: the importable Triton's (its probe answering 3.6, then 3.8)
    for probed, form in (((3, 6), "split"), ((3, 8), "masked")):
        monkeypatch.setattr(mbo, "triton_version", lambda: probed)
        assert mbo.bwd_loops("auto", "tma") == form
    for store in ("tma", "registers"):
        for version in ((3, 6), (3, 8)):
            assert [mbo.bwd_loops(asked, store, version) for asked in ("split", "masked")] == ["split", "masked"]


def test_plan_groups_every_selection_once():
    """CPU, no Triton: the inverted lists hold each (sparse token, head, slot) selection exactly once."""
    from rl.model import msa_block_outer as mbo

    cu, ids, *_ = _inputs([700, 300], 4, 2, 16, 3, 1, 1, seed=3)
    plan = mbo.build_plan(ids, cu, mbo.Config(item_tokens=16, dense_prefix_min=128))
    t_count, hkv, topk = ids.shape
    ent = torch.cat([plan.entries[lo:hi] for lo, hi in zip(plan.item_lo.tolist(), plan.item_hi.tolist())]).long()
    assert sorted(ent.tolist()) == (plan.slot_gid.view(-1) >= 0).nonzero().squeeze(1).tolist()
    key = plan.item_key.long().repeat_interleave((plan.item_hi - plan.item_lo).long())
    assert torch.equal(key, (ent // topk) % hkv * plan.nkb + plan.slot_gid.view(-1)[ent].long())
    pos = plan.slot_pos.reshape(-1).long()  # sorted position of each kernel slot (its partials' rows), -1 as gid
    assert torch.equal(pos >= 0, plan.slot_gid.reshape(-1) >= 0)
    assert torch.equal(plan.entries[pos[pos >= 0]].long(), (pos >= 0).nonzero().squeeze(1))
    assert (plan.item_hi - plan.item_lo).max() <= 16
    assert plan.dense_idx.tolist() == list(range(384)) + list(range(700, 700 + 300))
    n_items = int(plan.key_item0[-1])
    assert n_items == int((plan.item_hi > plan.item_lo).sum()) <= plan.n_max == plan.item_key.numel()
    assert (plan.item_hi[n_items:] == plan.item_lo[n_items:]).all()  # the rest: empty rows (host-known grid)
    for order in ("size", "token", "key"):  # launch orders are permutations of the rows, the real items first
        cfg = mbo.Config(item_tokens=16, dense_prefix_min=128, order=order)
        launched = mbo.build_plan(ids, cu, cfg).order.tolist()
        assert sorted(launched) == list(range(plan.n_max)) and sorted(launched[:n_items]) == list(range(n_items))
        assert (launched == list(range(plan.n_max))) == (order == "key")  # only "key" keeps the tables' order


def test_short_sequences_are_causal_sdpa():
    """CPU, no Triton: a batch whose sequences all fit in topk blocks is dense causal attention (SDPA per sequence);
    an empty sequence in the batch is skipped."""
    from rl.model import msa, msa_block_outer as mbo

    cu, ids, q, k, v, go = _inputs([250, 0, 256, 77], 4, 2, 16, 2, 0, 1, seed=4)
    ref = msa.sparse_attention(q, k, v, ids, cu, impl="reference")
    out = mbo.sparse_attention(q, k, v, ids, cu, 16 ** -0.5)
    assert float((out - ref).detach().abs().max() / ref.detach().abs().max()) <= 1e-5
    for a, b in zip(torch.autograd.grad(ref, (q, k, v), go), torch.autograd.grad(out, (q, k, v), go)):
        assert float((a - b).abs().max() / a.abs().max()) <= 1e-5


# --- GPU ---------------------------------------------------------------------------------------------------------

def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max()), float((a - b).norm() / b.norm())


GPU_CASES = {  # id -> (lengths, init blocks, config overrides); {} = the default dispatch (rl.model.msa, impl auto)
    "4k": ([4096], 0, {}),
    "packed_padding": ([1000, 3000, 96, 2100], 0, {}),  # sequences < 2048 tokens: -1 padded slots
    "32k": ([32768], 0, {}),
    "dense_prefix_sdpa": ([4096, 1500, 2600], 0, {"dense_prefix_min": 1024}),
    "sequence_groups": ([3000, 5000, 2600, 4100], 0, {"group_tokens": 8000, "dense_prefix_min": 1024}),
    "all_short_sdpa": ([1000, 2048, 300, 744], 0, {}),  # every sequence <= 2048 tokens: SDPA per sequence
    "forced_init": ([6000, 2500], 2, {}),
    "fp32_parts_atomic_dq": ([5000], 1, {"part_dtype": "fp32", "dq": "atomic"}),
    "triton_backward": ([4096, 3000], 1, {"bwd_kernel": "triton"}),  # the default on sm_90 is the Gluon kernel
    "triton_forward": ([1000, 3000, 96, 2100], 1, {"fwd_kernel": "triton"}),  # the default: warp-specialized Gluon
    "gluon_forward_padding": ([1000, 3000, 96, 2100], 2, {"fwd_kernel": "gluon"}),  # -1 slots, forced init blocks
    "gluon_forward_32k": ([32768], 0, {"fwd_kernel": "gluon"}),
    "gluon_forward_128rows": ([5000, 700], 1, {"fwd_kernel": "gluon", "fwd_rows": 128}),
    # the default backward on sm_90 is the warp-specialized Gluon kernel storing dQ by TMA; its other forms:
    "gluon_backward_padding": ([1000, 3000, 96, 2100], 2, {"bwd_kernel": "gluon"}),  # -1 slots, forced init
    "gluon_backward_32k": ([32768], 0, {"bwd_kernel": "gluon"}),
    "ws_dq_from_registers": ([1000, 3000, 96, 2100], 2, {"dq_store": "registers"}),
    # the loop forms that are not the default for their dQ store (Config.bwd_loops)
    "ws_every_tile_masked": ([1000, 3000, 96, 2100], 2, {"bwd_loops": "masked"}),
    "ws_dq_from_registers_split": ([1000, 3000, 96, 2100], 2, {"dq_store": "registers", "bwd_loops": "split"}),
    "ws_3_stages": ([5000, 700], 1, {"bwd_stages": 3}),
    "ws_fp32_dq_parts": ([5000], 1, {"part_dtype": "fp32"}),  # dQ partials not in the operand type: no TMA
    "gluon_ws_forward_padding": ([1000, 3000, 96, 2100], 2, {"fwd_kernel": "gluon_ws"}),  # the default forward
    "half_blocks_size_order": ([5000], 0, {"bwd_keys": 64, "bwd_warps": 4, "order": "size", "fwd_rows": 128,
                                           "fwd_warps": 8}),
    "key_order": ([1000, 3000, 96, 2100], 1, {"order": "key"}),  # the default kernels, items in key order
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_block_outer_matches_reference_gpu(case):
    """Bounds as for the per-token kernels and FlexAttention in bf16: 2^-6 relative max, 5e-3 relative norm."""
    from rl.model import msa, msa_block_outer as mbo

    lengths, init, overrides = GPU_CASES[case]
    cu, ids, q, k, v, go = _inputs(lengths, 64, 4, 128, 16, init, 1, seed=11, device="cuda", dtype=torch.bfloat16,
                                   index_dim=128)
    ref = msa.sparse_attention(q, k, v, ids, cu, impl="reference")
    if overrides:
        out = mbo.sparse_attention(q, k, v, ids, cu, 128 ** -0.5, mbo.Config(**overrides))
    else:  # the default dispatch
        out = msa.sparse_attention(q, k, v, ids, cu)
    res = [(ref, out)] + list(zip(torch.autograd.grad(ref, (q, k, v), go), torch.autograd.grad(out, (q, k, v), go)))
    lines = []
    for name, (a, b) in zip(("out", "dq", "dk", "dv"), res):
        rel_max, rel_norm = _rel(b, a)
        assert torch.isfinite(b).all(), (case, name)
        lines.append((name, rel_max, rel_norm))
    print(case, lines)
    for name, rel_max, rel_norm in lines:
        assert rel_max <= 2 ** -6 and rel_norm <= 5e-3, (case, name, rel_max, rel_norm)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[4096], [1000, 3000, 96, 2100]])
def test_plan_from_cuda_graph_matches_launches_gpu(lengths):
    """A short call's plan: launched on a batch layout's first call, launched and captured on its second, replayed
    from its third. Each call's tables equal the launches' on its own ids, and a plan kept from an earlier call is not
    changed by later replays (the graph's output buffer is cloned out). The graph is made under inference mode (an
    evaluation) and replayed outside it (training)."""
    from rl.model import msa_block_plan as mbp
    from rl.model.packed import seq_bounds

    mbp._GRAPHS.clear()
    names = ("slot_gid", "slot_pos", "entries", "item_key", "lo", "hi", "order", "key_item0")
    plans, want = [], []
    for seed in range(5):
        cu, ids, *_ = _inputs(lengths, 4, 4, 16, 16, 0, 1, seed=20 + seed, device="cuda", index_dim=128)
        with torch.inference_mode(seed < 2):
            plans.append(mbp.build_plan(ids, cu))
        seq, _, _, _, nkb = mbp._host_tables(seq_bounds(cu), 16, 0)
        seq_d = torch.tensor([x for row in seq for x in row], dtype=torch.int32, device="cuda")
        want.append(mbp._plan_triton(ids, seq_d, len(seq), nkb, plans[-1].n_max, mbp.DEFAULT))
    graphs = [g for g in mbp._GRAPHS.values() if g is not None]
    assert len(graphs) == 1 and isinstance(graphs[0], mbp._PlanGraph)  # the layout's calls 3-5 were replays
    for i, (plan, tables) in enumerate(zip(plans, want)):
        for name, got, ref in zip(names, (plan.slot_gid, plan.slot_pos, plan.entries, plan.item_key, plan.item_lo,
                                          plan.item_hi, plan.order, plan.key_item0), tables):
            assert got.dtype == ref.dtype and torch.equal(got, ref), (lengths, i, name)
    assert not torch.equal(plans[2].entries, plans[4].entries)  # the calls' ids differ: an alias would show


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 4, 128), (4, 2, 16)])
def test_packed_short_sequences_take_varlen_flash_gpu(shape):
    """A packed batch of sequences that fit in topk blocks (one empty) is one varlen FlashAttention call each way
    (torch.nn.attention.varlen on this torch: M3's 16 and the tiny model's 2 query heads per KV head): output and
    q/k/v gradients against the fp32 reference and against SDPA per sequence within the bf16 bounds."""
    import torch.nn.functional as F

    from rl.model import msa, msa_dense

    hq, hkv, dim = shape
    assert msa_dense._varlen(torch.device("cuda"), torch.bfloat16, dim) is not None  # the path under test runs here
    lengths = [1000, 0, 2048, 300, 744, 1500]
    assert msa_dense.prefers_varlen([n for n in lengths if n])
    cu, ids, q, k, v, go = _inputs(lengths, hq, hkv, dim, 16, 0, 1, seed=12, device="cuda", dtype=torch.bfloat16,
                                   index_dim=64)
    out = msa.sparse_attention(q, k, v, ids, cu)  # the default dispatch
    ref = msa.sparse_attention(q, k, v, ids, cu, impl="reference")
    per_seq = torch.cat([F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)),
                                                        is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                         for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()) if e > s])
    got = [out, *torch.autograd.grad(out, (q, k, v), go)]
    # SDPA may run another bf16 kernel (cuDNN's on the H200): the same bounds as against the fp32 reference
    for want in ([x, *torch.autograd.grad(x, (q, k, v), go)] for x in (ref, per_seq)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), want, got):
            rel_max, rel_norm = _rel(b, a)
            assert torch.isfinite(b).all() and rel_max <= 2 ** -6 and rel_norm <= 5e-3, (shape, name, rel_max, rel_norm)
