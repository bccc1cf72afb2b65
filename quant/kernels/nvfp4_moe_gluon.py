"""The NVFP4 grouped expert GEMM (``nvfp4_moe_gemm``'s forward and input gradient) written in Gluon for Hopper (sm_90),
warp-specialized: the weight decode runs in its own warps, beside the MMAs instead of between them.

One kernel, two directions: out tile [BM rows, BO] = in[BM, R] @ B[R, BO], R reduced in steps of BR, with the decoded
weight tile as the MMA's B operand in shared memory: B = W_e for the input gradient (in = dy, R = N), W_e^T for the
forward (in = x, R = K). Three partitions share a ring of S stages through mbarriers:
- load (1 warp): the input rows of each step by TMA (rows past the expert's end are loaded and computed, not stored);
- decode (DW warps): the packed codes and E4M3 scales of each step from global memory, decoded in registers (the
  Triton kernels' exact bf16x2 bit trick, ``E2M1_BF16X2_ASM``) and stored to the stage's weight tile;
- MMA (the default partition, num_warps): asynchronous wgmma on each stage once both halves are ready; a stage is
  released when the MMA after it has been issued and the one on it has retired.
Why: the non-specialized Gluon kernel (run37: 0.72-0.78x bf16 at 4K tokens) and the Triton kernels decode in the same
warps that issue the MMAs, so with one program per SM the decode's integer work and the MMAs take turns.

Exactness: the decoded weights are e2m1 * s in bf16 exactly, the same operands as the Triton kernels and the
reference; the global scale multiplies the fp32 accumulator once, then one bf16 round. Rows never straddle experts.

Measured on the H200 (results/gpu/run55, gate_up + down, all 128 M3 experts, top-4): the input gradient at BM=256
with 8 decode warps takes 6.52 / 10.05 / 16.60 / 29.83 ms at 4K / 8K / 16K / 32K tokens, with 4 decode warps 6.88 /
10.81 / 17.32 / 30.93, against 8.04 / 13.28 / 23.71 / 45.02 for the Triton kernel and 6.23 / 8.42 / 14.05 / 24.64 for
bf16 ``torch._grouped_mm``: it is ``launch_dgrad``'s default on sm_90 above ``nvfp4_moe_gemm.GLUON_DGRAD_MIN_ROWS``
rows per expert (and decode + cuBLAS, 28.82 ms at 32K, stays the path from 768, where it is faster). The forward is
slower than the Triton forward kernel (weights decoded straight into the MMA's register operand) at every size
measured, so it stays opt-in there (``config={"GLUON": True, ...}``).

Nsight Compute at 32K tokens (run49, ``ncu_stalls.txt``): the tensor pipe is busy 62% of the time (cuBLAS's grouped
GEMM: 94%) and the MMA warps wait on the decoded tile; the decode warps issue on a fifth of their cycles, bound by
their own dependency chains, and their tile stores had 2-way bank conflicts (fixed: run54). With the conflicts gone,
8 decode warps beat 4 by 4-10% (runs 54-55; within noise before, run39). Variants that did not help: one fma per
decoded pair with the 2^126 folded into the scale (run39); loading the packed words two or three steps ahead
(run50); the decode warps issuing the input TMA in place of a load warp, and 128 x 256 tiles (64x256 wgmma; ptxas
checks its 128 accumulator registers against the launch cap, so that needs no load warp), 1.3x slower at 32K
tokens (run51: the decode per MMA doubles).

PAIRS (opt-in, config ``PAIRS=True``, the weights in ``e2m1_asm``'s pair order): the decode warps' loop drops from 173
to 143 SASS instructions per step (no byte permutes, one multiply per pair). Measured beside the default in the same
calls (runs 65-67, 32K tokens, input gradient): 29.28 vs 30.04, 28.68 vs 30.72 ms; 4K-16K within noise. So the
decode's instruction count is not what holds the kernel at ~0.8x bf16: Nsight Compute (run67) puts the MMA partition
at 65% tensor-pipe busy with a third of all stall samples on barriers (the per-step partition syncs). Not the default:
the trainer stores the serving order, and at its rows per expert the input gradient takes decode + cuBLAS anyway.
"""

import functools

import torch

from quant.kernels.e2m1_asm import E2M1_BF16X2_ASM, E2M1_PAIRS_ASM, PAIRS_ACC_SHIFT, PAIRS_SCALE_UP

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # CPU installs without Triton, or a Triton without Gluon
    gluon = None
    _gemm_ws = None


