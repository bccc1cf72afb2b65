"""rl.checkpointing on the real files of a small LoRA model (no engine): the round trip restores parameters,
optimizer state, LR schedule, data cursor and RNG streams exactly; a checkpoint with a truncated file, a changed byte
or no manifest is named in a warning and the one before it is used; none valid is one error; loading unpickles
nothing but DCP's own index, through an allowlist."""

import json
import pickle
import random

import numpy as np
import pytest
import torch

from rl import checkpointing
from rl.prompts import DataCursor
from rl.model.lora import LoRAConfig, LoRALinear, adapter_state_dict, lora_parameters

CFG = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj"], target_experts=False)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = LoRALinear(torch.nn.Linear(8, 8, bias=False), 8, 8, CFG)
        self.k_proj = LoRALinear(torch.nn.Linear(8, 8, bias=False), 8, 8, CFG)  # never gets a gradient (no state)
        for m in (self.q_proj, self.k_proj):
            m.base.weight.requires_grad_(False)


def make(seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    with torch.no_grad():
        model.q_proj.lora_B.normal_()  # peft starts B at zero; a non-zero B makes A's gradient non-zero
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3))
    return model, opt, sched, DataCursor(10, seed=1)


def train_steps(model, opt, sched, cursor, n):
    for _ in range(n):
        cursor.next_batch(3)
        opt.zero_grad()
        model.q_proj(torch.randn(5, 8)).square().sum().backward()
        opt.step()
        sched.step()


def save(run, step, model, opt, sched, cursor):
    return checkpointing.save(run, step, model=model, optimizer=opt, scheduler=sched, cursor=cursor,
                              adapter_fp32=adapter_state_dict(model, torch.float32), lora_cfg=CFG, extra={}, keep=3)


def test_round_trip_continues_exactly_like_an_uninterrupted_run(tmp_path):
    model, opt, sched, cursor = make()
    train_steps(model, opt, sched, cursor, 2)
    path = save(tmp_path, 2, model, opt, sched, cursor)
    assert sorted(json.loads((path / "manifest.json").read_text())["files"]) == [
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "dcp/.metadata", "dcp/__0_0.distcp",
        "rng_rank0.json", "state.json"]
    train_steps(model, opt, sched, cursor, 2)  # the uninterrupted run, RNG streams included
    expect = {k: v.clone() for k, v in model.state_dict().items()}, opt.param_groups[0]["lr"], random.random(), \
        np.random.rand(), cursor.state_dict()

    model2, opt2, sched2, cursor2 = make()  # the same frozen base (a run re-reads it from model.path)
    with torch.no_grad():
        model2.q_proj.lora_A.add_(1.0)  # LoRA, optimizer, schedule, cursor and RNG positions all elsewhere
    train_steps(model2, opt2, sched2, cursor2, 1)
    random.random(), np.random.rand()
    found, skipped = checkpointing.newest_valid(tmp_path)
    assert found == path and skipped == []
    assert checkpointing.load(found, model=model2, optimizer=opt2, scheduler=sched2, cursor=cursor2)["step"] == 2
    train_steps(model2, opt2, sched2, cursor2, 2)
    got = model2.state_dict(), opt2.param_groups[0]["lr"], random.random(), np.random.rand(), cursor2.state_dict()
    assert all(torch.equal(expect[0][k], got[0][k]) for k in expect[0] if "lora" in k)
    assert expect[1:] == got[1:]
    assert model2.k_proj.lora_A not in opt2.state  # no gradient, no state: as in the run that saved it


def test_retention_keeps_the_newest(tmp_path):
    model, opt, sched, cursor = make()
    for step in range(1, 6):
        save(tmp_path, step, model, opt, sched, cursor)
    assert [p.name for p in checkpointing.step_dirs(tmp_path)] == ["step_000005", "step_000004", "step_000003"]


@pytest.mark.parametrize("corrupt,named", [
    (lambda p: (p / "adapter/adapter_model.safetensors").write_bytes(
        (p / "adapter/adapter_model.safetensors").read_bytes()[:100]), "adapter_model.safetensors: checksum"),
    (lambda p: (p / "dcp/__0_0.distcp").write_bytes(b"\0" + (p / "dcp/__0_0.distcp").read_bytes()[1:]),
     "__0_0.distcp: checksum"),
    (lambda p: (p / "manifest.json").unlink(), "manifest.json: missing"),
    (lambda p: (p / "state.json").unlink(), "state.json: missing"),
])
def test_corrupt_newest_falls_back_to_the_one_before(tmp_path, corrupt, named):
    model, opt, sched, cursor = make()
    for step in (1, 2):
        train_steps(model, opt, sched, cursor, 1)
        save(tmp_path, step, model, opt, sched, cursor)
    corrupt(checkpointing.step_dirs(tmp_path)[0])
    found, skipped = checkpointing.newest_valid(tmp_path)
    assert found.name == "step_000001" and len(skipped) == 1 and named in skipped[0] and "step_000002" in skipped[0]
    corrupt(found)
    with pytest.raises(checkpointing.CheckpointError, match="no valid checkpoint in .*step_000002.*step_000001"):
        checkpointing.newest_valid(tmp_path)


def test_the_index_is_read_without_arbitrary_unpickling(tmp_path, capsys):
    model, opt, sched, cursor = make()
    path = save(tmp_path, 1, model, opt, sched, cursor)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(checkpointing.CheckpointError, match=r"\.metadata: DCP metadata refers to builtins.print"):
        checkpointing.load(path, model=model, optimizer=opt, scheduler=sched, cursor=cursor)
    assert "pwned" not in capsys.readouterr().out
