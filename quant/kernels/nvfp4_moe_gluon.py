"""The NVFP4 grouped expert GEMM (``nvfp4_moe_gemm``'s forward and input gradient) written in Gluon for Hopper (sm_90).

One kernel, two directions: out tile [BM rows, BO] = in[BM, R] @ B[R, BO], R reduced in steps of BR, with the decoded
weight tile as the MMA's B operand in shared memory: B = W_e for the input gradient (in = dy, R = N), W_e^T for the
forward (in = x, R = K). Why Gluon: in the Triton input-gradient kernel (SWAP=False, the default from ~96 rows per
expert) the decoded tile is written to shared memory every step and Triton 3.6 then waits on each MMA right after
issuing it, so the weight decode never overlaps the tensor cores (issue 19: 0.79x bf16 at 4K tokens). Here the decoded
tile is double-buffered: step i's MMA runs while step i+1's weights are decoded and stored; the input rows arrive by
cp.async two steps ahead (three buffers) and the packed weights one step ahead in registers.

Decode: ``gl.fp4_to_fp`` (e2m1 -> bf16, exact) times the E4M3 block scale in bf16 (exact: <= 6 significant bits), the
same operands as the Triton kernels and the reference; the global scale multiplies the fp32 accumulator once, then one
bf16 round. Rows never straddle experts (tiles from the offsets, as ``_tile`` of the Triton kernels).

Status: compiled for sm_90 on the CPU machine (scripts/expert_kernel_resources.py: no spills, MMAs asynchronous); not
yet run on a GPU. It is opt-in (``launch_fwd`` / ``launch_dgrad`` with ``config={"GLUON": True, ...}``): the GPU tests
(tests/quant/test_kernels_gpu.py: CONFIG_VARIANTS ``*_gluon_*``, test_nvfp4_moe_gluon_edges) and
``bench_expert_gemm.py --variants`` run it.
"""

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
except ImportError:  # CPU installs without Triton, or a Triton without Gluon
    gluon = None
    _gemm_gluon = None


