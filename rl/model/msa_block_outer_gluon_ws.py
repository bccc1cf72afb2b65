"""The block-outer MSA kernels of rl.model.msa_block_outer_gluon warp-specialized (Gluon, Hopper sm_90): loads, math
and stores in separate warps, synchronized by mbarriers; the default on sm_90 where their tiles fit
(rl.model.msa_block_outer.ws_fits: whole-token tiles, G a multiple of 8, partials in the operand type).

Backward (`_bwd_gluon_ws`): the same tile math in 8 warps while a 4-warp loader partition computes each tile's entry
rows and gathers its q/dO rows and per-row values into a 2-stage ring (cp.async, half a tile at a time, completion on an
mbarrier), so the math warps issue no copies and wait on no entry loads; dQ leaves through shared memory and a TMA store
(one per whole tile, one per token in an item's last tile) that runs under the next tile. Measured
(results/gpu/run45-47): 10.2-10.8 ms at 32K vs 12.0 for _bwd_gluon; dQ by TMA vs from registers 24.08 vs 24.43 ms
fwd+bwd at 32K, 47.45 vs 49.29 at 64K. Nsight Compute (run45, before the TMA store): the math warps' tile is serial
around the dS exchange for dQ (shared memory store, fence, CTA barrier) and the wait for all five MMAs at its end; the
tensor cores idle during the dQ epilogue. Tried and slower: a 3-stage ring (24.25 ms).

Both kernels mask only where a mask can bite: an item's tokens ascend, so the tokens inside its own key block (the
only ones with keys after them in it) are a prefix of the key's first item, < 128 entries. The math partitions count
those tiles once per item and run two loops, the first with the causal mask (and, forward, the row-token loads it
needs), the rest with none (rows past the item's end are zero copies in the backward, finite repeats in the forward,
and are not stored). The common loop: 475 vs 709 SASS instructions backward, ~925 vs ~1100 forward (offline sm_90
compiles); measured at 32K (run82, old code in the same call): backward 9.41 vs 10.71 ms, forward 4.64 vs 5.09. The
backward's two loops are Config.bwd_loops='split' (its default with TMA dQ stores under Triton 3.6/3.7); under 3.8
only its one masked loop compiles without spills in the MMA loop (scripts/msa_kernel_resources.py), and is the default
there (run126).

Forward (`_fwd_gluon_ws`): a loader warp brings the item's K/V block and each tile's q rows by TMA (a token's G query
heads of one KV head are contiguous rows: one box per token) into a 4-stage ring; two math warpgroups take alternate
tiles, so one's softmax runs under the other's MMAs; the partial output leaves by TMA like dQ. One program per SM (160
KB of shared memory). Measured: 4.96 ms at 32K vs 5.77 for _fwd_gluon (run47 profile), whose Nsight Compute report
(run45) showed it issue-bound (half the issue slots busy, "selected" the top stall), copying its rows and outputs
through registers.

Same tile math as the unspecialized kernels (the backward shares its helpers: _bwd_tile, _bwd_smem, ...); the GPU
tests hold both to the fp32 reference's bounds; make test compiles these for sm_90 on the CPU.
"""

from __future__ import annotations

import functools

import torch

from rl.model.msa_block_outer_gluon import gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.7 (torch 2.12 on) renamed Gluon's CTA-wide barrier from thread_barrier to barrier.
    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

    from rl.model.msa_block_outer_gluon import (_bwd_init, _bwd_layouts, _bwd_smem, _bwd_tile, _copy_tile,
                                                _entry_rows, _item, _item_kv, _store_dkdv, _store_dq)
else:
    _bwd_gluon_ws = _fwd_gluon_ws = None


# _bwd_gluon_ws's launch: 8 math warps + a 4-warp loader, one program per SM (64K registers over 12 warps: 168 each
# at launch; the loader gives back all but 24, the math warps take 240). Compiled for sm_90 under Triton 3.6/3.7: no
# spills in the MMA loops (scripts/msa_kernel_resources.py; 3.8: see Config.bwd_loops).
WS_BWD = dict(LW=4, LREGS=24, num_warps=8, maxnreg=168)


