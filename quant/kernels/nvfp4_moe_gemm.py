"""The fused Triton kernels behind ``quant.kernels.nvfp4_moe`` (its path below ``DEQUANT_MIN_ROWS`` rows per
expert): an NVFP4 grouped GEMM over expert-sorted rows and its input gradient, their tile configs and launchers.
Inputs in the layout ``nvfp4_moe`` describes; the launchers take them checked and on the device.

Kernels (one per direction, plain ``tl.dot`` on bf16 tiles, fp32 accumulators):
- the weight tile is decoded in registers: e2m1 * s is exact in bf16 (2 significant bits times
  4), so the GEMM operands are bit-identical to the reference's; only the fp32 accumulation order
  differs. The global scale multiplies the fp32 accumulator in the epilogue, then one bf16 round.
- tiles never straddle experts: each program finds its expert from the offsets (a prefix sum over
  the per-expert tile counts, computed in the kernel, so there is no host sync and any number of
  rows per expert works); the grid is sized for the worst case, cdiv(M, BM) + E row tiles.
- forward computes the transposed tile (weights as the MMA's M side, tokens as its N side), so a
  handful of tokens per expert still fills a 16-wide MMA and the kernel streams the packed weights.
- two decoders: "triton" (portable tl ops: nibble -> fp16 bit pattern, x 2^14 * s in fp32) and
  "asm" (8 nibbles of one 32-bit word at a time, bf16x2 fma; about 2 integer instructions per
  element instead of 4-5, an estimate from the instruction mix; needs sm80+), the default: 1.23x
  faster at 64 tokens, 1.39x at 32768. Both are exact.

Measured on one H200 (torch 2.11, Triton 3.6; results/gpu/bench_expert_gemm.json with the first
configs, results/gpu/run3/expert_small.json for BN=64), all 128 M3 experts (gate_up 6144->6144,
down 3072->6144), top-4 uniform routing, asm decoder:

    tokens  fwd gate_up+down   bf16 _grouped_mm   input grad   bf16     weight floor (4.24 TB/s)
    64       1.98 ms (BN=64)    4.00 ms            2.01 ms      3.97 ms  0.81 ms
    512      3.31 ms (BN=64)    4.60 ms            3.35 ms      4.54 ms  0.96 ms
    4096     6.92 ms            6.17 ms            7.75 ms      6.18 ms  0.96 ms
    32768   29.6 ms (BM=256)   24.3 ms            45.0 ms      24.4 ms  0.96 ms

Few tokens: the kernel is bound by the integer work of the decode, not by HBM (2.7x the weight
floor at 64 tokens; the "triton" decoder is 1.23x slower still). At 512 tokens the BM=16 tile
splits the ~16-30 rows of most experts into two tiles, decoding the weights twice. Many tokens:
380 TFLOP/s with BM=128; the BM=256 tile (the default there) 19.5 + 10.1 = 29.6 ms at 32768 tokens
(about 500 TFLOP/s).

Run 11 (results/gpu/run11/bench_expert.json) re-measured these: 1.97 / 3.36 / 6.63 / 29.4 ms forward and 2.00 /
3.35 / 7.84 / 45.1 ms input gradient at 64 / 512 / 4096 / 32768 tokens; at many rows per expert the decode +
cuBLAS path of ``nvfp4_dequant`` is faster (28.6 / 28.4 ms at 32768), which ``nvfp4_moe`` picks there.

Triton is imported when a kernel is first launched (``_kernels``); callers check ``triton_available`` first.
"""

import functools

import torch

from quant.kernels._triton import triton_version
from quant.kernels.e2m1_asm import PAIRS_ACC_SHIFT, triton_decoders

__all__ = ["DECODERS", "DEFAULT_DECODER", "LARGE_M_CONFIG_BM256", "dgrad_config", "fwd_config", "launch_dgrad",
           "launch_fwd"]


# ---------------------------------------------------------------------------------------------
# Triton kernels (built on first use)


