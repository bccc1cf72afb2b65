"""The e2m1 decode shared by the NVFP4 expert GEMMs (the Triton kernels of ``nvfp4_moe_gemm`` and the Gluon kernel of
``nvfp4_moe_gluon``): PTX for ``inline_asm_elementwise``, one 32-bit word of 8 codes and its bf16 block scale in,
the 8 decoded bf16 values out ($0..$7 = codes 0..7). Two word layouts: the serving order (code j in bits 4j..4j+3,
``E2M1_BF16X2_ASM``, the default) and the pair order (``to_pair_order``, ``E2M1_PAIRS_ASM``: 17% fewer decode
instructions in the Gluon kernel's loop, 2.5-7% faster at 32K and at 64-512 tokens, results/gpu/runs 65-68; opt-in,
since the trainer keeps the serving order). Needs sm_80+ (bf16x2 fma).
``triton_decoders`` wraps both as Triton jit functions (with a portable decoder), for every Triton kernel that
decodes: the GEMMs of ``nvfp4_moe_gemm`` and the bf16 decode of ``nvfp4_dequant``."""

import functools

# bf16 bit patterns of the 8 nibbles of a 32-bit word as bf16x2 pairs (n_k, n_{k+4}): code bits
# (s e1 e0 m) -> sign bit 15, e1 e0 m -> bits 8..6. That is a bf16 with exponent field e and
# mantissa m, i.e. e2m1 * 2^-126 (a subnormal when e = 0), so one exact bf16x2 fma by 2^126
# gives e2m1 and a second by the block scale gives e2m1 * s (exact: <= 6 significant bits).
E2M1_BF16X2_ASM = """
    {
    .reg .b32 t0, t1, r0, r1, r2, r3, ss, bias, nz;
    mov.b32 ss, {$9, $9};
    mov.b32 bias, 0x7E807E80;
    mov.b32 nz, 0x80008000;
    shl.b32 t0, $8, 6;
    and.b32 t0, t0, 0x01C001C0;
    shl.b32 t1, $8, 12;
    and.b32 t1, t1, 0x80008000;
    or.b32 r0, t0, t1;
    shl.b32 t0, $8, 2;
    and.b32 t0, t0, 0x01C001C0;
    shl.b32 t1, $8, 8;
    and.b32 t1, t1, 0x80008000;
    or.b32 r1, t0, t1;
    shr.b32 t0, $8, 2;
    and.b32 t0, t0, 0x01C001C0;
    shl.b32 t1, $8, 4;
    and.b32 t1, t1, 0x80008000;
    or.b32 r2, t0, t1;
    shr.b32 t0, $8, 6;
    and.b32 t0, t0, 0x01C001C0;
    and.b32 t1, $8, 0x80008000;
    or.b32 r3, t0, t1;
    fma.rn.bf16x2 r0, r0, bias, nz;
    fma.rn.bf16x2 r1, r1, bias, nz;
    fma.rn.bf16x2 r2, r2, bias, nz;
    fma.rn.bf16x2 r3, r3, bias, nz;
    fma.rn.bf16x2 r0, r0, ss, nz;
    fma.rn.bf16x2 r1, r1, ss, nz;
    fma.rn.bf16x2 r2, r2, ss, nz;
    fma.rn.bf16x2 r3, r3, ss, nz;
    mov.b32 {$0, $4}, r0;
    mov.b32 {$1, $5}, r1;
    mov.b32 {$2, $6}, r2;
    mov.b32 {$3, $7}, r3;
    }
    """



# Pair order: the same 8 codes of a word with their bits placed so that output register i is the bf16x2 pair of
# codes (2i, 2i+1), the order the MMA operand and the 16-byte tile stores want, reached by one rotate per field
# instead of two shifts per field and a byte permute (PRMT) per pair: register i = (rotl(w, a) & mags) |
# (rotl(w, b) & signs) with (a, b) = PAIR_ROTATIONS[i]; a search over all rotations finds no order that needs fewer
# than these 11 logic ops per word (natural order: 16, plus 4.5 PRMT). ``to_pair_order`` writes it from the serving
# bytes (lossless, the same values); the kernels take it with config PAIRS=True.
PAIR_ROTATIONS = ((0, 4), (3, 3), (6, 6), (9, 5))
MAG_BITS, SIGN_BITS = 0x01C001C0, 0x80008000
# The block scale arrives multiplied by 2^PAIRS_SCALE_UP (bf16, exact: s * 2^118 <= 448 * 2^118 < 2^127), so one
# bf16x2 multiply turns the subnormal e2m1 * 2^-126 into e2m1 * s * 2^-8 (exact and normal: 2^-18 <= |x| <= 10.5);
# the epilogue multiplies the fp32 accumulator by gs * 2^PAIRS_ACC_SHIFT instead of gs (a power of two: the same
# rounding as before).
PAIRS_SCALE_UP, PAIRS_ACC_SHIFT = 118, 8


def _rot(dst: str, n: int) -> str:
    return f"shf.l.wrap.b32 {dst}, $8, $8, {n};" if n else f"mov.b32 {dst}, $8;"


