"""Run by tests/rollout/test_tp_engine.py under torchrun (2 CPU processes, gloo): one vLLM engine with tensor
parallelism over both processes (external_launcher, as rl.session builds it), a random rank-32 adapter on every
target installed in memory on each rank, and per rank a JSON report in argv[1]: what the sync verified, the shard
shapes it holds, whether the other rank's expectation would have failed, and logprobs vs transformers + peft."""

import json
import sys
import tempfile

import torch.distributed as dist

from m3.tiny import ensure_tiny_model
from rollout.engine import ADAPTER_ID, EngineConfig, RolloutEngine
from rollout.lora_layout import TPShard, expected_slots, installed_slots, mismatches
from tests.rollout.engine_fixtures import make_adapter, prompt_ids, run_and_compare
from tests.rollout.hf_reference import load_reference


def main(out_dir: str, expert_parallel: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    paths = ensure_tiny_model(dtype="float32")
    engine = RolloutEngine(EngineConfig(model=str(paths.vllm), dtype="float32", max_model_len=1024,
                                        capture_blocks=True, distributed_executor_backend="external_launcher",
                                        tensor_parallel_size=2, enable_expert_parallel=expert_parallel))
    peft_model, tensors, cfg = make_adapter(load_reference(paths.hf), tempfile.mkdtemp(), seed=1)
    report = {"rank": rank, "load": engine.load_adapter(tensors, cfg), "verify": engine.verify_adapter(tensors, cfg)}

    def held(worker):  # this rank's shard, and what the other rank's shard would have to hold
        shard = worker._m3_tp_shard()
        slots = installed_slots(worker.model_runner.lora_manager._adapter_manager, ADAPTER_ID, 32)
        other = TPShard(1 - shard.rank, shard.size, shard.kv_heads, shard.expert_parallel)
        wrong = mismatches(expected_slots(tensors, 32, cfg["lora_alpha"] / 32, slots[next(iter(slots))].dtype,
                                          other), slots)
        return {"shard": vars(shard), "shapes": {k: list(v.shape) for k, v in slots.items()}, "other_shard": wrong}

    report.update(engine.llm.collective_rpc(held)[0])
    ids = prompt_ids(32, seed=3)
    r = run_and_compare(engine, peft_model, ids, greedy=False)
    report["delta"] = [float(r["prompt_delta"].max()), float(r["new_delta"].max())]
    with peft_model.disable_adapter():
        report["delta_vs_base"] = float(run_and_compare(engine, peft_model, ids, greedy=False)["prompt_delta"].max())
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["expert_parallel"])