@functools.lru_cache(maxsize=None)
def _kernels():
    # Triton is optional (CPU installs lack it): imported on the first launch on a CUDA tensor
    import triton
    import triton.language as tl

    dec = triton_decoders()
    _decode_tl, _decode_asm = dec.decode_tl, dec.decode_asm
    acc_shift = tl.constexpr(2.0 ** PAIRS_ACC_SHIFT)

    @triton.jit
    def _tile(off_ptr, E, pid_m, E_P2: tl.constexpr, BM: tl.constexpr):
        # Row tile pid_m -> (expert, first row, end row of that expert, valid). Tiles are laid out
        # expert by expert, cdiv(rows_e, BM) each.
        idx = tl.arange(0, E_P2)
        em = idx < E
        start = tl.load(off_ptr + idx, mask=em, other=0)
        end = tl.load(off_ptr + idx + 1, mask=em, other=0)
        nt = (end - start + BM - 1) // BM
        cum = tl.cumsum(nt, 0)
        total = tl.sum(nt, 0)
        e = tl.sum((cum <= pid_m).to(tl.int32), 0)
        sel = idx == e
        first = tl.sum(tl.where(sel, cum - nt, 0), 0)
        row0 = tl.sum(tl.where(sel, start, 0), 0) + (pid_m - first) * BM
        row_end = tl.sum(tl.where(sel, end, 0), 0)
        return e, row0, row_end, pid_m < total

    @triton.jit
    def _load_w(w_ptr, s_ptr, e64, rows, r_ok, kw0, ks0, N, KW, KS,
                R: tl.constexpr, BK: tl.constexpr, WPB: tl.constexpr, DECODE: tl.constexpr,
                EVEN: tl.constexpr):
        # Decoded weight tile [R, BK] of expert e (rows ``rows``); the row's storage words
        # (int32 for the asm decoder, bytes otherwise) start at kw0, its scales at ks0.
        offs_w = kw0 + tl.arange(0, WPB)
        offs_s = ks0 + tl.arange(0, BK // 16)
        rows64 = rows.to(tl.int64)
        wp = w_ptr + e64 * N * KW + rows64[:, None] * KW + offs_w[None, :]
        sp = s_ptr + e64 * N * KS + rows64[:, None] * KS + offs_s[None, :]
        if EVEN:
            p = tl.load(wp, mask=r_ok[:, None], other=0)
            s = tl.load(sp, mask=r_ok[:, None], other=0)
        else:
            p = tl.load(wp, mask=r_ok[:, None] & (offs_w < KW)[None, :], other=0)
            s = tl.load(sp, mask=r_ok[:, None] & (offs_s < KS)[None, :], other=0)
        if DECODE >= 1:
            w = _decode_asm(p, s, R, BK, DECODE == 2)
        else:
            w = _decode_tl(p, s, R, BK)
        return w

    @triton.jit
    def _fwd_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, off_ptr, y_ptr,
                    N, K, E, KW, KS, stride_xm, stride_ym,
                    E_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    WPB: tl.constexpr, DECODE: tl.constexpr, EVEN_K: tl.constexpr):
        # y^T tile [BN, BM] = W_e[BN, K] @ x[BM, K]^T: the weight rows are the MMA's M side.
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BN)
        pid_m = pid // num_n
        pid_n = pid % num_n
        e, row0, row_end, valid = _tile(off_ptr, E, pid_m, E_P2, BM)
        if valid:
            e64 = e.to(tl.int64)
            offs_m = row0 + tl.arange(0, BM)
            m_ok = offs_m < row_end
            offs_n = pid_n * BN + tl.arange(0, BN)
            n_ok = offs_n < N
            offs_k = tl.arange(0, BK)
            x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for i in range(0, tl.cdiv(K, BK)):
                if EVEN_K:
                    xt = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                else:
                    xt = tl.load(x_ptrs, mask=m_ok[:, None] & (i * BK + offs_k < K)[None, :], other=0.0)
                w = _load_w(w_ptr, s_ptr, e64, offs_n, n_ok, i * WPB, i * (BK // 16), N, KW, KS,
                            BN, BK, WPB, DECODE, EVEN_K)
                acc = tl.dot(w, tl.trans(xt), acc)
                x_ptrs += BK
            gs = tl.load(gs_ptr + e)
            if DECODE == 2:
                gs = gs * acc_shift
            out = (acc * gs).to(tl.bfloat16)
            y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
            tl.store(y_ptrs, out, mask=n_ok[:, None] & m_ok[None, :])

    @triton.jit
    def _dgrad_kernel(dy_ptr, w_ptr, s_ptr, gs_ptr, off_ptr, dx_ptr,
                      N, K, E, KW, KS, stride_dym, stride_dxm,
                      E_P2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                      WPB: tl.constexpr, DECODE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                      SWAP: tl.constexpr):
        # dx tile [BM, BK] = dy[BM, N] @ W_e[N, BK], reducing over N in steps of BN.
        pid = tl.program_id(0)
        num_k = tl.cdiv(K, BK)
        pid_m = pid // num_k
        pid_k = pid % num_k
        e, row0, row_end, valid = _tile(off_ptr, E, pid_m, E_P2, BM)
        if valid:
            e64 = e.to(tl.int64)
            offs_m = row0 + tl.arange(0, BM)
            m_ok = offs_m < row_end
            offs_k = pid_k * BK + tl.arange(0, BK)
            k_ok = offs_k < K
            offs_n = tl.arange(0, BN)
            dy_ptrs = dy_ptr + offs_m.to(tl.int64)[:, None] * stride_dym + offs_n[None, :]
            if SWAP:
                acc = tl.zeros((BK, BM), dtype=tl.float32)
            else:
                acc = tl.zeros((BM, BK), dtype=tl.float32)
            for i in range(0, tl.cdiv(N, BN)):
                rows = i * BN + offs_n
                r_ok = rows < N
                if EVEN_N:
                    g = tl.load(dy_ptrs, mask=m_ok[:, None], other=0.0)
                else:
                    g = tl.load(dy_ptrs, mask=m_ok[:, None] & r_ok[None, :], other=0.0)
                w = _load_w(w_ptr, s_ptr, e64, rows, r_ok, pid_k * WPB, pid_k * (BK // 16), N, KW, KS,
                            BN, BK, WPB, DECODE, EVEN_K)
                if SWAP:
                    acc = tl.dot(tl.trans(w), tl.trans(g), acc)
                else:
                    acc = tl.dot(g, w, acc)
                dy_ptrs += BN
            gs = tl.load(gs_ptr + e)
            if DECODE == 2:
                gs = gs * acc_shift
            out = (acc * gs).to(tl.bfloat16)
            if SWAP:
                dx_ptrs = dx_ptr + offs_m.to(tl.int64)[None, :] * stride_dxm + offs_k[:, None]
                tl.store(dx_ptrs, out, mask=k_ok[:, None] & m_ok[None, :])
            else:
                dx_ptrs = dx_ptr + offs_m.to(tl.int64)[:, None] * stride_dxm + offs_k[None, :]
                tl.store(dx_ptrs, out, mask=m_ok[:, None] & k_ok[None, :])

    return triton, _fwd_kernel, _dgrad_kernel


# ---------------------------------------------------------------------------------------------
# Launch configuration

# "pairs": the asm decoder on weights the caller passed in e2m1_asm's pair order (``to_pair_order``); opt-in at
# this level only (nvfp4_moe_linear takes the serving order). Runs 65-67: 2-7% faster than "asm" at 64-512 and 32K
# tokens (e.g. forward 1.88 vs 1.97 ms at 64 tokens, 3.18 vs 3.41 at 512), within noise at 4K-16K.
DECODERS = {"triton": 0, "asm": 1, "pairs": 2}
DEFAULT_DECODER = "asm"


def fwd_config(m: int, num_experts: int) -> dict:
    """Tile config for the forward by the average rows per expert (tokens are the MMA's N side)."""
    avg = m / max(num_experts, 1)
    if avg <= 16:  # BN=64: twice the programs over the weight rows (results/gpu/run3/expert_small.json)
        return dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4)
    if avg <= 32:
        return dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=4)
    if avg <= 96:
        return dict(BM=64, BN=128, BK=128, num_warps=4, num_stages=4)
    if triton_version() >= (3, 8):
        # Triton 3.8 (torch 2.14) passes the decoded weight tile through shared memory too (+32 KB here): with 3
        # stages this tile needs 246 KB, over sm_90's 227 KB, and would not launch; 2 stages: 173 KB
        # (results/triton_versions.json; not timed: the H200 has Triton 3.6)
        return dict(LARGE_M_CONFIG_BM256, num_stages=2)
    return LARGE_M_CONFIG_BM256


