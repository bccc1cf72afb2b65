"""NVFP4 routed experts at many tokens per expert: dequantize to bf16, then cuBLAS, in the same serving form as
``quant.kernels.nvfp4_moe`` (``quant.forms.nvfp4_linear(..., "hopper")``):

    y_e  = bf16(fp32acc(x_e @ (e2m1 * s)_e^T) * gs[e])        dx_e = bf16(fp32acc(dy_e @ (e2m1 * s)_e) * gs[e])

The weights of a chunk of experts are decoded into a transient bf16 buffer (e2m1 * s is exact in bf16, so the GEMM
operands are bit-identical to the reference's), and each expert's rows run one cuBLAS GEMM whose alpha is gs[e]:
cuBLAS scales the fp32 accumulator by alpha before its single rounding to bf16, which is where the serving form
applies the global scale. (``torch._grouped_mm`` rounds to bf16 first and has no per-group alpha, so folding gs into
it would round twice.) The input gradient decodes again, unless the forward decoded ``into`` a buffer the caller
keeps (``nvfp4_moe_linear(keep_decoded=True)``, for calls recomputed under activation checkpointing).

Why: the fused Triton kernels decode every weight tile once per row tile, so at thousands of rows per expert the
decode work grows with the rows while the GEMM here runs at cuBLAS's rate on a decode done once per call. Below
that the decode (0.5625 B read + 2 B written per weight: 18.6 GB, 4.8 ms for all 128 M3 experts' gate_up + down at
3.9 TB/s) is not paid back; ``nvfp4_moe`` picks the path per call from the rows per expert.

The decode kernel (``launch_decode``) runs the GEMMs' bf16x2 asm on one 32-bit word per thread: 3.9 TB/s for a chunk
of 8 experts on the H200 against 4.2 for a bf16 copy of the decoded size (run77); its integer-field decode, which
it keeps for the CPU interpreter, was compute-bound at ~3.0.

``overlap``: decode chunk i+1 on a high-priority side stream while chunk i's GEMMs run (two buffers, or the slices of
``into``). At 32K tokens (runs 77-80, gate_up + down): forward 26.9-27.6 ms, input gradient 26.5-27.9 against
25.1-25.9 for bf16 _grouped_mm in the same calls (0.90-0.98x over four calls; run 11, with the old decode: 28.6 /
28.4, 0.86x / 0.89x); the overlap hides 1.4-1.6 ms of the input gradient's decode and little of the forward's
(cuBLAS's forward GEMMs keep the SMs).
Per expert, cuBLAS's GEMMs here run ~10% faster than _grouped_mm's grouped kernel on the same rows.
"""

import functools

import torch

from quant import forms
from quant.kernels.e2m1_asm import triton_decoders

__all__ = ["CHUNK_EXPERTS", "nvfp4_dequantize", "dequant_fwd", "dequant_dgrad"]

CHUNK_EXPERTS = 8  # 8 x 6144 x 6144 bf16 = 0.6 GB per buffer at M3's gate_up


# The decode kernel's tiles: ROWS rows of 64 codes of the flat code stream per program, WARPS warps (4 x 64 rows: 4
# words per thread). Run77 on the H200: 3.96 / 3.87 TB/s for 8 experts' gate_up / down, 1-3% above the other tiles
# (128 or 256 rows, 4 or 8 warps), against 4.2 TB/s for a bf16 copy of the decoded size.
ROWS, WARPS = 64, 4