def _pairs_asm() -> str:
    ops = []
    for i, (a, b) in enumerate(PAIR_ROTATIONS):
        if a == b:
            ops += [_rot("t0", a), f"and.b32 r{i}, t0, {MAG_BITS | SIGN_BITS:#010x};"]
        else:
            ops += [_rot("t0", a), f"and.b32 t0, t0, {MAG_BITS:#010x};", _rot("t1", b),
                    f"and.b32 t1, t1, {SIGN_BITS:#010x};", f"or.b32 r{i}, t0, t1;"]
    ops += [f"fma.rn.bf16x2 r{i}, r{i}, ss, nz;" for i in range(4)]
    ops += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, r{i};" for i in range(4)]
    body = "\n    ".join(["mov.b32 ss, {$9, $9};", "mov.b32 nz, 0x80008000;"] + ops)
    return "\n    {\n    .reg .b32 t0, t1, r0, r1, r2, r3, ss, nz;\n    " + body + "\n    }\n    "


# One 32-bit word of 8 codes in pair order and its block scale times 2^118 (bf16) in; codes 0..7 out ($0..$7) as
# e2m1 * s * 2^-8 in bf16.
E2M1_PAIRS_ASM = _pairs_asm()


def _pair_bit_map() -> list[tuple[int, int]]:
    """(serving bit, pair-order bit) for the 32 bits of a word: code j's bits 4j..4j+3 (m, e0, e1, sign) go where
    rotl(., a) / rotl(., b) of its register brings them onto bf16 bits 6..8 / 15 of its half."""
    out = []
    for i, (a, b) in enumerate(PAIR_ROTATIONS):
        for h in (0, 1):
            j = 2 * i + h
            out += [(4 * j + q, (6 + q + 16 * h - a) % 32) for q in range(3)]
            out.append((4 * j + 3, (15 + 16 * h - b) % 32))
    return out


def to_pair_order(packed):
    """NVFP4 packed bytes [..., K/2] (serving order: code 2j in the low nibble of byte j) -> the same codes in pair
    order, same shape and dtype (uint8); K/2 a multiple of 4 (whole 32-bit words)."""
    import torch

    if packed.dtype != torch.uint8 or packed.shape[-1] % 4:
        raise ValueError(f"to_pair_order: uint8 bytes with K/2 a multiple of 4, got {packed.dtype} {packed.shape}")
    w = packed.contiguous().view(torch.int32)
    out = torch.zeros_like(w)
    for src, dst in _pair_bit_map():
        bit = (w >> src) & 1
        out |= bit << dst if dst < 31 else -bit << 31  # bit 31 as the int32 sign
    return out.view(torch.uint8).view(packed.shape)


@functools.lru_cache(maxsize=None)
def triton_decoders():
    """The e2m1 decoders as Triton jit functions, built on first use (Triton is imported here, not at module import:
    CPU installs lack it), as a namespace:
    - decode_tl(p, s, R, BK): p [R, BK/2] uint8 (two codes per byte), s [R, BK/16] E4M3 bytes -> [R, BK] bf16,
      portable tl ops;
    - decode_asm(p32, s, R, BK, PAIRS): p32 [R, BK/8] int32 words (serving order, or pair order with PAIRS: then
      e2m1 * s * 2^-8, the caller multiplies 2^PAIRS_ACC_SHIFT back), same s -> [R, BK] bf16, through the PTX above;
    - its parts scale_bf16(s, PAIRS) (E4M3 bytes -> the bf16 the PTX takes) and decode_words(p32, sw, PAIRS) (words
      and one bf16 scale per word, same shape -> [..., 2, 2, 2], the word's 8 codes in order), for kernels that load
      one scale per word themselves.
    All exact: e2m1 * s has at most 6 significant bits, so it is a bf16."""
    import types

    import triton
    import triton.language as tl

    asm_decode = tl.constexpr(E2M1_BF16X2_ASM)
    asm_pairs = tl.constexpr(E2M1_PAIRS_ASM)
    scale_up = tl.constexpr(2.0 ** PAIRS_SCALE_UP)

    @triton.jit
    def decode_tl(p, s, R: tl.constexpr, BK: tl.constexpr):
        # A code (s e1 e0 m) placed as fp16 bits (s << 15 | e1 e0 m << 9) is e2m1 * 2^-14 exactly (an fp16 subnormal
        # when e = 0; fp16 -> fp32 conversion is exact), so times 2^14 * s in fp32 it is e2m1 * s.
        q = p.to(tl.int32)
        lo = (((q & 0x7) << 9) | ((q & 0x8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (((q & 0x70) << 5) | ((q & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True)
        w = tl.interleave(lo.to(tl.float32), hi.to(tl.float32))
        sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
        w = tl.reshape(w, (R, BK // 16, 16)) * sf[:, :, None]
        return tl.reshape(w, (R, BK)).to(tl.bfloat16)

    @triton.jit
    def scale_bf16(s, PAIRS: tl.constexpr):
        if PAIRS:
            return (s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale_up).to(tl.bfloat16)
        else:
            return s.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)

    @triton.jit
    def decode_words(p32, sw, PAIRS: tl.constexpr):
        bf = tl.bfloat16
        if PAIRS:
            asm: tl.constexpr = asm_pairs
        else:
            asm: tl.constexpr = asm_decode
        n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
            asm, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [p32, sw], dtype=(bf, bf, bf, bf, bf, bf, bf, bf), is_pure=True,
            pack=1)
        return tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)), tl.join(tl.join(n1, n5), tl.join(n3, n7)))

    @triton.jit
    def decode_asm(p32, s, R: tl.constexpr, BK: tl.constexpr, PAIRS: tl.constexpr):
        sb = scale_bf16(s, PAIRS)
        return tl.reshape(decode_words(p32, tl.reshape(tl.join(sb, sb), (R, BK // 8)), PAIRS), (R, BK))

    return types.SimpleNamespace(decode_tl=decode_tl, decode_asm=decode_asm, scale_bf16=scale_bf16,
                                 decode_words=decode_words)
