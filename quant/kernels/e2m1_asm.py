"""The e2m1 decode shared by the NVFP4 expert GEMMs (the Triton kernels of ``nvfp4_moe_gemm`` and the Gluon kernel of
``nvfp4_moe_gluon``): PTX for ``inline_asm_elementwise``, one 32-bit word of 8 codes and its bf16 block scale in,
the 8 decoded bf16 values out ($0..$7 = codes 0..7; code j in bits 4j..4j+3). Needs sm_80+ (bf16x2 fma)."""

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

