"""MSA block-sparse attention as Triton kernels: forward and backward with true per-token block selection.

Same contract as `rl.model.msa.sparse_attention` (q [T, Hq, D], k/v [T, Hkv, D], block_ids [T, Hkv, topk] per-sequence
128-token blocks, -1 = empty, causal inside the sequence). FlexAttention needs one key-tile list per 128-query tile,
i.e. the union of 128 queries' selections, which approaches the whole prefix when neighbouring queries disagree
(results/gpu/bench_msa.json: 118 of 128 visible tiles at 32K). Here the unit of work is a *group* of TT consecutive
tokens of one KV head, all its G = Hq/Hkv query heads as the rows of one tile (TT * G rows; 1 * 16 = 16 for M3): the
group visits only the union of its TT tokens' blocks, and a row masks the keys of blocks its token did not select.

Kernels (fp32 accumulation, bf16 operands, probabilities rounded to bf16 before P@V and dS before dS@K/dS^T@Q, as
flash attention and FlexAttention do):
- forward, per (group, KV head): online softmax over the union blocks; writes O and the row log-sum-exp;
- dQ, per (group, KV head): the same walk, dQ = scale * sum dS K with dS = P * (dO V^T - delta);
- dK/dV, per (key block, KV head, chunk of the groups that visit it): the groups are listed by a sort on the host
  (CSR), so a block's dK/dV sums all its queries in registers; lists longer than CHUNK_GROUPS (popular blocks)
  are split over programs that add into fp32 buffers atomically.
Key blocks are numbered globally (sequence by sequence), so packed sequences need no padding.

Index scores (`select_blocks`): per 64 queries of one sequence and index head, the max over each visible 128-key
block of <q, k> (bf16 operands, fp32 sums); the forced blocks and the top-k are rl.model.msa's, shared with the
reference.

Measured on one H200 (results/gpu/run9, run10; 64 q / 4 KV heads, d 128, top-16, bf16): forward + backward
99 ms at 32K tokens (dense causal SDPA 113 ms, FlexAttention 588 ms), 196 ms at 64K (SDPA 444 ms); index scores +
top-k 5.6 ms at 32K (the torch reference 32 ms). Far from the selected-keys floor (~11 ms at 32K): 16-row tiles
run well below the GPU's MMA rate, and the backward recomputes P and dP in both of its kernels.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1; tests only). On CUDA the trainer's attention
default is now rl.msa_block_outer (2.5-3.5x faster at 4K-64K, results/gpu/run12d); these stay as impl="triton".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from m3.ops import MSA_BLOCK as BLOCK  # one key tile
from rl.model.packed import seq_bounds, to_device

CHUNK_GROUPS = 256  # dK/dV: groups per program before a block's list is split (atomic adds)


def available(device: torch.device) -> bool:
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class Plan:
    """Host-built index tables for one (block_ids, cu_seqlens, tokens_per_group)."""

    gids: torch.Tensor  # [T, Hkv, topk] int32: global key-block id of each selection, -1 empty
    kstart: torch.Tensor  # [NKB] int32: packed index of each global key block's first key
    union: torch.Tensor  # [NG, Hkv, U] int32: sorted distinct global blocks of each group, -1 padded
    count: torch.Tensor  # [NG, Hkv] int32: entries of `union` in use
    chunk_kb: torch.Tensor  # [NC] int32: key block of each dK/dV program
    chunk_h: torch.Tensor  # [NC] int32: its KV head
    chunk_lo: torch.Tensor  # [NC] int32: its range in `visit_groups`
    chunk_hi: torch.Tensor
    visit_groups: torch.Tensor  # [entries] int32: groups visiting each (head, key block), grouped by it
    tokens_per_group: int


def build_plan(block_ids: torch.Tensor, cu_seqlens, tokens_per_group: int) -> Plan:
    device = block_ids.device
    t_count, hkv, topk = block_ids.shape
    cu = torch.as_tensor(cu_seqlens, device=device).long()
    lens = cu[1:] - cu[:-1]
    nblk = (lens + BLOCK - 1) // BLOCK
    base = torch.cumsum(nblk, 0) - nblk  # first global block of each sequence
    nkb = int(nblk.sum())
    seq_of_token = torch.repeat_interleave(torch.arange(len(lens), device=device), lens, output_size=t_count)
    ids = block_ids.long()
    gids = torch.where(ids >= 0, ids + base[seq_of_token][:, None, None], -1)
    seq_of_kb = torch.repeat_interleave(torch.arange(len(lens), device=device), nblk, output_size=nkb)
    kstart = cu[seq_of_kb] + BLOCK * (torch.arange(nkb, device=device) - base[seq_of_kb])

    tt = tokens_per_group
    ng = -(-t_count // tt)
    padded = torch.full((ng * tt, hkv, topk), -1, dtype=torch.long, device=device)
    padded[:t_count] = gids
    cand = padded.view(ng, tt, hkv, topk).permute(0, 2, 1, 3).reshape(ng, hkv, tt * topk)
    big = nkb + 1
    cand = torch.where(cand >= 0, cand, big).sort(-1).values
    dup = torch.zeros_like(cand, dtype=torch.bool)
    dup[..., 1:] = cand[..., 1:] == cand[..., :-1]
    cand = torch.where(dup, big, cand).sort(-1).values
    count = (cand < big).sum(-1)
    width = max(int(count.max()) if count.numel() else 0, 1)
    union = torch.where(cand[..., :width] < big, cand[..., :width], -1)

    # dK/dV lists: for each (head, key block), the groups whose union holds it
    g_idx, h_idx, slot = (union >= 0).nonzero(as_tuple=True)
    key = h_idx * nkb + union[g_idx, h_idx, slot]
    order = torch.sort(key, stable=True).indices
    visit_groups = g_idx[order].to(torch.int32)
    per_key = torch.bincount(key, minlength=hkv * nkb)
    ends = torch.cumsum(per_key, 0)
    starts = ends - per_key
    nchunks = (per_key + CHUNK_GROUPS - 1) // CHUNK_GROUPS
    key_of_chunk = torch.repeat_interleave(torch.arange(hkv * nkb, device=device), nchunks)
    first_chunk = torch.cumsum(nchunks, 0) - nchunks
    j = torch.arange(len(key_of_chunk), device=device) - first_chunk[key_of_chunk]
    lo = starts[key_of_chunk] + j * CHUNK_GROUPS
    hi = torch.minimum(lo + CHUNK_GROUPS, ends[key_of_chunk])
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    return Plan(i32(gids), i32(kstart), i32(union), i32(count), i32(key_of_chunk % nkb), i32(key_of_chunk // nkb),
                i32(lo), i32(hi), visit_groups.contiguous(), tt)


try:  # the jit functions live at module level: Triton's interpreter resolves callees from module globals
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: only the reference paths
    triton = None

if triton is not None:
    @triton.jit
    def _rows(g, h, T, G: tl.constexpr, TT: tl.constexpr, BM: tl.constexpr, HQ: tl.constexpr):
        # Tile row r: token g*TT + r//G, query head h*G + r%G (rows past TT*G or T are padding).
        r = tl.arange(0, BM)
        tok = g * TT + r // G
        ok = (r < TT * G) & (tok < T)
        tok = tl.where(ok, tok, 0)
        head = h * G + r % G
        return tok, head, ok

    @triton.jit
    def _member(gids_ptr, tok, ok, h, kb, HKV: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr):
        # [BM] bool: the row's token selected global key block kb.
        j = tl.arange(0, TOPK_P2)
        sel = tl.load(gids_ptr + (tok[:, None] * HKV + h) * TOPK + j[None, :],
                      mask=ok[:, None] & (j[None, :] < TOPK), other=-1)
        return tl.sum((sel == kb).to(tl.int32), 1) > 0

    @triton.jit
    def _kv_tile(k_ptr, v_ptr, kstart_ptr, kb, h, T, HKV: tl.constexpr, D: tl.constexpr):
        # Keys and values of global key block kb, KV head h: (packed key indices [128], K [128, D], V [128, D]).
        d = tl.arange(0, D)
        kidx = tl.load(kstart_ptr + kb) + tl.arange(0, 128)
        kv_ok = kidx < T
        rows = (kidx[:, None] * HKV + h) * D + d[None, :]
        kt = tl.load(k_ptr + rows, mask=kv_ok[:, None], other=0.0)
        vt = tl.load(v_ptr + rows, mask=kv_ok[:, None], other=0.0)
        return kidx, kt, vt

    @triton.jit
    def _row_tiles(q_ptr, do_ptr, lse_ptr, delta_ptr, tok, head, ok, HQ: tl.constexpr, D: tl.constexpr):
        # The tile rows' q, dO [BM, D], log-sum-exp and delta [BM], and their element offsets.
        rows = (tok[:, None] * HQ + head[:, None]) * D + tl.arange(0, D)[None, :]
        q = tl.load(q_ptr + rows, mask=ok[:, None], other=0.0)
        do = tl.load(do_ptr + rows, mask=ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + tok * HQ + head, mask=ok, other=float("inf"))
        delta = tl.load(delta_ptr + tok * HQ + head, mask=ok, other=0.0)
        return q, do, lse, delta, rows

    @triton.jit
    def _probs_ds(q, do, kt, vt, kidx, tok, member, lse, delta, scale, PREC: tl.constexpr):
        # Backward of one tile: P = exp(S - lse) on the selected causal keys, dS = P * (dO V^T - delta).
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * scale
        valid = member[:, None] & (kidx[None, :] <= tok[:, None])
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(vt), input_precision=PREC)
        return p, p * (dp - delta[:, None])

    @triton.jit
    def _fwd(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, gids_ptr, kstart_ptr, union_ptr, count_ptr, T, U, scale,
             HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, TT: tl.constexpr, BM: tl.constexpr,
             D: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, PREC: tl.constexpr):
        g = tl.program_id(0)
        h = tl.program_id(1)
        tok, head, ok = _rows(g, h, T, G, TT, BM, HQ)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (tok[:, None] * HQ + head[:, None]) * D + d[None, :], mask=ok[:, None], other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        cnt = tl.load(count_ptr + g * HKV + h)
        for i in range(0, cnt):
            kb = tl.load(union_ptr + (g * HKV + h) * U + i)
            kidx, kt, vt = _kv_tile(k_ptr, v_ptr, kstart_ptr, kb, h, T, HKV, D)
            member = _member(gids_ptr, tok, ok, h, kb, HKV, TOPK, TOPK_P2)
            s = tl.dot(q, tl.trans(kt), input_precision=PREC) * scale
            valid = member[:, None] & (kidx[None, :] <= tok[:, None])
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
            m_i = m_new
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        tl.store(o_ptr + (tok[:, None] * HQ + head[:, None]) * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=ok[:, None])
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("inf"))  # inf: p = 0 in backward
        tl.store(lse_ptr + tok * HQ + head, lse, mask=ok)

    @triton.jit
    def _dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, gids_ptr, kstart_ptr, union_ptr, count_ptr,
            T, U, scale, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, TT: tl.constexpr, BM: tl.constexpr,
            D: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, PREC: tl.constexpr):
        g = tl.program_id(0)
        h = tl.program_id(1)
        tok, head, ok = _rows(g, h, T, G, TT, BM, HQ)
        q, do, lse, delta, rows = _row_tiles(q_ptr, do_ptr, lse_ptr, delta_ptr, tok, head, ok, HQ, D)
        dq = tl.zeros([BM, D], tl.float32)
        cnt = tl.load(count_ptr + g * HKV + h)
        for i in range(0, cnt):
            kb = tl.load(union_ptr + (g * HKV + h) * U + i)
            kidx, kt, vt = _kv_tile(k_ptr, v_ptr, kstart_ptr, kb, h, T, HKV, D)
            member = _member(gids_ptr, tok, ok, h, kb, HKV, TOPK, TOPK_P2)
            p, ds = _probs_ds(q, do, kt, vt, kidx, tok, member, lse, delta, scale, PREC)
            dq = tl.dot(ds.to(kt.dtype), kt, dq, input_precision=PREC)
        tl.store(dq_ptr + rows, (dq * scale).to(dq_ptr.dtype.element_ty), mask=ok[:, None])

    @triton.jit
    def _dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, gids_ptr, kstart_ptr,
              chunk_kb_ptr, chunk_h_ptr, chunk_lo_ptr, chunk_hi_ptr, visit_ptr, T, scale,
              HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, TT: tl.constexpr, BM: tl.constexpr,
              D: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, PREC: tl.constexpr):
        c = tl.program_id(0)
        kb = tl.load(chunk_kb_ptr + c)
        h = tl.load(chunk_h_ptr + c)
        lo = tl.load(chunk_lo_ptr + c)
        hi = tl.load(chunk_hi_ptr + c)
        d = tl.arange(0, D)
        kidx, kt, vt = _kv_tile(k_ptr, v_ptr, kstart_ptr, kb, h, T, HKV, D)
        kv_ok = kidx < T
        kv_rows = (kidx[:, None] * HKV + h) * D + d[None, :]
        dk = tl.zeros([128, D], tl.float32)
        dv = tl.zeros([128, D], tl.float32)
        for e in range(lo, hi):
            g = tl.load(visit_ptr + e)
            tok, head, ok = _rows(g, h, T, G, TT, BM, HQ)
            q, do, lse, delta, rows = _row_tiles(q_ptr, do_ptr, lse_ptr, delta_ptr, tok, head, ok, HQ, D)
            member = _member(gids_ptr, tok, ok, h, kb, HKV, TOPK, TOPK_P2)
            p, ds = _probs_ds(q, do, kt, vt, kidx, tok, member, lse, delta, scale, PREC)
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PREC)
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PREC)
        tl.atomic_add(dk_ptr + kv_rows, dk * scale, mask=kv_ok[:, None])
        tl.atomic_add(dv_ptr + kv_rows, dv, mask=kv_ok[:, None])

    @triton.jit
    def _block_scores(q_ptr, k_ptr, out_ptr, tile_q0_ptr, tile_q1_ptr, tile_s0_ptr, NB,
                      HI: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, PREC: tl.constexpr):
        # Index scores of BQ queries (one sequence) and index head h: max over each visible block's keys of <q, k>.
        t = tl.program_id(0)
        h = tl.program_id(1)
        q0 = tl.load(tile_q0_ptr + t)
        q1 = tl.load(tile_q1_ptr + t)
        s0 = tl.load(tile_s0_ptr + t)
        rows = q0 + tl.arange(0, BQ)
        ok = rows < q1
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (rows[:, None] * HI + h) * D + d[None, :], mask=ok[:, None], other=0.0)
        for b in range(0, (q1 - 1 - s0) // 128 + 1):
            kidx = s0 + b * 128 + tl.arange(0, 128)
            kt = tl.load(k_ptr + kidx[:, None] * D + d[None, :], mask=(kidx < q1)[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(kt), input_precision=PREC)
            sc = tl.where(kidx[None, :] <= rows[:, None], sc, float("-inf"))
            tl.store(out_ptr + (rows * HI + h) * NB + b, tl.max(sc, 1), mask=ok)


def index_block_scores(index_q: torch.Tensor, index_k: torch.Tensor, cu_seqlens,
                       queries_per_tile: int = 64) -> torch.Tensor:
    """The block scores `rl.model.msa.select_blocks` ranks, [H, T, blocks] fp32, from a Triton kernel: index q/k
    rounded to bf16, fp32 accumulation, as vLLM's (only the summation order differs, so near-tied blocks can swap);
    -inf past each query's visible keys."""
    _, kernel = _kernels()[0], _block_scores
    t_count, heads, dim = index_q.shape
    device = index_q.device
    q, k = index_q.to(torch.bfloat16), index_k.to(torch.bfloat16)
    if not q.is_cuda:  # Triton's CPU interpreter mishandles bf16 dots: the same (bf16-valued) numbers in fp32
        q, k = q.float(), k.float()
    q, k = q.contiguous(), k.contiguous()
    # Query tiles from the host offsets, copied in one non-blocking transfer: no device->host sync in the layer
    bounds = seq_bounds(cu_seqlens)
    nb = max((-(-(e - s) // BLOCK) for s, e in bounds), default=0)
    tiles = [(q0, min(q0 + queries_per_tile, e), s) for s, e in bounds for q0 in range(s, e, queries_per_tile)]
    scores = torch.full((t_count, heads, max(nb, 1)), float("-inf"), dtype=torch.float32, device=device)
    if tiles:
        q0, q1, start = to_device([x for col in zip(*tiles) for x in col], device, torch.int32).split(len(tiles))
        kernel[(len(tiles), heads)](q, k, scores, q0, q1, start, scores.shape[2], HI=heads, D=dim,
                                    BQ=queries_per_tile, PREC="tf32" if q.is_cuda else "ieee")
    return scores.permute(1, 0, 2)


def _kernels():
    if triton is None:
        raise RuntimeError("rl.model.msa_triton needs Triton (CUDA, or TRITON_INTERPRET=1 for tests)")
    return triton, _fwd, _dq, _dkdv


def _consts(q, k, plan, block_ids):
    hq, hkv, dim = q.shape[1], k.shape[1], q.shape[2]
    g = hq // hkv
    tt = plan.tokens_per_group
    topk = block_ids.shape[2]
    bm = max(16, 1 << (tt * g - 1).bit_length())
    return dict(HQ=hq, HKV=hkv, G=g, TT=tt, BM=bm, D=dim, TOPK=topk, TOPK_P2=max(2, 1 << (topk - 1).bit_length()),
                PREC="ieee" if q.dtype == torch.float32 else "tf32")  # fp32 models: no TF32 rounding


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, scale: float, launch: tuple[int, int]):  # noqa: D102
        triton, fwd, _, _ = _kernels()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        t_count = q.shape[0]
        c = _consts(q, k, plan, plan.gids)
        o = torch.empty_like(q)
        lse = torch.empty(t_count, q.shape[1], dtype=torch.float32, device=q.device)
        ng, _, width = plan.union.shape
        if t_count:
            fwd[(ng, c["HKV"])](q, k, v, o, lse, plan.gids, plan.kstart, plan.union, plan.count, t_count, width,
                                scale, **c, num_warps=launch[0], num_stages=launch[1])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.scale, ctx.launch = plan, scale, launch
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        triton, _, dq_kernel, dkdv_kernel = _kernels()
        q, k, v, o, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        do = do.contiguous().to(q.dtype)
        t_count = q.shape[0]
        c = _consts(q, k, plan, plan.gids)
        delta = (do.float() * o.float()).sum(-1).contiguous()
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        ng, _, width = plan.union.shape
        if t_count:
            dq_kernel[(ng, c["HKV"])](q, k, v, do, lse, delta, dq, plan.gids, plan.kstart, plan.union, plan.count,
                                      t_count, width, scale, **c, num_warps=ctx.launch[0],
                                      num_stages=ctx.launch[1])
            if plan.chunk_kb.numel():
                dkdv_kernel[(plan.chunk_kb.numel(),)](
                    q, k, v, do, lse, delta, dk, dv, plan.gids, plan.kstart, plan.chunk_kb, plan.chunk_h,
                    plan.chunk_lo, plan.chunk_hi, plan.visit_groups, t_count, scale, **c, num_warps=ctx.launch[0],
                    num_stages=ctx.launch[1])
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def sparse_attention(q, k, v, block_ids, cu_seqlens, scale: float, tokens_per_group: int | None = None,
                     num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """`rl.model.msa.sparse_attention` semantics (validated ids expected); differentiable in q, k, v."""
    g = q.shape[1] // k.shape[1]
    # 16-row tiles (1 token x 16 heads for M3): from 16K tokens up the smaller union beats the bigger tile
    # (results/gpu/run9/bench_msa.json sweep, fwd+bwd, 1 / 2 / 4 tokens per group: 98 / 113 / 126 ms at 32K,
    # 196 / 237 / 275 ms at 64K; at 4K 12.9 / 12.0 / 11.7 ms)
    tt = tokens_per_group or max(1, min(8, 16 // g))
    plan = build_plan(block_ids, cu_seqlens, tt)
    if num_stages is None:  # fp32 tiles take twice the shared memory: no software pipelining (H200: 227 KB)
        num_stages = 1 if q.dtype == torch.float32 else 3
    return _SparseAttention.apply(q, k, v, plan, scale, (num_warps, num_stages))