# The large-token bucket (results/gpu/bench_expert_gemm.json variants; exact in test_nvfp4_moe_config_variants)
LARGE_M_CONFIG_BM256 = dict(BM=256, BN=128, BK=128, num_warps=8, num_stages=3)


def dgrad_config(m: int, num_experts: int) -> dict:
    """Tile config for the input gradient (SWAP: the weights on the MMA's M side, for few rows)."""
    avg = m / max(num_experts, 1)
    if avg <= 16:
        return dict(BM=16, BK=128, BN=64, num_warps=4, num_stages=4, SWAP=True)
    if avg <= 32:
        return dict(BM=32, BK=128, BN=64, num_warps=4, num_stages=4, SWAP=True)
    if avg <= 96:
        return dict(BM=64, BK=128, BN=64, num_warps=4, num_stages=4, SWAP=False)
    return dict(BM=128, BK=128, BN=128, num_warps=8, num_stages=3, SWAP=False)


# The input gradient's default on sm_90 above this many rows per expert (average): the warp-specialized Gluon kernel
# of ``nvfp4_moe_gluon`` with BM=256 and 8 decode warps, where the Triton kernel's decode and MMAs take turns.
# Measured on the H200 (results/gpu/run55, gate_up + down, one call) at 128 / 256 / 512 rows per expert: 6.52 / 10.05
# / 16.60 ms, with 4 decode warps 6.88 / 10.81 / 17.32, Triton 8.04 / 13.28 / 23.71, bf16 6.23 / 8.42 / 14.05.
GLUON_DGRAD_MIN_ROWS = 96
GLUON_DGRAD_CONFIG = dict(GLUON=True, BM=256, DW=8, DREGS=64)