# _fwd_gluon_ws's launch: two math warpgroups + a loader warp (which holds a warpgroup's registers), one program per
# SM; ring stages of gathered q rows (an even number: each stage always feeds the same math warpgroup)
WS_FWD = dict(S=4, num_warps=4, maxnreg=168)


def _descriptor(t, box):
    """A TMA descriptor over the 2-D tensor t, `box`-shaped copies in the kernels' NVMMA shared layout."""
    return TensorDescriptor.from_tensor(t, list(box), _layout(tuple(box), t.dtype))


@functools.lru_cache(maxsize=None)
def _layout(box: tuple, dtype: torch.dtype):
    """The NVMMA shared layout of `box` tiles, computed once (a constexpr-function call each time otherwise; seven
    descriptors per fwd+bwd)."""
    dt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), dt)


def dq_descriptors(dq_part, g: int, rows: int):
    """The TMA descriptors _bwd_gluon_ws stores its dQ partial rows [n, D] through: one token's G rows a box (an
    item's last tile), and a whole tile's `rows`."""
    return _descriptor(dq_part, (g, dq_part.shape[1])), _descriptor(dq_part, (rows, dq_part.shape[1]))


def fwd_ws_descriptors(q, k, v, opart, g: int, rows: int):
    """_fwd_gluon_ws's TMA descriptors: q rows [T*Hq, D] by one token's G rows (a token's query heads of one KV head
    are contiguous), K and V as [T, Hkv*D] by 128-key blocks of one KV head, the partial outputs [n, D] as dQ's."""
    t, hkv, d = k.shape
    return (_descriptor(q.view(-1, d), (g, d)), _descriptor(k.view(t, hkv * d), (128, d)),
            _descriptor(v.view(t, hkv * d), (128, d)), *dq_descriptors(opart, g, rows))


