"""The block-outer MSA kernels (rl.model.msa_block_outer._fwd and _bwd) written in Gluon for Hopper (sm_90).

Same work split and outputs as the Triton kernels: one program per work item (KV head, 128-key block, <= item_tokens
entries), tiles of TM tokens x G query heads. What Gluon adds is the schedule Triton 3.6 does not emit for these
loops: Triton waits on every MMA whose result is not a loop-carried accumulator right after issuing it, so the
exponentials run while the tensor cores idle (results/gpu: the Triton _bwd at ~46% of the bf16 matmul rate).

Forward (`_fwd_gluon`, 4 warps, two programs per SM): S of the next tile (Q K^T) is issued before this tile's softmax
and runs under it; P V follows; the tile after next's gathered q rows and entry ids arrive by cp.async during this
tile. Measured on the H200 (results/gpu/run32): 5.87 ms at 32K tokens vs 6.92 for the Triton kernel.

Backward (`_bwd_gluon`, 8 warps): dK/dV summed in registers and stored to the item's scratch rows, dQ of each tile
stored as a bf16 partial per entry row.
- S^T = K Q^T and dP^T = V dO^T are issued together; P = exp2(S - lse) is computed while dP^T runs;
- dV += P^T dO is issued before waiting for dP^T, so dS = P (dP - delta) is computed while it runs;
- the next tile's gathered q/dO rows are copied (cp.async) into the other buffer while this tile computes, and its
  entry ids two tiles ahead, so no global load latency is exposed inside the loop.
- dQ = dS K takes dS straight from the shared memory it is exchanged through (no copy into registers).
Measured: 12.8 ms at 32K tokens vs 14.7 ms for the Triton kernel (results/gpu/run24; ~53% of the bf16 matmul rate,
was 46%); 12.0 ms with dS from shared memory (run35: 12.68 ms beside it). Tried and slower (run22, run23): storing dQ
while the next tile's MMAs run (ptxas then serializes the MMAs: an accumulator is read inside the MMA pipeline),
storing dQ straight from the MMA layout (uncoalesced), issuing dQ before dK.

Operands bf16, fp32 accumulation, P and dS rounded to bf16 before their MMAs, as in the Triton kernels: the same
results up to accumulation order (the GPU tests hold both to the fp32 reference's bounds). Gluon has no interpreter:
the kernels run on sm_90 only (wgmma is Hopper's; msa_block_outer picks the Triton kernels elsewhere). Their
warp-specialized forms, the default where their tiles fit, are in rl.model.msa_block_outer_gluon_ws. The GPU tests
(tests/rl/model/test_msa_block_outer.py -m gpu) check their results; make test compiles them for sm_90 on the CPU
(tests/rl/model/test_msa_kernel_resources.py: no spills, fits, wgmma not serialized).
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)
except ImportError:  # CPU installs without Triton, or a Triton without Gluon
    gluon = None
    _bwd_gluon = _fwd_gluon = None


if gluon is not None:
    @gluon.jit
    def _entry_rows(ent_ptr, base, hi, h, HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr,
                    TOPK: gl.constexpr, TM: gl.constexpr, BM: gl.constexpr, layout: gl.constexpr):
        # Rows of the tile at entries [base, base+TM) in `layout`: row r = entry base + r//G, query head h*G + r%G.
        r = gl.arange(0, BM, layout=layout)
        slot = base + r // G
        ok = (r < TM * G) & (slot < hi)
        e = gl.load(ent_ptr + slot, mask=ok, other=0)
        return ok, slot, e // (HKV * TOPK) * HQ + h * G + r % G

    @gluon.jit
    def _item(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, NKB):
        # The launched item: its row of the item tables, KV head, entry range [lo, hi) and first key.
        it = gl.load(order_ptr + gl.program_id(0)).to(gl.int32)
        key = gl.load(key_ptr + it)
        lo = gl.load(lo_ptr + it)
        hi = gl.load(hi_ptr + it)
        h = key // NKB
        return it, h, lo, hi, gl.load(kstart_ptr + key - h * NKB)

    @gluon.jit
    def _item_kv(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, k_ptr, v_ptr, k_s, v_s, T, NKB, HKV: gl.constexpr,
                 D: gl.constexpr, BN: gl.constexpr, row_l: gl.constexpr, col_l: gl.constexpr):
        # The launched item and one commit group copying its K/V block.
        it, h, lo, hi, k0 = _item(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, NKB)
        d = gl.arange(0, D, layout=col_l)
        kidx = k0 + gl.arange(0, BN, layout=row_l)
        kv_rows = (kidx[:, None] * HKV + h) * D + d[None, :]
        async_copy.async_copy_global_to_shared(k_s, k_ptr + kv_rows, mask=(kidx < T)[:, None])
        async_copy.async_copy_global_to_shared(v_s, v_ptr + kv_rows, mask=(kidx < T)[:, None])
        async_copy.commit_group()
        return it, h, lo, hi, k0, d

    @gluon.jit
    def _copy_tile(q_buf, do_buf, e_buf, lse_buf, dl_buf, q_ptr, do_ptr, ent_ptr, lse_ptr, delta_ptr, ok, slot, qrow, d,
                   D: gl.constexpr):
        # One commit group: a tile's gathered q/dO rows and its entry ids / LSE / delta (masked rows: zeros).
        rows = qrow[:, None] * D + d[None, :]
        async_copy.async_copy_global_to_shared(q_buf, q_ptr + rows, mask=ok[:, None])
        async_copy.async_copy_global_to_shared(do_buf, do_ptr + rows, mask=ok[:, None])
        async_copy.async_copy_global_to_shared(e_buf, ent_ptr + slot, mask=ok)
        async_copy.async_copy_global_to_shared(lse_buf, lse_ptr + qrow, mask=ok)
        async_copy.async_copy_global_to_shared(dl_buf, delta_ptr + qrow, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _copy_rows(q_buf, e_buf, q_ptr, ent_ptr, ok, slot, qrow, d, D: gl.constexpr):
        # One commit group: a forward tile's gathered q rows and its entry ids (masked rows: zeros).
        async_copy.async_copy_global_to_shared(q_buf, q_ptr + qrow[:, None] * D + d[None, :], mask=ok[:, None])
        async_copy.async_copy_global_to_shared(e_buf, ent_ptr + slot, mask=ok)
        async_copy.commit_group()

    @gluon.constexpr_function
    def _bwd_layouts(BM, D, num_warps):
        # The backward's MMA layouts, warps along the keys: S^T and dP^T [BN keys, BM rows], dK and dV [BN, D], dQ
        # [BM, D] (warps split over rows and head dims), and P^T / dS^T as the A operand of the dV / dK MMAs.
        kv = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16])
        return (gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BM, 16]), kv,
                gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                          instr_shape=[16, D // (num_warps // 4), 16]),
                gl.DotOperandLayout(operand_index=0, parent=kv, k_width=2))

    @gluon.jit
    def _bwd_init(k0, BM: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
        # Per-item values of the backward's tile loop: the block's key ids and tile row ids (S^T layout), zero
        # accumulators for S^T / dP^T and dQ, and dK, dV.
        BN: gl.constexpr = 128
        s_l: gl.constexpr = _bwd_layouts(BM, D, num_warps)[0]
        kv_l: gl.constexpr = _bwd_layouts(BM, D, num_warps)[1]
        dq_l: gl.constexpr = _bwd_layouts(BM, D, num_warps)[2]
        s_kidx = k0 + gl.arange(0, BN, layout=gl.SliceLayout(1, s_l))
        s_r = gl.arange(0, BM, layout=gl.SliceLayout(0, s_l))
        return (s_kidx, s_r, gl.zeros([BN, BM], gl.float32, s_l), gl.zeros([BM, D], gl.float32, dq_l),
                gl.zeros([BN, D], gl.float32, kv_l), gl.zeros([BN, D], gl.float32, kv_l))

    @gluon.jit
    def _bwd_smem(dt: gl.constexpr, BM: gl.constexpr, D: gl.constexpr, S: gl.constexpr):
        # The backward's shared memory: the item's K/V block, S stages of gathered q/dO rows and of their per-row
        # values (entry id, LSE, delta: held in registers in the S^T layout they would cost 16 registers each per
        # tile in flight), and dS^T for the dQ MMA.
        BN: gl.constexpr = 128
        kv_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dt)
        q_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dt)
        vec_sh: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        return (gl.allocate_shared_memory(dt, [BN, D], kv_sh), gl.allocate_shared_memory(dt, [BN, D], kv_sh),
                gl.allocate_shared_memory(dt, [S, BM, D], q_sh), gl.allocate_shared_memory(dt, [S, BM, D], q_sh),
                gl.allocate_shared_memory(dt, [BN, BM], gl.NVMMASharedLayout.get_default_for([BN, BM], dt)),
                gl.allocate_shared_memory(gl.int32, [S, BM], vec_sh),
                gl.allocate_shared_memory(gl.float32, [S, BM], vec_sh),
                gl.allocate_shared_memory(gl.float32, [S, BM], vec_sh))

    @gluon.jit
    def _bwd_tile(st, dpt, qb, dob, e_b, lse_b, dl_b, k_s, ds_s, dk, dv, s_kidx, s_r, base, hi, qk_scale, zero_dq,
                  HKV: gl.constexpr, G: gl.constexpr, TOPK: gl.constexpr, TM: gl.constexpr, s_l: gl.constexpr,
                  a_kv: gl.constexpr, MASK: gl.constexpr = True):
        # A backward tile once S^T and dP^T are issued: P, dV += P^T dO under dP^T, dS, dK += dS Q, and
        # dQ = dS K with dS exchanged through shared memory; returns (dQ, dK, dV) with every MMA retired.
        # MASK=False: a tile whose tokens all come after the key block (they see all of its keys) and whose rows past
        # the item's end were copied as zeros (q, dO, LSE, delta: their P is 1, dO and dS are 0, so they add exact
        # zeros to dV and dK; their dQ rows are not stored): no mask at all.
        dt: gl.constexpr = qb.dtype
        scol_l: gl.constexpr = gl.SliceLayout(0, s_l)
        if MASK:
            c_ok = (s_r < TM * G) & (base + s_r // G < hi)
            c_tok = e_b.load(scol_l) // (HKV * TOPK)
        c_lse = lse_b.load(scol_l)
        st = warpgroup_mma_wait(1, deps=(st, ))
        if MASK:
            vis = (s_kidx[:, None] <= c_tok[None, :]) & c_ok[None, :]
            pt = gl.where(vis, gl.exp2(st * qk_scale - c_lse[None, :]), 0.0)
        else:
            pt = gl.exp2(st * qk_scale - c_lse[None, :])
        p_a = gl.convert_layout(pt.to(dt), a_kv)
        dv = warpgroup_mma(p_a, dob, dv, is_async=True)
        c_delta = dl_b.load(scol_l)
        dpt = warpgroup_mma_wait(1, deps=(dpt, ))
        dst = (pt * (dpt - c_delta[None, :])).to(dt)
        ds_a = gl.convert_layout(dst, a_kv)
        dk = warpgroup_mma(ds_a, qb, dk, is_async=True)
        ds_s.store(dst)
        fence_async_shared()
        dq = warpgroup_mma(ds_s.permute((1, 0)), k_s, zero_dq, use_acc=False, is_async=True)
        dq, dk, dv, p_a, ds_a = warpgroup_mma_wait(0, deps=(dq, dk, dv, p_a, ds_a))
        return dq, dk, dv

    @gluon.jit
    def _store_dq(dq, dq_ptr, base, hi, G: gl.constexpr, TM: gl.constexpr, BM: gl.constexpr, D: gl.constexpr,
                  ld: gl.constexpr):
        # A tile's dQ as bf16 partial rows [base*G, base*G + BM) (rows of entries past the item's end: not stored).
        dq_r = gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        q_ok = (dq_r < TM * G) & (base + dq_r // G < hi)
        tile = dq_ptr + base.to(gl.int64) * (G * D)
        gl.store(tile + dq_r[:, None] * D + d[None, :], gl.convert_layout(dq.to(dq_ptr.dtype.element_ty), ld),
                 mask=q_ok[:, None])

    @gluon.jit
    def _store_dkdv(dk, dv, dks_ptr, dvs_ptr, it, BN: gl.constexpr, D: gl.constexpr, kv_l: gl.constexpr):
        # The item's dK/dV sums to its scratch rows (summed over the key's items by _reduce_dkdv).
        kr = gl.arange(0, BN, layout=gl.SliceLayout(1, kv_l))
        kd = gl.arange(0, D, layout=gl.SliceLayout(0, kv_l))
        srow = (it.to(gl.int64) * BN + kr)[:, None] * D + kd[None, :]
        gl.store(dks_ptr + srow, dk)
        gl.store(dvs_ptr + srow, dv)

    @gluon.jit
    def _fwd_gluon(q_ptr, k_ptr, v_ptr, opart_ptr, lpart_ptr, ent_ptr, order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr,
                   T, NKB, qk_scale, HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr, TOPK: gl.constexpr,
                   TM: gl.constexpr, BM: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
        # The forward of msa_block_outer._fwd with the MMAs asynchronous: per tile i, S(i+1) = Q K^T of the next tile
        # runs while tile i's softmax does, and tile i+2's rows arrive (cp.async) during tile i.
        BN: gl.constexpr = 128
        dt: gl.constexpr = q_ptr.dtype.element_ty
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, ld)
        col_l: gl.constexpr = gl.SliceLayout(0, ld)
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BN, 16])  # S: [BM rows, BN keys]
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, D, 16])  # O: [BM, D]
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        srow_l: gl.constexpr = gl.SliceLayout(1, s_l)  # per tile row
        scol_l: gl.constexpr = gl.SliceLayout(0, s_l)  # per key
        kv_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dt)
        q_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dt)
        vec_sh: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        k_s = gl.allocate_shared_memory(dt, [BN, D], kv_sh)
        v_s = gl.allocate_shared_memory(dt, [BN, D], kv_sh)
        q_s = gl.allocate_shared_memory(dt, [2, BM, D], q_sh)
        e_s = gl.allocate_shared_memory(gl.int32, [2, BM], vec_sh)

        it, h, lo, hi, k0, d = _item_kv(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, k_ptr, v_ptr, k_s, v_s, T, NKB,
                                        HKV, D, BN, row_l, col_l)
        ok, slot, qrow = _entry_rows(ent_ptr, lo, hi, h, HQ, HKV, G, TOPK, TM, BM, row_l)
        _copy_rows(q_s.index(0), e_s.index(0), q_ptr, ent_ptr, ok, slot, qrow, d, D)
        ok, slot, qrow = _entry_rows(ent_ptr, lo + TM, hi, h, HQ, HKV, G, TOPK, TM, BM, row_l)
        _copy_rows(q_s.index(1), e_s.index(1), q_ptr, ent_ptr, ok, slot, qrow, d, D)
        n_ok, n_slot, n_qrow = _entry_rows(ent_ptr, lo + 2 * TM, hi, h, HQ, HKV, G, TOPK, TM, BM, row_l)
        async_copy.wait_group(1)  # K/V and tile 0
        fence_async_shared()
        s_kidx = k0 + gl.arange(0, BN, layout=scol_l)
        s_r = gl.arange(0, BM, layout=srow_l)
        o_r = gl.arange(0, BM, layout=row_l)
        zero_s = gl.zeros([BM, BN], gl.float32, s_l)
        zero_o = gl.zeros([BM, D], gl.float32, o_l)
        c_tok = e_s.index(0).load(srow_l) // (HKV * TOPK)
        st = warpgroup_mma(q_s.index(0), k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(0, deps=(st, ))
        n_tiles = (hi - lo + TM - 1) // TM
        for i in range(n_tiles):
            base = lo + i * TM
            buf = i % 2
            async_copy.wait_group(0)  # tile i+1's rows
            fence_async_shared()
            nxt = warpgroup_mma(q_s.index(1 - buf), k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            n_tok = e_s.index(1 - buf).load(srow_l) // (HKV * TOPK)
            # Tile i+2's rows into this tile's buffers (their readers, S(i) and the token load, are done).
            _copy_rows(q_s.index(buf), e_s.index(buf), q_ptr, ent_ptr, n_ok, n_slot, n_qrow, d, D)
            # Softmax of tile i (this block's keys alone) while S(i+1) runs.
            s = gl.where(s_kidx[None, :] <= c_tok[:, None], st * qk_scale, float("-inf"))  # log2 units
            m = gl.max(s, 1)
            m = gl.where(m == float("-inf"), 0.0, m)  # padding rows only: a selected block has a visible key
            p = gl.exp2(s - m[:, None])
            l = gl.sum(p, 1)
            p_a = gl.convert_layout(p.to(dt), p_l)
            o = warpgroup_mma(p_a, v_s, zero_o, use_acc=False, is_async=True)
            n_ok, n_slot, n_qrow = _entry_rows(ent_ptr, base + 3 * TM, hi, h, HQ, HKV, G, TOPK, TM, BM, row_l)
            nxt, o, p_a = warpgroup_mma_wait(0, deps=(nxt, o, p_a))
            # Tile i's partial output (normalised) and log-sum-exp, rows [base*G, base*G + BM) of the partials.
            l_o = gl.convert_layout(l, gl.SliceLayout(1, o_l))
            o = o / gl.where(l_o > 0, l_o, 1.0)[:, None]
            prow0 = base.to(gl.int64) * G
            s_ok = (s_r < TM * G) & (base + s_r // G < hi)
            gl.store(lpart_ptr + prow0 + s_r, m + gl.log2(l), mask=s_ok)
            o_ok = (o_r < TM * G) & (base + o_r // G < hi)
            gl.store(opart_ptr + (prow0 + o_r)[:, None] * D + d[None, :],
                     gl.convert_layout(o.to(opart_ptr.dtype.element_ty), ld), mask=o_ok[:, None])
            st = nxt
            c_tok = n_tok
        async_copy.wait_group(0)

    @gluon.jit
    def _bwd_gluon(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dks_ptr, dvs_ptr, ent_ptr, order_ptr,
                   key_ptr, lo_ptr, hi_ptr, kstart_ptr, T, NKB, qk_scale, HQ: gl.constexpr, HKV: gl.constexpr,
                   G: gl.constexpr, TOPK: gl.constexpr, TM: gl.constexpr, BM: gl.constexpr, D: gl.constexpr,
                   num_warps: gl.constexpr):
        BN: gl.constexpr = 128  # keys per program: one MSA block
        dt: gl.constexpr = q_ptr.dtype.element_ty  # bf16 or fp16 operands
        # Layouts: coalesced 16-byte rows for global traffic; MMA accumulators with warps along the keys (M).
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, ld)
        col_l: gl.constexpr = gl.SliceLayout(0, ld)
        s_l: gl.constexpr = _bwd_layouts(BM, D, num_warps)[0]
        kv_l: gl.constexpr = _bwd_layouts(BM, D, num_warps)[1]
        a_kv: gl.constexpr = _bwd_layouts(BM, D, num_warps)[3]
        k_s, v_s, q_s, do_s, ds_s, e_s, lse_s, dl_s = _bwd_smem(dt, BM, D, 2)

        it, h, lo, hi, k0, d = _item_kv(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, k_ptr, v_ptr, k_s, v_s, T, NKB,
                                        HKV, D, BN, row_l, col_l)
        ok, slot, qrow = _entry_rows(ent_ptr, lo, hi, h, HQ, HKV, G, TOPK, TM, BM, row_l)
        _copy_tile(q_s.index(0), do_s.index(0), e_s.index(0), lse_s.index(0), dl_s.index(0), q_ptr, do_ptr, ent_ptr,
                   lse_ptr, delta_ptr, ok, slot, qrow, d, D)
        n_ok, n_slot, n_qrow = _entry_rows(ent_ptr, lo + TM, hi, h, HQ, HKV, G, TOPK, TM, BM, row_l)
        s_kidx, s_r, zero_s, zero_dq, dk, dv = _bwd_init(k0, BM, D, num_warps)
        n_tiles = (hi - lo + TM - 1) // TM
        for i in range(n_tiles):
            base = lo + i * TM
            buf = i % 2
            # Next tile into the other buffers (their last readers, tile i-1's MMAs and loads, are done).
            _copy_tile(q_s.index(1 - buf), do_s.index(1 - buf), e_s.index(1 - buf), lse_s.index(1 - buf),
                       dl_s.index(1 - buf), q_ptr, do_ptr, ent_ptr, lse_ptr, delta_ptr, n_ok, n_slot, n_qrow, d, D)
            async_copy.wait_group(1)  # all but the copies just issued: K/V and this tile's rows are in
            fence_async_shared()
            qb = q_s.index(buf)
            dob = do_s.index(buf)
            st = warpgroup_mma(k_s, qb.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_s, dob.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            # While the MMAs run: the entry ids two tiles ahead (addresses of the next iteration's copies).
            n_ok, n_slot, n_qrow = _entry_rows(ent_ptr, base + 2 * TM, hi, h, HQ, HKV, G, TOPK, TM, BM, row_l)
            dq, dk, dv = _bwd_tile(st, dpt, qb, dob, e_s.index(buf), lse_s.index(buf), dl_s.index(buf), k_s, ds_s, dk,
                                   dv, s_kidx, s_r, base, hi, qk_scale, zero_dq, HKV, G, TOPK, TM, s_l, a_kv)
            _store_dq(dq, dq_ptr, base, hi, G, TM, BM, D, ld)
        async_copy.wait_group(0)
        _store_dkdv(dk, dv, dks_ptr, dvs_ptr, it, BN, D, kv_l)
