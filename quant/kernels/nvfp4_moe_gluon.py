"""The NVFP4 grouped input-gradient GEMM (``nvfp4_moe_gemm``'s dgrad) written in Gluon for Hopper (sm_90).

dx tile [BM rows, BK] = dy[BM, N] @ W_e[N, BK], reducing over N in steps of BN, with the decoded weight tile as the
MMA's B operand in shared memory. Why Gluon: in the Triton kernel (SWAP=False, the default from ~96 rows per expert)
the decoded tile is written to shared memory every step and Triton 3.6 then waits on each MMA right after issuing it,
so the weight decode never overlaps the tensor cores (issue 19: 0.79x bf16 at 4K tokens). Here the decoded tile is
double-buffered: step i's MMA runs while step i+1's weights are decoded and stored; dy rows arrive by cp.async two
steps ahead (three buffers) and the packed weights one step ahead in registers.

Decode: ``gl.fp4_to_fp`` (e2m1 -> bf16, exact) times the E4M3 block scale in bf16 (exact: <= 6 significant bits), the
same operands as the Triton kernels and the reference; the global scale multiplies the fp32 accumulator once, then one
bf16 round. Rows never straddle experts (tiles from the offsets, as ``_tile`` of the Triton kernels).

Status: compiled for sm_90 on the CPU machine (scripts/expert_kernel_resources.py: no spills, MMAs asynchronous); not
yet run on a GPU. It is opt-in (``launch_dgrad(config={"GLUON": True, ...})``): the GPU tests
(tests/quant/test_kernels_gpu.py, CONFIG_VARIANTS ``dgrad_gluon_*``) and ``bench_expert_gemm.py --variants`` run it.
"""

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
except ImportError:  # CPU installs without Triton, or a Triton without Gluon
    gluon = None
    _dgrad_gluon = None


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
    def _copy_dy(buf, dy_ptr, rows, r_ok, c, N, stride_dym):
        # One commit group: dy[rows, c] (N and the row stride are multiples of 8: 16-byte copies).
        async_copy.async_copy_global_to_shared(buf, dy_ptr + (rows * (stride_dym // 8) * 8)[:, None] + c[None, :],
                                               mask=r_ok[:, None] & (c // 8 < N // 8)[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _dgrad_gluon(dy_ptr, w_ptr, s_ptr, gs_ptr, off_ptr, dx_ptr, N, K, E, KB, KS, stride_dym, stride_dxm,
                     E_P2: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, BN: gl.constexpr,
                     num_warps: gl.constexpr):
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # 16-byte rows of bf16
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 8, 1], [num_warps, 1, 1], [2, 1, 0])  # packed weights
        v1: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BK, 16])  # dx: [BM, BK]
        dy_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
        w_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)

        pid = gl.program_id(0)
        num_k = gl.cdiv(K, BK)
        pid_m = pid // num_k
        k0 = (pid % num_k) * BK
        e, row0, row_end, valid = _tile(off_ptr, E, pid_m, E_P2, BM, v1)
        if valid:
            dy_s = gl.allocate_shared_memory(gl.bfloat16, [3, BM, BN], dy_sh)
            w_s = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BK], w_sh)
            e64 = e.to(gl.int64)
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
            r_ok = rows < row_end
            rows = rows.to(gl.int64)
            c = gl.arange(0, BN, layout=gl.SliceLayout(0, ld))
            steps = gl.cdiv(N, BN)
            # Prologue: dy of steps 0 and 1 in flight, step 0's weights decoded, step 1's packed weights in registers.
            _copy_dy(dy_s.index(0), dy_ptr, rows, r_ok, c, N, stride_dym)
            _copy_dy(dy_s.index(1), dy_ptr, rows, r_ok, BN + c, N, stride_dym)
            p, s = _load_w(w_ptr, s_ptr, e64, 0, k0, N, K, KB, KS, BN, BK, l3)
            w_s.index(0).store(_decode(p, s, BN, BK))
            p, s = _load_w(w_ptr, s_ptr, e64, BN, k0, N, K, KB, KS, BN, BK, l3)
            acc = gl.zeros([BM, BK], gl.float32, acc_l)
            for i in range(steps):
                async_copy.wait_group(1)  # dy of step i (step i+1's may still be in flight)
                fence_async_shared()  # and step i's decoded weights, stored by every thread
                acc = warpgroup_mma(dy_s.index(i % 3), w_s.index(i % 2), acc, is_async=True)
                # Under step i's MMA: decode step i+1's weights, fetch step i+2's.
                w = _decode(p, s, BN, BK)
                p, s = _load_w(w_ptr, s_ptr, e64, (i + 2) * BN, k0, N, K, KB, KS, BN, BK, l3)
                acc = warpgroup_mma_wait(1, deps=(acc, ))  # step i-1's MMA is done: its buffers are free
                w_s.index((i + 1) % 2).store(w)
                _copy_dy(dy_s.index((i + 2) % 3), dy_ptr, rows, r_ok, (i + 2) * BN + c, N, stride_dym)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            async_copy.wait_group(0)
            out = gl.convert_layout((acc * gl.load(gs_ptr + e)).to(gl.bfloat16), ld)
            cols = k0 + gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
            gl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], out,
                     mask=r_ok[:, None] & (cols < K)[None, :])


def launch_dgrad_gluon(dy, packed, scale, gs, offsets, out, cfg):
    """dx [M, K] bf16 into ``out`` (``nvfp4_moe_gemm.launch_dgrad`` with config GLUON=True): BM 64 or 128 rows
    (4 or 8 warps), BK = BN = 128 unless ``cfg`` says otherwise."""
    import triton

    if _dgrad_gluon is None or not dy.is_cuda or torch.cuda.get_device_capability(dy.device)[0] != 9:
        raise RuntimeError("nvfp4 dgrad config GLUON=True needs Gluon and an sm_90 device")
    e, n, kh = packed.shape
    k, m = kh * 2, dy.shape[0]
    bm, bk, bn = cfg.get("BM", 128), cfg.get("BK", 128), cfg.get("BN", 128)
    if bm not in (64, 128) or n % 8 or dy.stride(0) % 8:
        raise ValueError(f"nvfp4 dgrad GLUON: BM={bm} (expected 64 or 128), N={n} and dy's row stride "
                         f"{dy.stride(0)} (expected multiples of 8)")
    grid = ((triton.cdiv(m, bm) + e) * triton.cdiv(k, bk),)
    _dgrad_gluon[grid](dy, packed.contiguous(), scale.contiguous().view(torch.uint8), gs, offsets, out,
                       n, k, e, kh, k // 16, dy.stride(0), out.stride(0),
                       E_P2=triton.next_power_of_2(e), BM=bm, BK=bk, BN=bn, num_warps=bm // 16)
    return out