if gluon is not None:
    @gluon.jit
    def _store_rows(x, x_s, desc, tile_desc, base, hi, G: gl.constexpr, TM: gl.constexpr):
        # A tile's rows (partial output or dQ) through shared memory and TMA: the copy to global memory runs while
        # the next tile computes. A whole tile is one store; an item's last tile one store per token inside the item.
        tma.store_wait(0)  # the previous tile's stores have read x_s
        x_s.store(x.to(x_s.dtype))
        fence_async_shared()
        if base + TM <= hi:
            tma.async_copy_shared_to_global(tile_desc, [base * G, 0], x_s)
        else:
            for j in gl.static_range(TM):
                if base + j < hi:
                    tma.async_copy_shared_to_global(desc, [(base + j) * G, 0], x_s.slice(j * G, G))

    @gluon.jit
    def _fwd_ws_load(q_desc, k_desc, v_desc, ent_ptr, k_s, v_s, q_s, kv_bar, ready, empty, lo, hi, h, k0, n_tiles,
                     HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr, TOPK: gl.constexpr, TM: gl.constexpr):
        # Loader of _fwd_gluon_ws (one warp): the item's K/V block, then each tile's q rows, one TMA box of G rows
        # per token (a token's query heads of this KV head are contiguous), into ring stage i % S once both math
        # partitions are done with it. Tokens past the item's end load its last token again (finite rows; the
        # math masks them and does not store them).
        S: gl.constexpr = q_s.type.shape[0]
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k0, h * k_desc.block_type.shape[1]], kv_bar, k_s)
        tma.async_copy_global_to_shared(v_desc, [k0, h * v_desc.block_type.shape[1]], kv_bar, v_s)
        for i in range(n_tiles):
            b = i % S
            mbarrier.wait(empty.index(b), ((i // S) & 1) ^ 1)
            mbarrier.expect(ready.index(b), TM * q_desc.block_type.nbytes)
            for j in gl.static_range(TM):
                e = gl.load(ent_ptr + gl.minimum(lo + i * TM + j, hi - 1))
                row = e // (HKV * TOPK) * HQ + h * G
                tma.async_copy_global_to_shared(q_desc, [row, 0], ready.index(b), q_s.index(b).slice(j * G, G))

    @gluon.jit
    def _causal_tiles(ent_ptr, lo, hi, k0, HKV: gl.constexpr, TOPK: gl.constexpr, TM: gl.constexpr,
                      num_warps: gl.constexpr):
        # Tiles at the item's start that hold tokens of the key block itself (the only ones with keys after them in
        # it): an item's tokens ascend, so they are a prefix of the key's first item, < 128 entries.
        r = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        tok = gl.load(ent_ptr + lo + r, mask=lo + r < hi, other=0) // (HKV * TOPK)
        return (gl.sum(((lo + r < hi) & (tok < k0 + 127)).to(gl.int32), 0) + TM - 1) // TM

    @gluon.jit
    def _fwd_ws_tile(i, k_s, v_s, q_s, o_s, ready, empty, o_desc, o_tile_desc, lpart_ptr, lo, hi, qk_scale, s_kidx, s_r,
                     c_tok, ent_ptr, zero_s, zero_o, HKV: gl.constexpr, G: gl.constexpr, TOPK: gl.constexpr,
                     TM: gl.constexpr, MASK: gl.constexpr):
        # Tile i of a math warpgroup of _fwd_gluon_ws: S = Q K^T, the softmax over this block, O = P V, then O
        # through shared memory and TMA (_store_rows), the LSE by plain stores. MASK: the causal mask (c_tok: each
        # row's token), and the row tokens of this warpgroup's next tile (i + 2) loaded under the MMA and returned;
        # without it every row sees all 128 keys (its token comes after the block) and the rows past the item's end
        # (its last token loaded again: finite) are computed but not stored.
        S: gl.constexpr = q_s.type.shape[0]
        D: gl.constexpr = q_s.type.shape[2]
        dt: gl.constexpr = q_s.dtype
        o_l: gl.constexpr = zero_o.type.layout
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        b = i % S
        base = lo + i * TM
        mbarrier.wait(ready.index(b), (i // S) & 1)
        st = warpgroup_mma(q_s.index(b), k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        n_tok = c_tok
        if MASK:
            n_slot = base + 2 * TM + s_r // G
            n_tok = gl.load(ent_ptr + n_slot, mask=n_slot < hi, other=0) // (HKV * TOPK)
        st = warpgroup_mma_wait(0, deps=(st, ))
        mbarrier.arrive(empty.index(b), count=1)  # the tile's q rows are read: the loader may refill the stage
        if MASK:
            sc = gl.where(s_kidx[None, :] <= c_tok[:, None], st * qk_scale, float("-inf"))  # log2 units
            m = gl.max(sc, 1)
            m = gl.where(m == float("-inf"), 0.0, m)  # padding rows only: a selected block has a visible key
        else:
            sc = st * qk_scale
            m = gl.max(sc, 1)
        p = gl.exp2(sc - m[:, None])
        l = gl.sum(p, 1)
        o = warpgroup_mma(gl.convert_layout(p.to(dt), p_l), v_s, zero_o, use_acc=False, is_async=True)
        gl.store(lpart_ptr + base.to(gl.int64) * G + s_r, m + gl.log2(l), mask=base + s_r // G < hi)
        o = warpgroup_mma_wait(0, deps=(o, ))
        l_o = gl.convert_layout(l, gl.SliceLayout(1, o_l))
        o = o / gl.where(l_o > 0, l_o, 1.0)[:, None]
        _store_rows(o, o_s, o_desc, o_tile_desc, base, hi, G, TM)
        return n_tok

    @gluon.jit
    def _fwd_ws_math(k_s, v_s, q_s, o_s, kv_bar, ready, empty, o_desc, o_tile_desc, lpart_ptr, ent_ptr, lo, hi, k0,
                     qk_scale, WG: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr, TOPK: gl.constexpr,
                     TM: gl.constexpr):
        # One math warpgroup of _fwd_gluon_ws: tiles WG, WG+2, ... of the item (the two warpgroups alternate, so one
        # computes its softmax while the other's MMAs run). Two loops, as in the backward: the _causal_tiles with the
        # causal mask, each row's token loaded; the rest with no mask and no entry loads.
        BN: gl.constexpr = 128
        BM: gl.constexpr = q_s.type.shape[1]
        D: gl.constexpr = q_s.type.shape[2]
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        s_kidx = k0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
        s_r = gl.arange(0, BM, layout=gl.SliceLayout(1, s_l))
        zero_s = gl.zeros([BM, BN], gl.float32, s_l)
        zero_o = gl.zeros([BM, D], gl.float32, o_l)
        n_causal = _causal_tiles(ent_ptr, lo, hi, k0, HKV, TOPK, TM, 4)
        slot = lo + WG * TM + s_r // G  # the row tokens of this warpgroup's first tile
        c_tok = gl.load(ent_ptr + slot, mask=slot < hi, other=0) // (HKV * TOPK)
        mbarrier.wait(kv_bar, 0)
        for i in range(WG, n_causal, 2):
            c_tok = _fwd_ws_tile(i, k_s, v_s, q_s, o_s, ready, empty, o_desc, o_tile_desc, lpart_ptr, lo, hi, qk_scale,
                                 s_kidx, s_r, c_tok, ent_ptr, zero_s, zero_o, HKV, G, TOPK, TM, True)
        # this warpgroup's first tile past the causal ones; the bound computed here (not carried through the loop)
        for i in range(n_causal + ((WG - n_causal) & 1), (hi - lo + TM - 1) // TM, 2):
            _fwd_ws_tile(i, k_s, v_s, q_s, o_s, ready, empty, o_desc, o_tile_desc, lpart_ptr, lo, hi, qk_scale, s_kidx,
                         s_r, c_tok, ent_ptr, zero_s, zero_o, HKV, G, TOPK, TM, False)
        tma.store_wait(0)

    @gluon.jit
    def _fwd_gluon_ws(q_desc, k_desc, v_desc, o_desc, o_tile_desc, lpart_ptr, ent_ptr, order_ptr, key_ptr, lo_ptr,
                      hi_ptr, kstart_ptr, NKB, qk_scale, HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr,
                      TOPK: gl.constexpr, TM: gl.constexpr, S: gl.constexpr, num_warps: gl.constexpr):
        # The forward warp-specialized: a loader warp moves K/V and the gathered q rows by TMA into an S-stage
        # ring; two math warpgroups (the default partition and a worker) take alternate tiles. One program per SM
        # (K/V, the ring and two output tiles: 160 KB of shared memory).
        BM: gl.constexpr = TM * G
        dt: gl.constexpr = q_desc.dtype
        D: gl.constexpr = q_desc.block_type.shape[1]
        it, h, lo, hi, k0 = _item(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, NKB)
        n_tiles = (hi - lo + TM - 1) // TM
        k_s = gl.allocate_shared_memory(dt, [128, D], k_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [128, D], v_desc.layout)
        q_s = gl.allocate_shared_memory(dt, [S, BM, D], q_desc.layout)
        o_s0 = gl.allocate_shared_memory(dt, [BM, D], o_desc.layout)
        o_s1 = gl.allocate_shared_memory(dt, [BM, D], o_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for b in gl.static_range(S):
            mbarrier.init(ready.index(b), count=1)
            mbarrier.init(empty.index(b), count=1)
        gl.warp_specialize([
            (_fwd_ws_math, (k_s, v_s, q_s, o_s0, kv_bar, ready, empty, o_desc, o_tile_desc, lpart_ptr, ent_ptr, lo,
                            hi, k0, qk_scale, 0, HKV, G, TOPK, TM)),
            (_fwd_ws_math, (k_s, v_s, q_s, o_s1, kv_bar, ready, empty, o_desc, o_tile_desc, lpart_ptr, ent_ptr, lo,
                            hi, k0, qk_scale, 1, HKV, G, TOPK, TM)),
            (_fwd_ws_load, (q_desc, k_desc, v_desc, ent_ptr, k_s, v_s, q_s, kv_bar, ready, empty, lo, hi, h, k0,
                            n_tiles, HQ, HKV, G, TOPK, TM)),
        ], [4, 1], [232, 24])

    @gluon.jit
    def _bwd_ws_load(q_ptr, do_ptr, ent_ptr, lse_ptr, delta_ptr, q_s, do_s, e_s, lse_s, dl_s, ready, empty, lo, hi, h,
                     n_tiles, HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr, TOPK: gl.constexpr,
                     TM: gl.constexpr, BM: gl.constexpr, D: gl.constexpr, LW: gl.constexpr):
        # Loader partition of _bwd_gluon_ws: tile i's entry ids, then its gathered q/dO rows and per-row values into
        # ring stage i % S by cp.async; the stage's `ready` completes when every thread's copies have landed (their
        # cp.async arrivals) and this partition has arrived once.
        S: gl.constexpr = q_s.type.shape[0]
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LW, 1], [1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, ld)
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        # Half a tile at a time (fewer live addresses in the loader's 24 registers: no spills); a half is whole tokens
        gl.static_assert(BM == TM * G and TM % 2 == 0, "_bwd_gluon_ws needs tiles of an even number of whole tokens")
        HR: gl.constexpr = BM // 2
        for i in range(n_tiles):
            b = i % S
            mbarrier.wait(empty.index(b), ((i // S) & 1) ^ 1)
            for half in gl.static_range(2):
                ok, slot, qrow = _entry_rows(ent_ptr, lo + i * TM + half * (TM // 2), hi, h, HQ, HKV, G, TOPK,
                                             TM // 2, HR, row_l)
                _copy_tile(q_s.index(b).slice(half * HR, HR), do_s.index(b).slice(half * HR, HR),
                           e_s.index(b).slice(half * HR, HR), lse_s.index(b).slice(half * HR, HR),
                           dl_s.index(b).slice(half * HR, HR), q_ptr, do_ptr, ent_ptr, lse_ptr, delta_ptr, ok, slot,
                           qrow, d, D)
            async_copy.mbarrier_arrive(ready.index(b))
            mbarrier.arrive(ready.index(b), count=1)

    @gluon.jit
    def _bwd_ws_step(i, k_s, v_s, q_s, do_s, ds_s, dq_s, e_s, lse_s, dl_s, ready, empty, dq_ptr, dq_desc, dq_tile_desc,
                     dk, dv, s_kidx, s_r, zero_s, zero_dq, lo, hi, qk_scale, HKV: gl.constexpr, G: gl.constexpr,
                     TOPK: gl.constexpr, TM: gl.constexpr, BM: gl.constexpr, D: gl.constexpr, DQ_TMA: gl.constexpr,
                     MASK: gl.constexpr, num_warps: gl.constexpr):
        # Tile i of the math partition: its S^T / dP^T MMAs, _bwd_tile, the stage released, dQ stored.
        S: gl.constexpr = q_s.type.shape[0]
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        s_l: gl.constexpr = _bwd_layouts(BM, D, num_warps)[0]
        a_kv: gl.constexpr = _bwd_layouts(BM, D, num_warps)[3]
        base = lo + i * TM
        b = i % S
        mbarrier.wait(ready.index(b), (i // S) & 1)
        fence_async_shared()  # the cp.async writes before the MMAs' reads
        qb = q_s.index(b)
        dob = do_s.index(b)
        st = warpgroup_mma(k_s, qb.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_s, dob.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dq, dk, dv = _bwd_tile(st, dpt, qb, dob, e_s.index(b), lse_s.index(b), dl_s.index(b), k_s, ds_s, dk, dv,
                               s_kidx, s_r, base, hi, qk_scale, zero_dq, HKV, G, TOPK, TM, s_l, a_kv, MASK)
        mbarrier.arrive(empty.index(b), count=1)  # the stage's rows are read: the loader may refill it
        if DQ_TMA:
            _store_rows(dq, dq_s, dq_desc, dq_tile_desc, base, hi, G, TM)
        else:
            _store_dq(dq, dq_ptr, base, hi, G, TM, BM, D, ld)
        return dk, dv

    @gluon.jit
    def _bwd_ws_math(k_s, v_s, q_s, do_s, ds_s, dq_s, e_s, lse_s, dl_s, ready, empty, ent_ptr, dq_ptr, dq_desc,
                     dq_tile_desc, dks_ptr, dvs_ptr, it, lo, hi, k0, n_tiles, qk_scale, HKV: gl.constexpr,
                     G: gl.constexpr, TOPK: gl.constexpr, TM: gl.constexpr, BM: gl.constexpr, D: gl.constexpr,
                     DQ_TMA: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr):
        # The math partition of _bwd_gluon_ws: _bwd_gluon's tile loop without its copies and entry loads; SPLIT: in
        # two loops, the _causal_tiles with the causal and row masks, the rest with none (every row sees all 128
        # keys; rows past the item's end are zero copies: they add exact zeros and their dQ is not stored); else
        # every tile masked in one loop.
        BN: gl.constexpr = 128
        kv_l: gl.constexpr = _bwd_layouts(BM, D, num_warps)[1]
        s_kidx, s_r, zero_s, zero_dq, dk, dv = _bwd_init(k0, BM, D, num_warps)
        if SPLIT:
            n_causal = _causal_tiles(ent_ptr, lo, hi, k0, HKV, TOPK, TM, num_warps)
        else:
            n_causal = n_tiles
        for i in range(n_causal):
            dk, dv = _bwd_ws_step(i, k_s, v_s, q_s, do_s, ds_s, dq_s, e_s, lse_s, dl_s, ready, empty, dq_ptr, dq_desc,
                                  dq_tile_desc, dk, dv, s_kidx, s_r, zero_s, zero_dq, lo, hi, qk_scale, HKV, G, TOPK,
                                  TM, BM, D, DQ_TMA, True, num_warps)
        if SPLIT:
            # the bound computed here, not carried through the first loop (it was spilled to the stack)
            for i in range(n_causal, (hi - lo + TM - 1) // TM):
                dk, dv = _bwd_ws_step(i, k_s, v_s, q_s, do_s, ds_s, dq_s, e_s, lse_s, dl_s, ready, empty, dq_ptr,
                                      dq_desc, dq_tile_desc, dk, dv, s_kidx, s_r, zero_s, zero_dq, lo, hi, qk_scale,
                                      HKV, G, TOPK, TM, BM, D, DQ_TMA, False, num_warps)
        if DQ_TMA:
            tma.store_wait(0)
        _store_dkdv(dk, dv, dks_ptr, dvs_ptr, it, BN, D, kv_l)

    @gluon.jit
    def _bwd_gluon_ws(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dq_desc, dq_tile_desc, dks_ptr, dvs_ptr,
                      ent_ptr, order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, T, NKB, qk_scale, HQ: gl.constexpr,
                      HKV: gl.constexpr, G: gl.constexpr, TOPK: gl.constexpr, TM: gl.constexpr, BM: gl.constexpr,
                      D: gl.constexpr, S: gl.constexpr, LW: gl.constexpr, LREGS: gl.constexpr, DQ_TMA: gl.constexpr,
                      SPLIT: gl.constexpr, num_warps: gl.constexpr):
        # _bwd_gluon warp-specialized: a loader partition (LW warps) gathers each tile's rows into an S-stage ring,
        # so the math warps issue no copies and wait on no entry loads; DQ_TMA: dQ leaves by TMA (dq_desc: one
        # token's G rows, dq_tile_desc: a whole tile).
        BN: gl.constexpr = 128
        dt: gl.constexpr = q_ptr.dtype.element_ty
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        k_s, v_s, q_s, do_s, ds_s, e_s, lse_s, dl_s = _bwd_smem(dt, BM, D, S)
        dq_s = gl.allocate_shared_memory(dt, [BM if DQ_TMA else G, D], gl.NVMMASharedLayout.get_default_for([G, D], dt))
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(S):
            mbarrier.init(ready.index(b), count=1)
            mbarrier.init(empty.index(b), count=1)
        it, h, lo, hi, k0, d = _item_kv(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, k_ptr, v_ptr, k_s, v_s, T, NKB,
                                        HKV, D, BN, gl.SliceLayout(1, ld), gl.SliceLayout(0, ld))
        async_copy.wait_group(0)
        _cta_barrier()  # every thread's K/V copies, before either partition starts
        n_tiles = (hi - lo + TM - 1) // TM
        gl.warp_specialize([
            (_bwd_ws_math, (k_s, v_s, q_s, do_s, ds_s, dq_s, e_s, lse_s, dl_s, ready, empty, ent_ptr, dq_ptr, dq_desc,
                            dq_tile_desc, dks_ptr, dvs_ptr, it, lo, hi, k0, n_tiles, qk_scale, HKV, G, TOPK, TM,
                            BM, D, DQ_TMA, SPLIT, num_warps)),
            (_bwd_ws_load, (q_ptr, do_ptr, ent_ptr, lse_ptr, delta_ptr, q_s, do_s, e_s, lse_s, dl_s, ready, empty, lo,
                            hi, h, n_tiles, HQ, HKV, G, TOPK, TM, BM, D, LW)),
        ], [LW], [LREGS])
