"""One vLLM engine over two torchrun processes (tensor parallel 2, external_launcher, gloo on CPU) serving the tiny
M3 with a random adapter on every LoRA target (tests/rollout/tp_engine_lora.py): each rank installs and verifies
its own shard (installed == held, bitwise, by rollout.lora_layout's TP rules), holds half of every split buffer,
would fail the check against the other rank's shard, and both ranks' logprobs match transformers + peft (fp32,
1e-3; measured ~1.4e-5). With expert parallelism the routed experts are split by expert instead."""

import json

import pytest

from tests.rl.test_train_torchrun import torchrun

O_PROJ_A = "model.layers.1.self_attn.o_proj|lora_a_stacked|0"  # row parallel: A [r, in] split by input column
QKV_Q_B = "model.layers.1.self_attn.qkv_proj|lora_b_stacked|0"  # q rows split; k (1 KV head) replicated
QKV_K_B = "model.layers.1.self_attn.qkv_proj|lora_b_stacked|1"
W13_B = "model.layers.1.block_sparse_moe.experts|w13_lora_b_stacked|0"  # [E, 2 * intermediate, r]


def run(tmp_path, *extra):
    p = torchrun(["tests/rollout/tp_engine_lora.py", str(tmp_path), *extra], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def check_common(reports):
    assert [r["shard"]["rank"] for r in reports] == [0, 1] and {r["shard"]["size"] for r in reports} == {2}
    for r in reports:
        assert r["load"]["tp_ranks"] == [r["rank"]]  # the worker verified its own shard inside the install
        assert r["verify"]["installed_equals_held"] and not r["verify"]["mismatches"]
        assert r["other_shard"], "the check must tell this rank's shard from the other's"
        assert r["shapes"][O_PROJ_A] == [32, 128]  # o_proj input 256 (2 heads x 128), half per rank
        assert r["shapes"][QKV_Q_B] == [128, 32] and r["shapes"][QKV_K_B] == [128, 32]
        assert r["delta"][0] <= 1e-3 and r["delta"][1] <= 1e-3, r["delta"]
        assert r["delta_vs_base"] > 0.05  # the adapter really changes what the engine computes
    assert reports[0]["load"]["checksum"] == reports[1]["load"]["checksum"]


def test_tensor_parallel_engine_installs_and_verifies_each_shard(tmp_path):
    reports = run(tmp_path)
    check_common(reports)
    for r in reports:
        assert r["shapes"][W13_B] == [8, 128, 32]  # intermediate 64 of 128 per rank, in both gate and up halves
        assert any(m.startswith(O_PROJ_A) for m in r["other_shard"])


@pytest.mark.slow  # the same engine again (~40 s) with experts split by expert instead of by intermediate size
def test_expert_parallel_engine_holds_its_experts(tmp_path):
    reports = run(tmp_path, "expert_parallel")
    check_common(reports)
    for r in reports:
        assert r["shard"]["expert_parallel"]
        assert r["shapes"][W13_B] == [4, 256, 32]  # 4 of the 8 experts, whole
        assert any(m.startswith(W13_B) for m in r["other_shard"])