if gluon is not None:
    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _tile(off_ptr, E, pid_m, E_P2: gl.constexpr, BM: gl.constexpr, layout: gl.constexpr):
        # Row tile pid_m -> (expert, first row, end row of that expert, valid); tiles expert by expert.
        idx = gl.arange(0, E_P2, layout=layout)
        em = idx < E
        start = gl.load(off_ptr + idx, mask=em, other=0)
        end = gl.load(off_ptr + idx + 1, mask=em, other=0)
        nt = (end - start + BM - 1) // BM
        cum = gl.associative_scan(nt, 0, _add)
        e = gl.sum((cum <= pid_m).to(gl.int32), 0)
        sel = idx == e
        first = gl.sum(gl.where(sel, cum - nt, 0), 0)
        row0 = gl.sum(gl.where(sel, start, 0), 0) + (pid_m - first) * BM
        row_end = gl.sum(gl.where(sel, end, 0), 0)
        return e, row0, row_end, pid_m < gl.sum(nt, 0)

    @gluon.jit
    def _load_w(w_ptr, s_ptr, e64, n0, k0, N, K, KB, KS, BN: gl.constexpr, BK: gl.constexpr, l3: gl.constexpr):
        # Packed bytes [BN, BK/16, 8] (one 16-code group per (row, group)) and scale bytes [BN, BK/16] of W_e's rows
        # n0.. and columns k0..; zeros outside N x K.
        r = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
        g = k0 // 16 + gl.arange(0, BK // 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
        b = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
        ok = (r < N)[:, None] & (g < K // 16)[None, :]
        rows = e64 * N + r
        p = gl.load(w_ptr + (rows * KB)[:, None, None] + (g * 8)[None, :, None] + b[None, None, :],
                    mask=ok[:, :, None], other=0)
        s = gl.load(s_ptr + (rows * KS)[:, None] + g[None, :], mask=ok, other=0)
        return p, s

    @gluon.jit
    def _decode(p, s, BN: gl.constexpr, BK: gl.constexpr):
        w = gl.fp4_to_fp(p, gl.bfloat16, 2)  # [BN, BK/16, 16]: code 2j in the low nibble of byte j
        sb = s.to(gl.float8e4nv, bitcast=True).to(gl.bfloat16)
        w = w * gl.expand_dims(gl.convert_layout(sb, gl.SliceLayout(2, w.type.layout)), 2)
        return gl.reshape(w, [BN, BK])

    @gluon.jit
    def _copy_rows(buf, ptr, rows, r_ok, c, ncols, stride):
        # One commit group: ptr[rows, c] (ncols and the row stride are multiples of 8: 16-byte copies).
        async_copy.async_copy_global_to_shared(buf, ptr + (rows * (stride // 8) * 8)[:, None] + c[None, :],
                                               mask=r_ok[:, None] & (c // 8 < ncols // 8)[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _w_step(w_ptr, s_ptr, e64, o0, i, N, K, KB, KS, BO: gl.constexpr, BR: gl.constexpr, DGRAD: gl.constexpr,
                l3: gl.constexpr):
        # Packed weights of reduction step i: W_e[i*BR.., o0..] (input gradient) or W_e[o0.., i*BR..] (forward).
        if DGRAD:
            p, s = _load_w(w_ptr, s_ptr, e64, i * BR, o0, N, K, KB, KS, BR, BO, l3)
        else:
            p, s = _load_w(w_ptr, s_ptr, e64, o0, i * BR, N, K, KB, KS, BO, BR, l3)
        return p, s

    @gluon.jit
    def _gemm_gluon(in_ptr, w_ptr, s_ptr, gs_ptr, off_ptr, out_ptr, N, K, E, KB, KS, stride_in, stride_out,
                    E_P2: gl.constexpr, BM: gl.constexpr, BO: gl.constexpr, BR: gl.constexpr,
                    DGRAD: gl.constexpr, num_warps: gl.constexpr):
        # out tile [BM, BO] = in[BM, R] @ B[R, BO], R reduced in steps of BR, with B = W_e (input gradient: in = dy,
        # R = N, out = dx) or W_e^T (forward: in = x, R = K, out = y). The decoded weight tile is [W rows, W cols].
        WR: gl.constexpr = BR if DGRAD else BO
        WC: gl.constexpr = BO if DGRAD else BR
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # 16-byte rows of bf16
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 8, 1], [num_warps, 1, 1], [2, 1, 0])  # packed weights
        v1: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BO, 16])
        in_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BR], gl.bfloat16)
        w_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WR, WC], gl.bfloat16)
        r_cols = N if DGRAD else K
        o_cols = K if DGRAD else N

        pid = gl.program_id(0)
        num_o = gl.cdiv(o_cols, BO)
        pid_m = pid // num_o
        o0 = (pid % num_o) * BO
        e, row0, row_end, valid = _tile(off_ptr, E, pid_m, E_P2, BM, v1)
        if valid:
            in_s = gl.allocate_shared_memory(gl.bfloat16, [3, BM, BR], in_sh)
            w_s = gl.allocate_shared_memory(gl.bfloat16, [2, WR, WC], w_sh)
            e64 = e.to(gl.int64)
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
            r_ok = rows < row_end
            rows = rows.to(gl.int64)
            c = gl.arange(0, BR, layout=gl.SliceLayout(0, ld))
            # Prologue: the input rows of steps 0 and 1 in flight, step 0's weights decoded, step 1's packed ones in
            # registers.
            _copy_rows(in_s.index(0), in_ptr, rows, r_ok, c, r_cols, stride_in)
            _copy_rows(in_s.index(1), in_ptr, rows, r_ok, BR + c, r_cols, stride_in)
            p, s = _w_step(w_ptr, s_ptr, e64, o0, 0, N, K, KB, KS, BO, BR, DGRAD, l3)
            w_s.index(0).store(_decode(p, s, WR, WC))
            p, s = _w_step(w_ptr, s_ptr, e64, o0, 1, N, K, KB, KS, BO, BR, DGRAD, l3)
            acc = gl.zeros([BM, BO], gl.float32, acc_l)
            for i in range(gl.cdiv(r_cols, BR)):
                async_copy.wait_group(1)  # step i's input rows (step i+1's may still be in flight)
                fence_async_shared()  # and step i's decoded weights, stored by every thread
                if DGRAD:
                    acc = warpgroup_mma(in_s.index(i % 3), w_s.index(i % 2), acc, is_async=True)
                else:
                    acc = warpgroup_mma(in_s.index(i % 3), w_s.index(i % 2).permute((1, 0)), acc, is_async=True)
                # Under step i's MMA: decode step i+1's weights, fetch step i+2's.
                w = _decode(p, s, WR, WC)
                p, s = _w_step(w_ptr, s_ptr, e64, o0, i + 2, N, K, KB, KS, BO, BR, DGRAD, l3)
                acc = warpgroup_mma_wait(1, deps=(acc, ))  # step i-1's MMA is done: its buffers are free
                w_s.index((i + 1) % 2).store(w)
                _copy_rows(in_s.index((i + 2) % 3), in_ptr, rows, r_ok, (i + 2) * BR + c, r_cols, stride_in)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            async_copy.wait_group(0)
            out = gl.convert_layout((acc * gl.load(gs_ptr + e)).to(gl.bfloat16), ld)
            cols = o0 + gl.arange(0, BO, layout=gl.SliceLayout(0, ld))
            gl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out,
                     mask=r_ok[:, None] & (cols < o_cols)[None, :])


def launch_gluon(inp, packed, scale, gs, offsets, out, cfg, dgrad: bool):
    """The Gluon kernel for ``nvfp4_moe_gemm.launch_fwd`` / ``launch_dgrad`` with config GLUON=True, into ``out``:
    BM 64 or 128 rows (4 or 8 warps); output columns per program BN (forward) or BK (input gradient), reduction step
    BK (forward) or BN (input gradient), 128 unless ``cfg`` says otherwise."""
    import triton

    if _gemm_gluon is None or not inp.is_cuda or torch.cuda.get_device_capability(inp.device)[0] != 9:
        raise RuntimeError("nvfp4 expert GEMM config GLUON=True needs Gluon and an sm_90 device")
    e, n, kh = packed.shape
    k, m = kh * 2, inp.shape[0]
    bm, bk, bn = cfg.get("BM", 128), cfg.get("BK", 128), cfg.get("BN", 128)
    bo, br, o_cols = (bk, bn, k) if dgrad else (bn, bk, n)
    if bm not in (64, 128) or n % 8 or inp.stride(0) % 8:
        raise ValueError(f"nvfp4 expert GEMM GLUON: BM={bm} (expected 64 or 128), N={n} and the input's row stride "
                         f"{inp.stride(0)} (expected multiples of 8)")
    grid = ((triton.cdiv(m, bm) + e) * triton.cdiv(o_cols, bo),)
    _gemm_gluon[grid](inp, packed.contiguous(), scale.contiguous().view(torch.uint8), gs, offsets, out,
                      n, k, e, kh, k // 16, inp.stride(0), out.stride(0),
                      E_P2=triton.next_power_of_2(e), BM=bm, BO=bo, BR=br, DGRAD=dgrad, num_warps=bm // 16)
    return out