def gluon_available(t) -> bool:
    """Whether the Gluon kernel can run on ``t``'s device (Gluon importable, sm_90)."""
    if not t.is_cuda:
        return False
    from quant.kernels.nvfp4_moe_gluon import gluon_usable  # imports Triton and Gluon: CUDA callers only

    return gluon_usable(t)


def gluon_dgrad_device(t, decoder=None) -> bool:
    """Whether the input gradient's kernel path on ``t``'s device takes the Gluon kernel for large enough calls: an
    sm_90 device with Gluon, and the default decoder (the Gluon kernel has only that one)."""
    return (decoder or DEFAULT_DECODER) == DEFAULT_DECODER and gluon_available(t)


def gluon_fwd_default(x, m: int, num_experts: int, decoder=None) -> bool:
    """Whether ``launch_fwd`` without a config runs the Gluon kernel (``GLUON_DGRAD_CONFIG``'s tiles): under Triton
    3.8+ only, above ``GLUON_DGRAD_MIN_ROWS`` rows per expert. 3.8 splits this forward's 128-deep dot in two and takes
    half of the decoded tile through shared memory (results/triton_versions.json), 1.4-1.5x slower than under 3.6; the
    Gluon kernel lays its tiles out itself. Run129 (an H100, Triton 3.8, gate_up + down): 4K tokens 7.71 ms against
    9.82 for the Triton kernel (3.6: Triton 6.51, Gluon 7.65; run128 on an H200: 7.77 against 10.09)."""
    return triton_version() >= (3, 8) and gluon_dgrad_default(x, m, num_experts, decoder)


def gluon_dgrad_default(dy, m: int, num_experts: int, decoder=None) -> bool:
    """Whether ``launch_dgrad`` without a config runs the Gluon kernel for these rows of ``dy`` (contiguous; its TMA
    needs 16-byte aligned rows)."""
    return (m > GLUON_DGRAD_MIN_ROWS * num_experts and dy.shape[-1] % 8 == 0 and dy.data_ptr() % 16 == 0
            and gluon_dgrad_device(dy, decoder))


