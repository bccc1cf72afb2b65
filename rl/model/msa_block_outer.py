"""MSA training attention, KV-block-outer (issue 18): Triton forward and backward where each program owns a key block.

Same contract as `rl.model.msa.sparse_attention` (q [T, Hq, D], k/v [T, Hkv, D], block_ids [T, Hkv, topk] per-sequence
128-token blocks, -1 = empty, causal inside each packed sequence; validated ids expected).

Why block-outer: the per-token kernels (rl.model.msa_triton) fill 16-row tiles (one token x 16 query heads), a quarter
of a Hopper MMA tile, and add dK/dV atomically. Here the per-token top-k is inverted: every (sparse token, KV head,
slot) selection is an *entry*; entries are grouped by (KV head, key block) (one stable sort) and each group is cut into
*items* of at most `item_tokens` tokens. A program loads one item's K/V block once and walks its entries TM tokens at a
time, i.e. tiles of TM x G rows (G = Hq/Hkv query heads of a token share the KV head's selection), so the MMAs are
64/128 rows tall and never visit a block the token did not select.
- forward: per tile, softmax over this block alone; writes the normalised partial output and its log-sum-exp per
  (entry, query head), in sorted-entry order (a tile's rows are contiguous); `_merge` combines each row's <= topk
  partials (found through `Plan.slot_pos`, as split-KV decoding does) into O and the LSE;
- backward: per tile, P from the final LSE, dV += P^T dO, dK += dS^T Q in registers; dQ of the tile (dS K) is a
  partial per entry (summed per row by `_reduce_dq`) or an fp32 atomic add (`dq="atomic"`). An item stores its
  dK/dV sums to scratch and `_reduce_dkdv` adds a block's items in order: one owner, no atomics, deterministic. The
  two sums are one launch (`_reduce_grads`).
- dense prefix: a query at position < topk*128 sees at most topk blocks and (validated ids) selects all of them, so
  its attention is plain causal attention over its sequence's prefix: those tokens go through FlashAttention (one
  varlen call for all prefixes, `rl.model.msa_dense`) when the prefix has >= `dense_prefix_min` tokens, and the kernels
  skip them; a batch whose sequences all fit in topk blocks is that call alone.
Operands bf16, accumulation fp32, P and dS rounded to the operand type before their MMAs (as FlashAttention and
rl.model.msa_triton do); partials stored in `part_dtype`. Work items run largest first (LPT) for balance, or by token.
On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1; tests only).

The plan (`build_plan`) never waits for the device: the grid is a host-computed bound on the number of items, the
tail of the item tables is empty rows, launched last, whose programs do no work.

Measured on one H200 (results/gpu/run81-83, issue18_targets.json; 64 q / 4 KV heads, d 128, top-16, bf16): fwd 7.5-8.1
ms, fwd+bwd 21.0-21.6 ms at 32K tokens (21.0-21.9 per call back to back, as between a model's layers; per-token kernels
99 ms, dense causal SDPA 113 ms), 41.8-43.8 ms at 64K (SDPA 449 ms); faster than SDPA from 8K tokens (single sequence);
at 4K 2.41-2.61 vs SDPA's 2.29-2.32 ms in a single call (host work before the first attention kernel: the plan's graph
replay, the forward's descriptors and launch; the kernels alone 2.11 ms, run102; without the plan graph 2.78-2.81 in the
same process, run100-101) and 2.22-2.26 vs 2.25-2.33 back to back (run101-112). On Hopper the forward and backward are
the warp-specialized Gluon kernels of rl.model.msa_block_outer_gluon_ws (4.6 and 9.4 ms at 32K; the unspecialized
`_fwd_gluon` / `_bwd_gluon` of rl.model.msa_block_outer_gluon and this file's Triton `_fwd` / `_bwd` run where those
tiles do not fit, and on request, Config.fwd_kernel / bwd_kernel); the merge and dQ sum 4.5 ms (at bandwidth: the cost
of the partials; the merge's two passes 2.34 vs 2.48 ms for the online form, results/gpu/run74), the plan 0.2 ms of GPU
time. Measured and not kept: the forward's adjacent selected blocks as one 256-key entry (fewer partials, but a second
plan for the backward and no faster forward kernels; results/gpu/run73/pairs_not_kept.patch)."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from m3.ops import MSA_BLOCK as BLOCK  # keys per program
from quant.kernels._triton import triton_version
from rl.model.msa_block_plan import (DEFAULT, Config, Plan, build_plan,  # noqa: F401  (build_plan: re-exported)
                                     dense_prefixes)
from rl.model.msa_dense import causal_dense
from rl.model.packed import seq_bounds, sequence_group_spans

try:
    from rl.model.msa_block_outer_gluon import _bwd_gluon, _fwd_gluon
    from rl.model.msa_block_outer_gluon_ws import (WS_BWD, WS_FWD, _bwd_gluon_ws, _fwd_gluon_ws, dq_descriptors,
                                                  fwd_ws_descriptors)
except ImportError:  # no Triton or no Gluon
    _bwd_gluon = _bwd_gluon_ws = _fwd_gluon = _fwd_gluon_ws = None

try:  # module-level jit functions: Triton's interpreter resolves callees from module globals
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: only the reference paths
    triton = None

if triton is not None:
    @triton.jit
    def _tile(ent_ptr, base, hi, h, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, TOPK: tl.constexpr,
              TM: tl.constexpr, BM: tl.constexpr):
        # Rows of the tile at entries [base, base+TM): row r = entry base + r//G, query head h*G + r%G.
        r = tl.arange(0, BM)
        slot = base + r // G
        ok = (r < TM * G) & (slot < hi)
        e = tl.load(ent_ptr + slot, mask=ok, other=0)
        tok = e // (HKV * TOPK)
        qrow = tok * HQ + h * G + r % G  # row of q / o / lse (token, query head)
        # Partials are stored by sorted position: the tile's rows are the contiguous rows [base*G, base*G + BM) (a
        # scalar base and small offsets: per-row 64-bit addresses cost the backward kernel 160 B/thread of spills).
        return ok, tok, qrow, r

    @triton.jit
    def _item(item_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, k_ptr, v_ptr, T, NKB, key0,
              HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
        # The launched item, its KV head, and the K/V rows [BN, D] it owns (BN keys from key0 inside the block).
        # An empty row of the item tables (lo == hi, past the real items) loops zero times; its K/V loads and (backward)
        # zero dK/dV stores go unmasked, to scratch nothing reads: masking them cost the backward kernel register
        # spills (224 -> 464 B per thread, Triton 3.6, sm_90).
        it = tl.load(item_ptr + tl.program_id(0)).to(tl.int32)  # int64 sort indices
        key = tl.load(key_ptr + it)
        lo = tl.load(lo_ptr + it)
        hi = tl.load(hi_ptr + it)
        h = key // NKB
        kidx = tl.load(kstart_ptr + key - h * NKB) + key0 + tl.arange(0, BN)
        rows = (kidx[:, None] * HKV + h) * D + tl.arange(0, D)[None, :]
        kt = tl.load(k_ptr + rows, mask=(kidx < T)[:, None], other=0.0)
        vt = tl.load(v_ptr + rows, mask=(kidx < T)[:, None], other=0.0)
        return it, h, lo, hi, kidx, kt, vt

    @triton.jit
    def _fwd(q_ptr, k_ptr, v_ptr, opart_ptr, lpart_ptr, ent_ptr, order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr,
             T, NKB, qk_scale, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, TOPK: tl.constexpr,
             TM: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
        it, h, lo, hi, kidx, kt, vt = _item(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, k_ptr, v_ptr, T, NKB, 0,
                                            HKV, D, 128)
        d = tl.arange(0, D)
        for base in range(lo, hi, TM):
            ok, tok, qrow, r = _tile(ent_ptr, base, hi, h, HQ, HKV, G, TOPK, TM, BM)
            q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale  # log2 units
            s = tl.where(kidx[None, :] <= tok[:, None], s, float("-inf"))
            m = tl.max(s, 1)
            m = tl.where(m == float("-inf"), 0.0, m)  # padding rows only: a selected block has a visible key
            p = tl.exp2(s - m[:, None])
            l = tl.sum(p, 1)
            o = tl.dot(p.to(vt.dtype), vt, input_precision=PREC) / tl.where(l > 0, l, 1.0)[:, None]
            prow0 = tl.cast(base, tl.int64) * G  # base: a Python int under the interpreter
            tl.store(opart_ptr + prow0 * D + r[:, None] * D + d[None, :], o.to(opart_ptr.dtype.element_ty),
                     mask=ok[:, None])
            tl.store(lpart_ptr + prow0 + r, m + tl.log2(l), mask=ok)

    @triton.jit
    def _rows(pid, NROWS, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, R: tl.constexpr):
        # The pid-th R consecutive (token, query head) rows of o / q: row index, its token, KV head, head inside the
        # group.
        row = pid * R + tl.arange(0, R)
        ok = row < NROWS
        row = tl.where(ok, row, 0)
        head = row % HQ
        return row, ok, row // HQ, head // G, head % G

    @triton.jit
    def _merge(opart_ptr, lpart_ptr, pos_ptr, dense_row_ptr, dense_ptr, o_ptr, lse_ptr, NROWS, HQ: tl.constexpr,
               HKV: tl.constexpr, G: tl.constexpr, TOPK: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
               HAS_DENSE: tl.constexpr, TP: tl.constexpr):
        # O and LSE (log2 units) of R rows from their slots' partials; dense-prefix rows copy the SDPA output. Two
        # passes: every slot's LSE at once (the row's maximum and sum), then the partial outputs weighted by
        # exp2(lse_j - max), whose loads wait on no running maximum (TP: TOPK rounded up to a power of two).
        row, ok, t, hk, g = _rows(tl.program_id(0), NROWS, HQ, HKV, G, R)
        d = tl.arange(0, D)
        j = tl.arange(0, TP)
        slots = (t * HKV + hk) * TOPK  # the row's first slot
        pos = tl.load(pos_ptr + slots[:, None] + j[None, :], mask=ok[:, None] & (j < TOPK)[None, :], other=-1)
        lj = tl.load(lpart_ptr + pos.to(tl.int64) * G + g[:, None], mask=pos >= 0, other=float("-inf"))
        m = tl.max(lj, 1)
        has = m > float("-inf")  # dense-prefix and padding rows have no slots
        m = tl.where(has, m, 0.0)
        l = tl.sum(tl.exp2(lj - m[:, None]), 1)
        acc = tl.zeros([R, D], tl.float32)
        for jj in range(TOPK):
            pj = tl.load(pos_ptr + slots + jj, mask=ok, other=-1)  # sorted position of the slot (cached: pass one)
            used = pj >= 0
            prow = pj.to(tl.int64) * G + g
            w = tl.exp2(tl.load(lpart_ptr + prow, mask=used, other=float("-inf")) - m)
            oj = tl.load(opart_ptr + prow[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
            acc += w[:, None] * oj.to(tl.float32)
        out = acc / tl.where(has, l, 1.0)[:, None]
        if HAS_DENSE:
            drow = tl.load(dense_row_ptr + t, mask=ok, other=-1)
            dense = drow >= 0  # such rows have no slots
            x = tl.load(dense_ptr + (drow.to(tl.int64) * HQ + row % HQ)[:, None] * D + d[None, :],
                        mask=dense[:, None], other=0.0)
            out = tl.where(dense[:, None], x.to(tl.float32), out)
        tl.store(o_ptr + row.to(tl.int64)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=ok[:, None])
        tl.store(lse_ptr + row, tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("inf")), mask=ok)

    @triton.jit
    def _delta(o_ptr, do_ptr, delta_ptr, NROWS, D: tl.constexpr, R: tl.constexpr):
        # delta = rowsum(dO * O) in fp32.
        row = tl.program_id(0) * R + tl.arange(0, R)
        ok = row < NROWS
        offs = row.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
        o = tl.load(o_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        do = tl.load(do_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        tl.store(delta_ptr + row, tl.sum(o * do, 1), mask=ok)

    @triton.jit
    def _bwd(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dks_ptr, dvs_ptr, ent_ptr, order_ptr, key_ptr,
             lo_ptr, hi_ptr, kstart_ptr, T, NKB, NE, qk_scale, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
             TOPK: tl.constexpr, TM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
             PREC: tl.constexpr, DQ_ATOMIC: tl.constexpr):
        half = tl.program_id(1)  # which BN keys of the 128-key block
        it, h, lo, hi, kidx, kt, vt = _item(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, k_ptr, v_ptr, T, NKB,
                                            half * BN, HKV, D, BN)
        d = tl.arange(0, D)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        for base in range(lo, hi, TM):
            ok, tok, qrow, r = _tile(ent_ptr, base, hi, h, HQ, HKV, G, TOPK, TM, BM)
            q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            do = tl.load(do_ptr + qrow[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + qrow, mask=ok, other=float("inf"))
            delta = tl.load(delta_ptr + qrow, mask=ok, other=0.0)
            # Transposed tiles [keys, rows], as the key block is the fixed operand.
            st = tl.dot(kt, tl.trans(q), input_precision=PREC) * qk_scale
            pt = tl.where((kidx[:, None] <= tok[None, :]) & ok[None, :], tl.exp2(st - lse[None, :]), 0.0)
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PREC)
            dpt = tl.dot(vt, tl.trans(do), input_precision=PREC)
            dst = (pt * (dpt - delta[None, :])).to(q.dtype)
            dk = tl.dot(dst, q, dk, input_precision=PREC)
            dq = tl.dot(tl.trans(dst), kt, input_precision=PREC)  # [rows, D], unscaled
            if DQ_ATOMIC:
                tl.atomic_add(dq_ptr + qrow[:, None] * D + d[None, :], dq, mask=ok[:, None], sem="relaxed")
            else:
                tile = dq_ptr + tl.cast(half * NE + base, tl.int64) * (G * D)
                tl.store(tile + r[:, None] * D + d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=ok[:, None])
        srow = (it.to(tl.int64) * 128 + half * BN + tl.arange(0, BN))[:, None] * D + d[None, :]
        tl.store(dks_ptr + srow, dk)
        tl.store(dvs_ptr + srow, dv)

    @triton.jit
    def _reduce_grads(dqp_ptr, pos_ptr, dq_ptr, dks_ptr, dvs_ptr, key_item0_ptr, kstart_ptr, kend_ptr, dk_ptr, dv_ptr,
                      NROWS, NE, NKB, N_DQ, scale, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                      TOPK: tl.constexpr, D: tl.constexpr, NH: tl.constexpr, R: tl.constexpr, DC: tl.constexpr):
        # One launch for the backward's two sums: programs [0, N_DQ) dQ (R rows each), the rest dK/dV (a key block's
        # DC columns each).
        pid = tl.program_id(0)
        if pid < N_DQ:
            _reduce_dq(pid, dqp_ptr, pos_ptr, dq_ptr, NROWS, NE, scale, HQ, HKV, G, TOPK, D, NH, R)
        else:
            p = pid - N_DQ
            _reduce_dkdv(p // (D // DC), p % (D // DC), dks_ptr, dvs_ptr, key_item0_ptr, kstart_ptr, kend_ptr, dk_ptr,
                         dv_ptr, NKB, scale, HKV, D, DC)

    @triton.jit
    def _reduce_dq(pid, dqp_ptr, pos_ptr, dq_ptr, NROWS, NE, scale, HQ: tl.constexpr, HKV: tl.constexpr,
                   G: tl.constexpr, TOPK: tl.constexpr, D: tl.constexpr, NH: tl.constexpr, R: tl.constexpr):
        # dQ of R rows: scale * the sum of their slots' partials (zeros for dense-prefix rows: no slots).
        row, ok, t, hk, g = _rows(pid, NROWS, HQ, HKV, G, R)
        d = tl.arange(0, D)
        acc = tl.zeros([R, D], tl.float32)
        for j in range(TOPK):
            pos = tl.load(pos_ptr + (t * HKV + hk) * TOPK + j, mask=ok, other=-1)
            used = pos >= 0
            for half in range(NH):
                prow = (half * NE + pos.to(tl.int64)) * G + g
                acc += tl.load(dqp_ptr + prow[:, None] * D + d[None, :], mask=used[:, None], other=0.0).to(tl.float32)
        tl.store(dq_ptr + row.to(tl.int64)[:, None] * D + d[None, :], (acc * scale).to(dq_ptr.dtype.element_ty),
                 mask=ok[:, None])

    @triton.jit
    def _reduce_dkdv(key, col, dks_ptr, dvs_ptr, key_item0_ptr, kstart_ptr, kend_ptr, dk_ptr, dv_ptr, NKB, scale,
                     HKV: tl.constexpr, D: tl.constexpr, DC: tl.constexpr):
        # dK/dV of one (KV head, key block), its col-th DC columns: its items' sums in item order; zeros for a block
        # nobody selected.
        h = key // NKB
        kb = key - h * NKB
        r = tl.arange(0, 128)
        d = col * DC + tl.arange(0, DC)
        ak = tl.zeros([128, DC], tl.float32)
        av = tl.zeros([128, DC], tl.float32)
        for it in range(tl.load(key_item0_ptr + key), tl.load(key_item0_ptr + key + 1)):
            srow = (it * 128 + r).to(tl.int64)[:, None] * D + d[None, :]  # it: an int under the interpreter
            ak += tl.load(dks_ptr + srow)
            av += tl.load(dvs_ptr + srow)
        kidx = tl.load(kstart_ptr + kb) + r
        ok = (kidx < tl.load(kend_ptr + kb))[:, None]
        rows = (kidx[:, None] * HKV + h) * D + d[None, :]
        tl.store(dk_ptr + rows, (ak * scale).to(dk_ptr.dtype.element_ty), mask=ok)
        tl.store(dv_ptr + rows, av.to(dv_ptr.dtype.element_ty), mask=ok)


def tile_shape(rows: int, g: int) -> tuple[int, int]:
    """(TM, BM) of a kernel tile asked to hold `rows` rows: whole tokens of G query heads each, and the power of two
    (>= 16) of rows the MMAs run on."""
    tm = max(1, rows // g)
    return tm, max(16, 1 << (tm * g - 1).bit_length())


def ws_fits(config: Config, g: int) -> dict:
    """Where the warp-specialized Gluon kernels' tiles fit G query heads per KV head: 'fwd_kernel' (64-row tiles of
    whole tokens, partials in the operand type), 'bwd_kernel' (tiles of an even number of whole tokens), 'dq_tma'
    (the backward storing dQ by TMA). Their TMA boxes are one token's G rows of a 128-byte-swizzled tile, whose
    swizzle repeats every 8 rows: G must be a multiple of 8 for them (the tiny test model's G=2 is not)."""
    tm, bm = tile_shape(config.bwd_rows, g)
    tma_rows = g % 8 == 0 and config.part_dtype != "fp32"  # token boxes on the swizzle period, operand-type rows
    return {"fwd_kernel": tile_shape(config.fwd_rows, g) == (64 // g, 64) and tma_rows,
            "bwd_kernel": tm * g == bm and tm % 2 == 0,  # its loader copies half a tile at a time: whole tokens
            "dq_tma": config.dq_store == "tma" and tma_rows}


def bwd_loops(asked: str, dq_store: str, version: tuple[int, int] | None = None) -> str:
    """Config.bwd_loops resolved for the dQ store and the Triton `version` ((major, minor); None: the importable one)
    the backward runs with. 'auto': under Triton 3.6/3.7 'split' with TMA stores (run82: backward 9.41 vs 10.71 ms at
    32K), 'masked' with register stores; under 3.8+ 'masked' (the split form spills in its MMA loop there; masked
    fwd+bwd 0.93x at 32K x 4, 0.92x at 32K x 1: run126, an H100)."""
    if asked != "auto":
        return asked
    if (triton_version() if version is None else version) >= (3, 8):
        return "masked"
    return "split" if dq_store == "tma" else "masked"


def _kernels(q, k, config) -> Config:
    """Config.fwd_kernel / bwd_kernel resolved for these inputs: on Hopper in bf16/fp16 what was asked for, 'auto'
    being the warp-specialized Gluon kernel where its tiles fit (ws_fits, else 'gluon'); elsewhere 'triton'; and
    dq_store 'tma' only where ws_fits allows it. A Gluon request that cannot run fails here, before any work."""
    return _resolve(q.device, q.dtype, q.shape[1] // k.shape[1], q.shape[2], config)


@functools.lru_cache(maxsize=64)
def _resolve(device, dtype, g: int, dim: int, config: Config) -> Config:
    """`_kernels` per (device, dtype, G, D, config): the same answer for every layer (the device query alone is tens
    of microseconds of host time a call)."""
    hopper = (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
              and torch.cuda.get_device_capability(device)[0] == 9)
    ws = ws_fits(config, g)
    fits = {"fwd_kernel": (_fwd_gluon is not None and hopper and dim == 128
                           and tile_shape(config.fwd_rows, g)[1] in (64, 128)),
            "bwd_kernel": (_bwd_gluon is not None and hopper and config.bwd_keys == BLOCK and config.dq == "partial")}
    needs = {"fwd_kernel": "64- or 128-row tiles, head dim 128", "bwd_kernel": "bwd_keys=128, dq='partial'"}
    for name in fits:
        if getattr(config, name) == "gluon_ws":
            fits[name] = fits[name] and ws[name]
            needs[name] += ", tiles that fit (msa_block_outer.ws_fits)"
    for name, ok in fits.items():
        if getattr(config, name).startswith("gluon") and not ok:
            raise ValueError(f"Config.{name}={getattr(config, name)!r} needs Gluon, an sm_90 device, bf16/fp16, "
                             f"{needs[name]}")
    auto = {name: "gluon_ws" if ws[name] else "gluon" for name in fits}
    asked = {name: getattr(config, name) for name in fits}
    return dataclasses.replace(config, dq_store=config.dq_store if ws["dq_tma"] else "registers",
                               **{name: (auto[name] if asked[name] == "auto" else asked[name]) if ok else "triton"
                                  for name, ok in fits.items()})


def _part_dtype(q, config):
    return torch.float32 if q.dtype == torch.float32 or config.part_dtype == "fp32" else q.dtype


def _forward(q, k, v, dense_out, plan: Plan, scale: float, config: Config, o, lse):
    """One sequence group's rows: fills o and lse (views of the whole batch's)."""
    t_count, hq, dim = q.shape
    hkv, topk = k.shape[1], plan.slot_gid.shape[2]
    g = hq // hkv
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    ne = t_count * hkv * topk
    opart = torch.empty(ne * g, dim, dtype=_part_dtype(q, config), device=q.device)
    lpart = torch.empty(ne * g, dtype=torch.float32, device=q.device)
    qk_scale = scale * math.log2(math.e)
    tm, bm = tile_shape(config.fwd_rows, g)
    items = (plan.entries, plan.order, plan.item_key, plan.item_lo, plan.item_hi, plan.kstart)
    tables = (*items, t_count, plan.nkb, qk_scale)
    if plan.n_max and config.fwd_kernel == "gluon_ws":  # resolved by sparse_attention
        _fwd_gluon_ws[(plan.n_max,)](*fwd_ws_descriptors(q, k, v, opart, g, bm), lpart, *items, plan.nkb, qk_scale,
                                     HQ=hq, HKV=hkv, G=g, TOPK=topk, TM=tm, **WS_FWD)
    elif plan.n_max and config.fwd_kernel == "gluon":
        _fwd_gluon[(plan.n_max,)](q, k, v, opart, lpart, *tables, HQ=hq, HKV=hkv, G=g, TOPK=topk, TM=tm, BM=bm, D=dim,
                                  num_warps=bm // 16)
    elif plan.n_max:
        _fwd[(plan.n_max,)](q, k, v, opart, lpart, *tables, HQ=hq, HKV=hkv, G=g, TOPK=topk, TM=tm, BM=bm, D=dim,
                            PREC=prec, num_warps=config.fwd_warps, num_stages=config.fwd_stages)
    has_dense = dense_out is not None
    dense = dense_out.contiguous() if has_dense else o
    dense_row = plan.dense_row if has_dense else plan.slot_pos  # not read without a dense prefix
    rows, r = t_count * hq, config.row_tile
    if t_count:
        _merge[(triton.cdiv(rows, r),)](opart, lpart, plan.slot_pos, dense_row, dense, o, lse, rows, HQ=hq,
                                        HKV=hkv, G=g, TOPK=topk, D=dim, R=r, HAS_DENSE=has_dense,
                                        TP=triton.next_power_of_2(topk))


def _backward(q, k, v, o, lse, do, plan: Plan, scale: float, config: Config, dq, dk, dv):
    """One sequence group's rows: fills dq, dk, dv (views of the whole batch's)."""
    t_count, hq, dim = q.shape
    hkv, topk = k.shape[1], plan.slot_gid.shape[2]
    g = hq // hkv
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    ne, ni = t_count * hkv * topk, plan.n_max
    (tm, bm), bn = tile_shape(config.bwd_rows, g), config.bwd_keys
    nh = BLOCK // bn
    delta = torch.empty(t_count, hq, dtype=torch.float32, device=q.device)
    rows, r = t_count * hq, config.row_tile
    if t_count:
        _delta[(triton.cdiv(rows, r),)](o, do, delta, rows, D=dim, R=r)
    atomic = config.dq == "atomic"
    dq_buf = (torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else
              torch.empty(nh * ne * g, dim, dtype=_part_dtype(q, config), device=q.device))
    dks = torch.empty(ni * BLOCK, dim, dtype=torch.float32, device=q.device)
    dvs = torch.empty_like(dks)
    qk_scale = scale * math.log2(math.e)
    if ni and config.bwd_kernel == "gluon_ws":  # resolved by sparse_attention
        dq_tma = config.dq_store == "tma"  # resolved by sparse_attention (ws_fits)
        descs = dq_descriptors(dq_buf, g, bm) if dq_tma else (None, None)
        _bwd_gluon_ws[(ni,)](q, k, v, do, lse, delta, dq_buf, *descs, dks, dvs, plan.entries, plan.order,
                             plan.item_key, plan.item_lo, plan.item_hi, plan.kstart, t_count, plan.nkb, qk_scale,
                             HQ=hq, HKV=hkv, G=g, TOPK=topk, TM=tm, BM=bm, D=dim, S=config.bwd_stages,
                             DQ_TMA=dq_tma, SPLIT=bwd_loops(config.bwd_loops, config.dq_store) == "split", **WS_BWD)
    elif ni and config.bwd_kernel == "gluon":
        _bwd_gluon[(ni,)](q, k, v, do, lse, delta, dq_buf, dks, dvs, plan.entries, plan.order, plan.item_key,
                          plan.item_lo, plan.item_hi, plan.kstart, t_count, plan.nkb, qk_scale,
                          HQ=hq, HKV=hkv, G=g, TOPK=topk, TM=tm, BM=bm, D=dim, num_warps=8)
    elif ni:
        _bwd[(ni, nh)](q, k, v, do, lse, delta, dq_buf, dks, dvs, plan.entries, plan.order, plan.item_key,
                       plan.item_lo, plan.item_hi, plan.kstart, t_count, plan.nkb, ne, qk_scale,
                       HQ=hq, HKV=hkv, G=g, TOPK=topk, TM=tm, BM=bm, BN=bn, D=dim, PREC=prec,
                       DQ_ATOMIC=atomic, num_warps=config.bwd_warps,
                       num_stages=config.bwd_stages)
    if atomic:
        dq.copy_(dq_buf * scale)
    n_dq, dc = 0 if atomic else triton.cdiv(rows, r), min(config.dkdv_cols, dim)
    if n_dq + plan.nkb:
        _reduce_grads[(n_dq + hkv * plan.nkb * (dim // dc),)](
            dq_buf, plan.slot_pos, dq, dks, dvs, plan.key_item0, plan.kstart, plan.kend, dk, dv, rows, ne, plan.nkb,
            n_dq, scale, HQ=hq, HKV=hkv, G=g, TOPK=topk, D=dim, NH=nh, R=r, DC=dc)


class _BlockOuter(torch.autograd.Function):
    """groups: [(start, end, plan)] of consecutive sequences, run one after the other so that the per-entry partials
    (forward and dQ: 4 KB per token per KV head and slot in bf16, ~34 GB at 131K M3 tokens in one call) exist for one
    group at a time; dense: each group's dense-prefix output (or None)."""

    @staticmethod
    def forward(ctx, q, k, v, groups, scale: float, config: Config, *dense):  # noqa: D102
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for (s, e, plan), dense_out in zip(groups, dense):
            _forward(*_spans((q, k, v), s, e), dense_out, plan, scale, config, *_spans((o, lse), s, e))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.groups, ctx.scale, ctx.config = groups, scale, config
        ctx.has_dense = [d is not None for d in dense]
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous().to(q.dtype)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_dense = []
        for (s, e, plan), has_dense in zip(ctx.groups, ctx.has_dense):
            q_, k_, v_, o_, lse_, do_, dq_, dk_, dv_ = _spans((q, k, v, o, lse, do, dq, dk, dv), s, e)
            _backward(q_, k_, v_, o_, lse_, do_, plan, ctx.scale, ctx.config, dq_, dk_, dv_)
            d_dense.append(_dense_rows(do_, plan.prefixes, plan.dense_idx) if has_dense else None)
        return dq, dk, dv, None, None, None, *d_dense


def _spans(tensors, s: int, e: int) -> list:
    """Rows [s, e) of each tensor: the tensors themselves for a call's only group (a slice is a few microseconds of
    host time each, and a short call waits on the host before its first kernel)."""
    return list(tensors) if s == 0 and e == tensors[0].shape[0] else [x[s:e] for x in tensors]


def _dense_rows(x, prefixes: list, dense_idx: torch.Tensor) -> torch.Tensor:
    """x's dense-prefix rows in `dense_idx` order: a group's one prefix as a view (no copy; a single sequence's
    call), else one gather (its backward: one scatter)."""
    if len(prefixes) == 1:
        start, n = prefixes[0]
        return x[start:start + n]
    return x.index_select(0, dense_idx)


def _dense_prefix(q, k, v, prefixes: list, dense_idx: torch.Tensor, scale: float):
    """The dense prefixes' attention (`Plan.prefixes`, at least one), rows in `Plan.dense_idx` order."""
    qp, kp, vp = (_dense_rows(x, prefixes, dense_idx) for x in (q, k, v))
    return causal_dense(qp, kp, vp, [n for _, n in prefixes], scale)


def sparse_attention(q, k, v, block_ids, cu_seqlens, scale: float, config: Config = DEFAULT) -> torch.Tensor:
    """`rl.model.msa.sparse_attention` semantics (validated ids expected); differentiable in q, k, v."""
    bounds = seq_bounds(cu_seqlens)
    if all(e - s <= block_ids.shape[2] * BLOCK for s, e in bounds):
        # Every query sees at most topk blocks and selects them all: the batch is plain causal attention per
        # sequence, no kernels (packed batches of short sequences run as fast as dense, being dense)
        return causal_dense(q, k, v, [e - s for s, e in bounds if e > s], scale)
    if triton is None:
        raise RuntimeError("rl.model.msa_block_outer needs Triton (CUDA, or TRITON_INTERPRET=1 for tests)")
    config = _kernels(q, k, config)
    groups, dense = [], []
    for s, e, group_cu in sequence_group_spans(bounds, config.group_tokens):
        ids = _spans((block_ids,), s, e)[0]
        # the prefix's SDPA first: the GPU runs it while the host builds the plan (a short call's latency)
        prefixes, dense_idx = dense_prefixes(ids, group_cu, config)
        dense.append(_dense_prefix(*_spans((q, k, v), s, e), prefixes, dense_idx, scale) if prefixes else None)
        groups.append((s, e, build_plan(ids, group_cu, config)))
    return _BlockOuter.apply(q, k, v, groups, scale, config, *dense)