if gluon is not None:
    _ASM = gl.constexpr(E2M1_BF16X2_ASM)
    _ASM_PAIRS = gl.constexpr(E2M1_PAIRS_ASM)
    _SCALE_UP = gl.constexpr(2.0 ** PAIRS_SCALE_UP)
    _ACC_SHIFT = gl.constexpr(2.0 ** PAIRS_ACC_SHIFT)

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
    def _load_words(w_ptr, s_ptr, e64, r0, c0, N, K, KW, KS, WR: gl.constexpr, WC: gl.constexpr, lw: gl.constexpr):
        # W_e[r0 : r0+WR, c0 : c0+WC] as int32 words [WR, WC/8] (8 codes each), and each word's E4M3 scale byte;
        # zeros outside N x K.
        r = r0 + gl.arange(0, WR, layout=gl.SliceLayout(1, lw))
        j = c0 // 8 + gl.arange(0, WC // 8, layout=gl.SliceLayout(0, lw))
        ok = (r < N)[:, None] & (j < K // 8)[None, :]
        rows = e64 * N + r.to(gl.int64)
        p = gl.load(w_ptr + (rows * KW)[:, None] + j[None, :], mask=ok, other=0)
        s = gl.load(s_ptr + (rows * KS)[:, None] + (j // 2)[None, :], mask=ok, other=0)
        return p, s

    @gluon.jit
    def _decode(p, s, WR: gl.constexpr, WC: gl.constexpr, PAIRS: gl.constexpr):
        # int32 words [WR, WC/8] and their scale bytes -> bf16 [WR, WC], code j of a word at column 8 * word + j.
        # PAIRS: words in e2m1_asm's pair order, decoded to e2m1 * s * 2^-8 (one multiply per pair, no byte permutes).
        if PAIRS:
            sb = (s.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _SCALE_UP).to(gl.bfloat16)
            asm: gl.constexpr = _ASM_PAIRS
        else:
            sb = s.to(gl.float8e4nv, bitcast=True).to(gl.bfloat16)
            asm: gl.constexpr = _ASM
        n0, n1, n2, n3, n4, n5, n6, n7 = gl.inline_asm_elementwise(
            asm, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [p, sb],
            dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16,
                   gl.bfloat16), is_pure=True, pack=1)
        t = gl.join(gl.join(gl.join(n0, n4), gl.join(n2, n6)), gl.join(gl.join(n1, n5), gl.join(n3, n7)))
        return gl.reshape(t, [WR, WC])

    @gluon.jit
    def _step_words(w_ptr, s_ptr, e64, o0, i, N, K, KW, KS, WR: gl.constexpr, WC: gl.constexpr, DGRAD: gl.constexpr,
                    lw: gl.constexpr):
        # Packed weights of reduction step i: W_e[i*WR.., o0..] (input gradient) or W_e[o0.., i*WC..] (forward).
        if DGRAD:
            p, s = _load_words(w_ptr, s_ptr, e64, i * WR, o0, N, K, KW, KS, WR, WC, lw)
        else:
            p, s = _load_words(w_ptr, s_ptr, e64, o0, i * WC, N, K, KW, KS, WR, WC, lw)
        return p, s

    @gluon.jit
    def _ws_load(in_desc, in_s, ready, empty, row0, n_steps):
        # TMA of each step's input rows [BM, BR] into the ring, once the MMA has released the stage.
        S: gl.constexpr = in_s.type.shape[0]
        BR: gl.constexpr = in_s.type.shape[2]
        for i in range(n_steps):
            b = i % S
            mbarrier.wait(empty.index(b), ((i // S) & 1) ^ 1)
            mbarrier.expect(ready.index(b), in_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(in_desc, [row0, i * BR], ready.index(b), in_s.index(b))

    @gluon.jit
    def _ws_decode(w_ptr, s_ptr, w_s, ready, empty, e, o0, n_steps, N, K, KW, KS, DGRAD: gl.constexpr,
                   DW: gl.constexpr, PAIRS: gl.constexpr):
        # Each step's weight tile decoded into the ring; the next step's packed words load while this one decodes.
        S: gl.constexpr = w_s.type.shape[0]
        WR: gl.constexpr = w_s.type.shape[1]
        WC: gl.constexpr = w_s.type.shape[2]
        # 16-byte loads; consecutive threads take consecutive rows (order [0, 1]), so that each quarter-warp's
        # 16-byte stores of the decoded tile land in 8 different bank groups of the 128-byte swizzle. With the
        # columns first ([1, 0]) a quarter-warp of the input gradient's tile wrote two rows at 4 column chunks whose
        # swizzled bank groups pair up: 8 wavefronts per store instead of 4 (Nsight Compute, run49; run54: 4).
        lw: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (WC // 32), WC // 32], [DW, 1], [0, 1])
        e64 = e.to(gl.int64)
        p, s = _step_words(w_ptr, s_ptr, e64, o0, 0, N, K, KW, KS, WR, WC, DGRAD, lw)
        for i in range(n_steps):
            b = i % S
            w = _decode(p, s, WR, WC, PAIRS)
            p, s = _step_words(w_ptr, s_ptr, e64, o0, i + 1, N, K, KW, KS, WR, WC, DGRAD, lw)
            mbarrier.wait(empty.index(b), ((i // S) & 1) ^ 1)
            w_s.index(b).store(w)
            fence_async_shared()  # the generic-proxy stores before the MMA's async-proxy reads
            mbarrier.arrive(ready.index(b), count=1)

    @gluon.jit
    def _ws_mma(in_s, w_s, in_ready, w_ready, empty, n_steps, DGRAD: gl.constexpr, num_warps: gl.constexpr):
        S: gl.constexpr = in_s.type.shape[0]
        BM: gl.constexpr = in_s.type.shape[1]
        BO: gl.constexpr = w_s.type.shape[2] if DGRAD else w_s.type.shape[1]
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BO, 16])
        acc = gl.zeros([BM, BO], gl.float32, acc_l)
        for i in range(n_steps):
            b = i % S
            ph = (i // S) & 1
            mbarrier.wait(in_ready.index(b), ph)
            mbarrier.wait(w_ready.index(b), ph)
            if DGRAD:
                acc = warpgroup_mma(in_s.index(b), w_s.index(b), acc, is_async=True)
            else:
                acc = warpgroup_mma(in_s.index(b), w_s.index(b).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))  # step i-1's MMA has retired: release its stage
            # one barrier frees both halves of the stage (one partition-wide sync and arrive per step, not two)
            mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
        # The epilogue runs after the region, where these warps get the workers' registers back: inside it, the
        # accumulator and its layout conversion spill at BM=256 (sm_90 compile, scripts/expert_kernel_resources.py).
        return (warpgroup_mma_wait(0, deps=(acc, )), )  # the default partition's results are a tuple

    @gluon.jit
    def _gemm_ws(in_desc, w_ptr, s_ptr, gs_ptr, off_ptr, out_ptr, N, K, E, KW, KS, stride_out,
                 E_P2: gl.constexpr, BM: gl.constexpr, BO: gl.constexpr, BR: gl.constexpr, S: gl.constexpr,
                 DGRAD: gl.constexpr, DW: gl.constexpr, DREGS: gl.constexpr, PAIRS: gl.constexpr,
                 num_warps: gl.constexpr):
        # out tile [BM, BO] = in[BM, R] @ B[R, BO]; the weight tile in shared memory is [W rows, W cols].
        WR: gl.constexpr = BR if DGRAD else BO
        WC: gl.constexpr = BO if DGRAD else BR
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        v1: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        r_cols = N if DGRAD else K
        o_cols = K if DGRAD else N

        pid = gl.program_id(0)
        num_o = gl.cdiv(o_cols, BO)
        pid_m = pid // num_o
        o0 = (pid % num_o) * BO
        e, row0, row_end, valid = _tile(off_ptr, E, pid_m, E_P2, BM, v1)
        if valid:
            in_s = gl.allocate_shared_memory(gl.bfloat16, [S, BM, BR], in_desc.layout)
            w_s = gl.allocate_shared_memory(gl.bfloat16, [S, WR, WC],
                                            gl.NVMMASharedLayout.get_default_for([WR, WC], gl.bfloat16))
            in_ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
            w_ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
            for b in gl.static_range(S):
                mbarrier.init(in_ready.index(b), count=1)
                mbarrier.init(w_ready.index(b), count=1)
                mbarrier.init(empty.index(b), count=1)
            n_steps = gl.cdiv(r_cols, BR)
            acc, = gl.warp_specialize([
                (_ws_mma, (in_s, w_s, in_ready, w_ready, empty, n_steps, DGRAD, num_warps)),
                (_ws_load, (in_desc, in_s, in_ready, empty, row0.to(gl.int32), n_steps)),
                (_ws_decode, (w_ptr, s_ptr, w_s, w_ready, empty, e, o0, n_steps, N, K, KW, KS, DGRAD, DW, PAIRS)),
            ], [1, DW], [24, DREGS])
            gsc = gl.load(gs_ptr + e)
            if PAIRS:
                gsc = gsc * _ACC_SHIFT
            out = gl.convert_layout((acc * gsc).to(gl.bfloat16), ld)
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
            cols = o0 + gl.arange(0, BO, layout=gl.SliceLayout(0, ld))
            gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_out + cols[None, :], out,
                     mask=(rows < row_end)[:, None] & (cols < o_cols)[None, :])


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def gluon_usable(t: torch.Tensor) -> bool:
    """Whether the Gluon kernel can run on ``t``'s device: Gluon importable and an sm_90 GPU."""
    return _gemm_ws is not None and t.is_cuda and _sm90(t.device.index if t.device.index is not None else
                                                        torch.cuda.current_device())


def ws_config(cfg: dict) -> dict:
    """The warp-specialized kernel's tiles from a launch config: BM rows (64 / 128 / 256), BO output columns per
    program, BR reduction columns per step (64: one 128-byte TMA box of bf16), S stages, WARPS for the MMA partition
    (4 or 8; 8 at BM=256), DW decode warps (4 or 8) with DREGS registers each (default 128 for 4, 64 for 8)."""
    bm = cfg.get("BM", 128)
    out = dict(BM=bm, BO=cfg.get("BO", 128), BR=cfg.get("BR", 64), S=cfg.get("S", 4),
               WARPS=cfg.get("WARPS", 8 if bm == 256 else 4), DW=cfg.get("DW", 4), PAIRS=bool(cfg.get("PAIRS")))
    out["DREGS"] = cfg.get("DREGS", 128 if out["DW"] == 4 else 64)  # 64: 8 decode warps beside 8 MMA warps
    if bm not in (64, 128, 256) or out["BR"] != 64 or out["WARPS"] not in (4, 8) or out["DW"] not in (4, 8):
        raise ValueError(f"nvfp4 expert GEMM GLUON config {out}: BM 64/128/256, BR 64, WARPS 4/8, DW 4/8")
    return out


def ws_maxnreg(c: dict) -> int:
    """Registers per thread for the launch (a multiple of 8): one program per SM's 64K registers over all warps; the
    load partition's one warp holds a warpgroup's registers, and the MMA partition gets what the workers leave."""
    return min(256, 65536 // (32 * (c["WARPS"] + c["DW"] + 4))) // 8 * 8


def launch_gluon(inp, packed, scale, gs, offsets, out, cfg, dgrad: bool):
    """The warp-specialized kernel for ``nvfp4_moe_gemm.launch_fwd`` / ``launch_dgrad`` with config GLUON=True,
    into ``out``; tiles from ``ws_config(cfg)``."""
    import triton

    if not gluon_usable(inp):
        raise RuntimeError("nvfp4 expert GEMM config GLUON=True needs Gluon and an sm_90 device")
    c = ws_config(cfg)
    e, n, kh = packed.shape
    k, m = kh * 2, inp.shape[0]
    if k % 16 or inp.stride(1) != 1 or inp.stride(0) % 8 or inp.data_ptr() % 16:  # TMA: 16-byte aligned rows
        raise ValueError(f"nvfp4 expert GEMM GLUON: K={k} must be a multiple of 16 and the input rows contiguous "
                         f"with a 16-byte aligned start and stride (stride {inp.stride()})")
    o_cols = k if dgrad else n
    layout = gl.NVMMASharedLayout.get_default_for([c["BM"], c["BR"]], gl.bfloat16)
    desc = TensorDescriptor.from_tensor(inp, [c["BM"], c["BR"]], layout)
    words = packed.contiguous().view(torch.int32)
    grid = ((triton.cdiv(m, c["BM"]) + e) * triton.cdiv(o_cols, c["BO"]),)
    _gemm_ws[grid](desc, words, scale.contiguous().view(torch.uint8), gs, offsets, out, n, k, e, words.shape[-1],
                   k // 16, out.stride(0), E_P2=triton.next_power_of_2(e), BM=c["BM"], BO=c["BO"], BR=c["BR"],
                   S=c["S"], DGRAD=dgrad, DW=c["DW"], DREGS=c["DREGS"], PAIRS=c["PAIRS"], num_warps=c["WARPS"],
                   maxnreg=ws_maxnreg(c))
    return out