def _prep(packed, scale, decoder):
    """(weight words, scale bytes, words per row) for the kernels; views, no copies if contiguous."""
    packed = packed.contiguous()
    scale = scale.contiguous().view(torch.uint8)
    if decoder in ("asm", "pairs"):
        if packed.shape[-1] % 4 != 0:
            raise ValueError("the asm decoder needs K to be a multiple of 8")
        words = packed.view(torch.int32)
    else:
        words = packed
    return words, scale, words.shape[-1]


def launch_fwd(x, packed, scale, gs, offsets, out=None, config=None, decoder=None):
    """Forward kernel: y [M, N] bf16 (into ``out`` if given); ``config`` overrides ``fwd_config``'s tiles;
    ``config={"GLUON": True, ...}`` runs the Gluon kernel of ``nvfp4_moe_gluon`` instead (sm_90; slower than these
    forward kernels at 4K-32K tokens under Triton 3.6, run38; the default under 3.8: ``gluon_fwd_default``)."""
    triton, fwd_kernel, _ = _kernels()
    e, n, kh = packed.shape
    k = kh * 2
    m = x.shape[0]
    decoder = decoder or DEFAULT_DECODER
    x = x.contiguous()
    if config is None and gluon_fwd_default(x, m, e, decoder):
        config = GLUON_DGRAD_CONFIG
    cfg = dict(fwd_config(m, e), **(config or {}))
    words, sbytes, kw = _prep(packed, scale, decoder)
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    if cfg.get("GLUON"):
        from quant.kernels.nvfp4_moe_gluon import launch_gluon  # imports Triton and Gluon: only on this opt-in path

        return launch_gluon(x, packed, scale, gs, offsets, out, cfg, dgrad=False)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    grid = ((triton.cdiv(m, bm) + e) * triton.cdiv(n, bn),)
    fwd_kernel[grid](
        x, words, sbytes, gs, offsets, out,
        n, k, e, kw, k // 16, x.stride(0), out.stride(0),
        E_P2=triton.next_power_of_2(e), BM=bm, BN=bn, BK=bk, WPB=bk // 8 if DECODERS[decoder] else bk // 2,
        DECODE=DECODERS[decoder], EVEN_K=(k % bk == 0),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def launch_dgrad(dy, packed, scale, gs, offsets, out=None, config=None, decoder=None):
    """Input-gradient kernel: dx [M, K] bf16 (into ``out`` if given); ``config`` overrides ``dgrad_config``'s tiles;
    ``config={"GLUON": True, ...}`` runs the Gluon kernel of ``nvfp4_moe_gluon`` instead (sm_90), the default there
    above ``GLUON_DGRAD_MIN_ROWS`` rows per expert."""
    triton, _, dgrad_kernel = _kernels()
    e, n, kh = packed.shape
    k = kh * 2
    m = dy.shape[0]
    decoder = decoder or DEFAULT_DECODER
    dy = dy.contiguous()
    if config is None and gluon_dgrad_default(dy, m, e, decoder):
        config = GLUON_DGRAD_CONFIG
    cfg = dict(dgrad_config(m, e), **(config or {}))
    words, sbytes, kw = _prep(packed, scale, decoder)
    if out is None:
        out = torch.empty(m, k, dtype=torch.bfloat16, device=dy.device)
    if m == 0:
        return out
    if cfg.get("GLUON"):
        from quant.kernels.nvfp4_moe_gluon import launch_gluon  # imports Triton and Gluon: only on this opt-in path

        return launch_gluon(dy, packed, scale, gs, offsets, out, cfg, dgrad=True)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    grid = ((triton.cdiv(m, bm) + e) * triton.cdiv(k, bk),)
    dgrad_kernel[grid](
        dy, words, sbytes, gs, offsets, out,
        n, k, e, kw, k // 16, dy.stride(0), out.stride(0),
        E_P2=triton.next_power_of_2(e), BM=bm, BK=bk, BN=bn, WPB=bk // 8 if DECODERS[decoder] else bk // 2,
        DECODE=DECODERS[decoder], EVEN_K=(k % bk == 0), EVEN_N=(n % bn == 0), SWAP=cfg["SWAP"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
