"""The pair order of quant/kernels/e2m1_asm.py on the CPU: ``to_pair_order`` is a lossless permutation of each word's
bits, and the steps of ``E2M1_PAIRS_ASM`` (rotate, mask, one bf16 multiply by the block scale times 2^118), done
here in torch, give e2m1 * s * 2^-8 exactly for every code and every finite E4M3 scale, subnormal scales included.
The GPU tests (test_kernels_gpu.py, configs with PAIRS=True) run the asm itself against the reference."""

import re

import pytest
import torch

from quant import nvfp4
from quant.kernels import e2m1_asm


def _rotl(w: torch.Tensor, n: int) -> torch.Tensor:
    w = w & 0xFFFFFFFF
    return ((w << n) | (w >> (32 - n))) & 0xFFFFFFFF if n else w


def _words(packed: torch.Tensor) -> torch.Tensor:
    return packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _decode_pairs(packed_pairs: torch.Tensor, s_up: torch.Tensor) -> torch.Tensor:
    """What the asm computes, per word: registers i = 0..3 -> codes (2i, 2i+1), times the scaled block scale."""
    w = _words(packed_pairs)
    out = []
    for a, b in e2m1_asm.PAIR_ROTATIONS:
        r = (_rotl(w, a) & e2m1_asm.MAG_BITS) | (_rotl(w, b) & e2m1_asm.SIGN_BITS)
        for half in (r & 0xFFFF, r >> 16):
            bf = half.to(torch.int32).to(torch.int16).view(torch.bfloat16)  # e2m1 * 2^-126, maybe subnormal
            out.append(bf * s_up)  # one bf16 product, as fma.rn.bf16x2 with -0
    return torch.stack(out, -1).flatten(-2)


def test_pair_order_is_a_bit_permutation_and_round_trips():
    pairs = e2m1_asm._pair_bit_map()
    assert sorted(s for s, _ in pairs) == list(range(32)) and sorted(d for _, d in pairs) == list(range(32))
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8, generator=g)
    moved = e2m1_asm.to_pair_order(packed)
    assert moved.shape == packed.shape and moved.dtype == torch.uint8
    assert not torch.equal(moved, packed)
    # each bit lands where the map says
    w, m = _words(packed), _words(moved)
    for src, dst in pairs:
        assert torch.equal((w >> src) & 1, (m >> dst) & 1), (src, dst)


def test_pairs_decode_is_exact_for_every_code_and_scale():
    # every code in every position of a word: words j = code j in all 8 slots, and random words
    codes = torch.arange(16, dtype=torch.uint8)
    same = codes.repeat_interleave(8).view(16, 8)
    rnd = torch.randint(0, 16, (4096, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    all_codes = torch.cat([same, rnd])
    packed = nvfp4.pack_codes(all_codes)  # [W, 4] bytes: one word each
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # +-0 .. 448, no NaN
    finite = finite[finite < 0x80]  # block scales are non-negative
    s = finite.view(torch.float8_e4m3fn).float()
    s_up = (s * 2.0 ** e2m1_asm.PAIRS_SCALE_UP).to(torch.bfloat16)
    assert torch.equal(s_up.float(), s * 2.0 ** e2m1_asm.PAIRS_SCALE_UP)  # the scaled scale is exact in bf16
    got = _decode_pairs(e2m1_asm.to_pair_order(packed), s_up[:, None, None])  # [scales, W, 8]
    want = nvfp4.unpack_values(packed)[None] * s[:, None, None] * 2.0 ** -e2m1_asm.PAIRS_ACC_SHIFT
    assert torch.equal(got.float(), want)
    # the sign survives on zero codes too (code 8 is -0), as the serving decode keeps it
    assert torch.equal(torch.signbit(got.float()), torch.signbit(want))


def test_pairs_asm_has_no_byte_permutes_and_one_multiply_per_pair():
    asm = e2m1_asm.E2M1_PAIRS_ASM
    assert "prmt" not in asm
    assert len(re.findall(r"fma\.rn\.bf16x2", asm)) == 4
    # outputs in code order: register i holds codes 2i (low half) and 2i + 1
    assert re.findall(r"mov\.b32 \{\$(\d), \$(\d)\}", asm) == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]


def test_to_pair_order_rejects_partial_words():
    with pytest.raises(ValueError, match="multiple of 4"):
        e2m1_asm.to_pair_order(torch.zeros(2, 6, dtype=torch.uint8))


def test_the_expert_linear_takes_serving_order_only():
    """nvfp4_moe_linear's weights are in the serving order on every path (its decode + cuBLAS path and the CPU
    reference read that order), so the kernels' "pairs" decoder is refused there, on any device, before any work."""
    from quant.kernels.nvfp4_moe import nvfp4_moe_linear

    e, n, k = 2, 16, 32
    args = (torch.zeros(3, k, dtype=torch.bfloat16), torch.zeros(e, n, k // 2, dtype=torch.uint8),
            torch.zeros(e, n, k // 16, dtype=torch.uint8), torch.ones(e), torch.tensor([0, 1, 3], dtype=torch.int32))
    assert nvfp4_moe_linear(*args, decoder="asm").shape == (3, n)
    with pytest.raises(ValueError, match="unknown decoder 'pairs'"):
        nvfp4_moe_linear(*args, decoder="pairs")