@functools.lru_cache(maxsize=None)
def _kernel():
    # Triton is optional (CPU installs lack it): imported on the first launch on a CUDA tensor
    import triton
    import triton.language as tl

    dec = triton_decoders()
    scale_bf16, decode_words = dec.scale_bf16, dec.decode_words

    @triton.jit(do_not_specialize=["one"])
    def _dequant_kernel(w_ptr, p_ptr, s_ptr, out_ptr, groups, one, R: tl.constexpr, ASM: tl.constexpr,
                        EVEN: tl.constexpr):
        # The flat code stream as rows of 64 codes: 8 int32 words (32 bytes) and 4 scale bytes (16 codes share one)
        # per row; `groups` 16-code groups in all (EVEN: a multiple of 4 * R, no masks). ASM: the words through the
        # GEMMs' bf16x2 decode (~50 sm_90 instructions per word with its loads and store; the integer fields of
        # the other branch take ~15 per code, which held this kernel to ~3.0 TB/s on the H200, run42); else the
        # bytes' integer fields as fp32 bits (no fp8 type or asm: the same code runs under the CPU interpreter).
        pid = tl.program_id(0).to(tl.int64)
        if ASM:
            # The words as one flat run, one per thread (row r's word w at 8r + w), each with its scale byte beside
            # it: `one` is 1 at run time but unknown to the compiler, so the loads stay 4 bytes wide with consecutive
            # lanes on consecutive words, and each thread's 8 decoded codes are the 16-byte vector of the store.
            # Flat, not [8, R] or [R, 8]: with two dims of unknown contiguity Triton 3.6 puts the lanes on the first
            # and 3.7/3.8 on the last, and the dim that is not the words gives 32-byte strided loads and 128-byte
            # strided stores (3.6x slower under 3.8 on an H100, run129). (Loaded 16 bytes per thread, Triton moved
            # the decoded tile through shared memory to the store's layout: 17 barriers per program.)
            j = pid * (8 * R) + tl.arange(0, 8 * R)
            wi = (j // 8) * 8 + (j % 8) * one
            if EVEN:
                p32 = tl.load(w_ptr + wi)
                sb = scale_bf16(tl.load(s_ptr + wi // 2), False)
            else:
                ok = wi < 2 * groups
                p32 = tl.load(w_ptr + wi, mask=ok, other=0)
                sb = scale_bf16(tl.load(s_ptr + wi // 2, mask=ok, other=0), False)
            w = tl.reshape(decode_words(p32, sb, False), (8 * R, 8))
            o = j[:, None] * 8 + tl.arange(0, 8)[None, :]
        else:  # written out here: the interpreter does not see jit helpers defined in this closure
            r = pid * R + tl.arange(0, R)
            pi = r[:, None] * 32 + tl.arange(0, 32)[None, :]
            q = tl.load(p_ptr + pi, mask=pi < 8 * groups, other=0).to(tl.int32)
            g = r[:, None] * 4 + tl.arange(0, 4)[None, :]
            b = tl.load(s_ptr + g, mask=g < groups, other=0).to(tl.int32)
            # E4M3 scale: exponent field > 0 is (1 + man/8) * 2^(exp-7); 0 is man * 2^-9; 0x7F/0xFF NaN
            sign = b & 0x80
            exp = (b >> 3) & 0xF
            man = b & 7
            s = ((sign << 24) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
            sub = (man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | (sign << 24)  # signs as bits
            s = tl.where(exp == 0, sub.to(tl.float32, bitcast=True), s)
            s = tl.where((b & 0x7F) == 0x7F, float("nan"), s)
            # E2M1 codes (sign, e1 e0 m), two per byte, low nibble first: e > 0 is (1 + m/2) * 2^(e-1); e = 0 is
            # m/2 (0.5 = 0x3F000000)
            lo_c = q & 0xF
            hi_c = q >> 4
            lo_e = (lo_c & 7) >> 1
            hi_e = (hi_c & 7) >> 1
            lo_m = lo_c & 1
            hi_m = hi_c & 1
            lo = tl.where(lo_e == 0, lo_m * 0x3F000000, ((lo_e + 126) << 23) | (lo_m << 22)) | ((lo_c & 8) << 28)
            hi = tl.where(hi_e == 0, hi_m * 0x3F000000, ((hi_e + 126) << 23) | (hi_m << 22)) | ((hi_c & 8) << 28)
            lo = tl.reshape(lo.to(tl.float32, bitcast=True), (R, 4, 8)) * s[:, :, None]
            hi = tl.reshape(hi.to(tl.float32, bitcast=True), (R, 4, 8)) * s[:, :, None]
            w = tl.reshape(tl.interleave(lo, hi), (R, 64)).to(tl.bfloat16)
            o = r[:, None] * 64 + tl.arange(0, 64)[None, :]
        if EVEN:
            tl.store(out_ptr + o, w)
        else:
            tl.store(out_ptr + o, w, mask=o < 16 * groups)

    return triton, _dequant_kernel


def launch_decode(p: torch.Tensor, s: torch.Tensor, out: torch.Tensor, asm: bool = True, rows: int = ROWS,
                  warps: int = WARPS) -> torch.Tensor:
    """The decode kernel on contiguous packed bytes ``p``, scale bytes ``s`` (one per 8 packed bytes) into bf16
    ``out`` (2 per packed byte); ``asm=False`` decodes with integer fields instead (also under the interpreter)."""
    triton, kernel = _kernel()
    groups = p.numel() // 8
    if (p.numel() != 8 * groups or s.numel() != groups or out.numel() != 2 * p.numel()
            or not (p.is_contiguous() and s.is_contiguous() and out.is_contiguous())):
        raise ValueError(f"nvfp4 decode: {p.numel()} packed bytes need a multiple of 8, {groups} scale bytes and "
                         f"{2 * p.numel()} outputs, all contiguous; got {s.numel()} and {out.numel()}")
    if groups:
        p = p.view(-1)
        words = p.view(torch.int32) if asm else p
        kernel[(triton.cdiv(groups, 4 * rows),)](words, p, s, out, groups, 1, R=rows, ASM=asm,
                                                EVEN=groups % (4 * rows) == 0, num_warps=warps)
    return out


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """e2m1 * s of packed [..., N, K/2] uint8 and scale [..., N, K/16] e4m3 (or its bytes) as bf16 [..., N, K],
    bit-identical to ``quant.forms.nvfp4_weight`` (no global scale). One Triton pass on CUDA."""
    shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    if not packed.is_cuda:
        w = forms.nvfp4_weight(packed, scale.view(torch.float8_e4m3fn), torch.bfloat16)
        return w if out is None else out.copy_(w)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=packed.device)
    return launch_decode(packed.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8), out)


# The side stream's priority (CUDA: lower is higher). High: the decode's programs take SMs as soon as GEMM programs
# of the chunk before retire, instead of after the whole GEMM.
SIDE_PRIORITY = -1


@functools.lru_cache(maxsize=None)
def _side_stream(index: int, priority: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index, priority=priority)


def _chunks(packed, scale, bounds, chunk, overlap, into):
    """(e0, e1, bf16 weights [e1-e0, N, K]) for each chunk of experts with rows, decoded just before its GEMMs: into
    one buffer, or into the slices of `into` [E, N, K]; with `overlap` (CUDA) the next chunk is decoded on a side
    stream while this chunk's GEMMs run (into two buffers, or `into`'s slices). The consumer runs a chunk's GEMMs
    before asking for the next."""
    e_total, n, kh = packed.shape
    chunk = max(1, min(chunk, e_total))
    ranges = [(a, min(a + chunk, e_total)) for a in range(0, e_total, chunk)
              if bounds[min(a + chunk, e_total)] > bounds[a]]  # skip chunks with no rows
    dev = packed.device
    overlap = overlap and packed.is_cuda and len(ranges) > 1
    if not overlap:
        buf = torch.empty(chunk, n, 2 * kh, dtype=torch.bfloat16, device=dev) if into is None else None
        for e0, e1 in ranges:
            dst = into[e0:e1] if into is not None else buf[:e1 - e0]
            yield e0, e1, nvfp4_dequantize(packed[e0:e1], scale[e0:e1], dst)
        return
    bufs = [torch.empty(chunk, n, 2 * kh, dtype=torch.bfloat16, device=dev) for _ in range(2)] if into is None else None
    main = torch.cuda.current_stream(dev)
    side = _side_stream(dev.index if dev.index is not None else torch.cuda.current_device(), SIDE_PRIORITY)
    side.wait_stream(main)  # the inputs and buffers were made on the main stream
    freed = [None, None]
    for i, (e0, e1) in enumerate(ranges):
        buf = bufs[i % 2][:e1 - e0] if into is None else into[e0:e1]
        with torch.cuda.stream(side):
            if freed[i % 2] is not None:
                side.wait_event(freed[i % 2])  # chunk i-2's GEMMs are done with this buffer
            nvfp4_dequantize(packed[e0:e1], scale[e0:e1], buf)
            ready = torch.cuda.Event()
            ready.record(side)
        main.wait_event(ready)
        yield e0, e1, buf
        if into is None:  # `into`'s slices are not reused
            freed[i % 2] = torch.cuda.Event()
            freed[i % 2].record(main)


def _run(inp, packed, scale, gs_host, bounds, dgrad, chunk, overlap, decoded=None, into=None, out=None):
    """out rows of expert e = bf16(fp32acc(inp_e @ op(W_e)) * gs[e]), op = transpose (forward) or identity; the
    weights decoded here (into `into` if given), or `decoded` [E, N, K] (kept from an earlier call). A given `out`
    (bf16, contiguous) is added to: bf16(fp32acc * gs[e] + out) in each GEMM's epilogue (cuBLAS beta = 1)."""
    e_total, n, kh = packed.shape
    beta = 0 if out is None else 1
    if out is None:
        out = torch.empty(inp.shape[0], 2 * kh if dgrad else n, dtype=torch.bfloat16, device=inp.device)
    inp = inp.contiguous()
    chunks = [(0, e_total, decoded)] if decoded is not None else _chunks(packed, scale, bounds, chunk, overlap, into)
    for e0, e1, buf in chunks:
        for e in range(e0, e1):
            lo, hi = bounds[e], bounds[e + 1]
            if hi > lo:
                w = buf[e - e0]
                # beta=0: the output slice is not read (torch.addmm's contract), only written; 1: added to
                out[lo:hi].addmm_(inp[lo:hi], w if dgrad else w.t(), beta=beta, alpha=gs_host[e])
    return out


def dequant_fwd(x, packed, scale, gs_host, bounds, chunk=None, overlap=True, into=None):
    """x [M, K] bf16 sorted by expert (host offsets ``bounds``, host decode scales ``gs_host``) -> [M, N].
    into: a bf16 [E, N, K] buffer that receives the decoded weights of every expert with rows, for the caller to
    pass to ``dequant_dgrad(decoded=...)`` (the input gradient then decodes nothing)."""
    return _run(x.to(torch.bfloat16), packed, scale, gs_host, bounds, False, chunk or CHUNK_EXPERTS, overlap,
                into=into)


def dequant_dgrad(dy, packed, scale, gs_host, bounds, chunk=None, overlap=True, decoded=None, accumulate=None):
    """dy [M, N] -> dx [M, K] = bf16(fp32acc(dy_e @ W_e) * gs[e]) per expert; decoded: the weights a forward
    decoded ``into`` (same bounds), else decoded here. accumulate: a bf16 [M, K] tensor dx is added to in place
    (bf16(fp32acc * gs[e] + accumulate), one rounding) and returned."""
    if accumulate is not None and (accumulate.dtype != torch.bfloat16 or not accumulate.is_contiguous()
                                   or tuple(accumulate.shape) != (dy.shape[0], 2 * packed.shape[2])):
        raise ValueError(f"accumulate: expected a contiguous bf16 [{dy.shape[0]}, {2 * packed.shape[2]}] tensor, "
                         f"got {accumulate.dtype} {tuple(accumulate.shape)}")
    return _run(dy.to(torch.bfloat16), packed, scale, gs_host, bounds, True, chunk or CHUNK_EXPERTS, overlap,
                decoded=decoded, out=accumulate)
