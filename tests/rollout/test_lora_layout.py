"""rollout.lora_layout's comparison on its own (the engine tests cover the mapping against a real worker): every
kind of difference is named by its buffer slice, bitwise (a -0.0 for a 0.0 counts), on contiguous slices (memcmp)
and on strided ones (an engine whose max LoRA rank exceeds the adapter's), and the expected slices are B scaled
after rounding to the LoRA dtype."""

import torch

from rollout.lora_layout import expected_slots, mismatches

A_KEY = "model.layers.0.self_attn.o_proj|lora_a_stacked|0"
B_KEY = "model.layers.0.self_attn.o_proj|lora_b_stacked|0"
PEFT_A = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
PEFT_B = "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"


def peft(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {PEFT_A: torch.randn(4, 16, generator=g), PEFT_B: torch.randn(8, 4, generator=g)}


def test_expected_slots_round_then_scale():
    t = peft()
    e = expected_slots(t, 4, 0.3, torch.bfloat16)
    assert sorted(e) == [A_KEY, B_KEY]
    assert torch.equal(e[A_KEY], t[PEFT_A].to(torch.bfloat16))
    assert torch.equal(e[B_KEY], t[PEFT_B].to(torch.bfloat16) * 0.3)  # vLLM's order: the dtype first, then scaled


def test_every_kind_of_difference_is_named():
    e = expected_slots(peft(), 4, 2.0, torch.float32)
    same = {k: v.clone() for k, v in e.items()}
    assert mismatches(e, same) == []

    flipped = {k: v.clone() for k, v in e.items()}
    flipped[A_KEY][1, 3] = torch.nextafter(flipped[A_KEY][1, 3], torch.tensor(1e9))
    step = float((flipped[A_KEY] - e[A_KEY]).abs().max())
    assert mismatches(e, flipped) == [f"{A_KEY}: 1 values differ (max |d| {step:.3g})"]

    zero = {A_KEY: torch.zeros(2), B_KEY: torch.zeros(2)}
    negzero = {A_KEY: torch.zeros(2), B_KEY: torch.tensor([0.0, -0.0])}
    assert mismatches(zero, negzero) == [f"{B_KEY}: 1 values differ (max |d| 0)"]

    missing = {A_KEY: e[A_KEY].clone()}
    assert mismatches(e, missing) == [f"{B_KEY}: the engine has no such LoRA buffer"]

    extra = {**same, "x|lora_a_stacked|0": torch.zeros(3)}
    assert mismatches(e, extra) == []  # a slice the adapter does not set holds zeros: fine
    extra["x|lora_a_stacked|0"][1] = 1.0
    assert mismatches(e, extra) == ["x|lora_a_stacked|0: nonzero in the engine, absent from the trainer's adapter"]

    reshaped = {**same, B_KEY: e[B_KEY].reshape(4, 8).clone()}
    assert mismatches(e, reshaped) == [f"{B_KEY}: shape (4, 8) in the engine, (8, 4) in the trainer"]


def test_strided_slices_compare_bitwise_too():
    e = expected_slots(peft(), 4, 2.0, torch.bfloat16)
    wide = torch.zeros(8, 6, dtype=torch.bfloat16)  # a [out, max_rank] buffer holding a rank-4 B
    wide[:, :4] = e[B_KEY]
    installed = {A_KEY: e[A_KEY].clone(), B_KEY: wide[:, :4]}
    assert not installed[B_KEY].is_contiguous() and mismatches(e, installed) == []
    wide[5, 2] = -wide[5, 2] if wide[5, 2] != 0 else -0.0
    assert mismatches(e, installed) == [f"{B_KEY}: 1 values differ (max |d| {float(2 * e[B_KEY][5, 2].abs()):.3g})"]
