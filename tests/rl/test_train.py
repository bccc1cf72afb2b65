"""rl.train end to end on the tiny M3 (fast settings): a 2-step smoke run, config/data/file errors before any
heavy work, non-finite losses skipped without syncing and stopping with a checkpoint, resume after SIGKILL."""

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from m3.tiny import ensure_tiny_model
from rl.config import register, validate

ROOT = Path(__file__).resolve().parents[2]
register()


def fast_overrides(run_dir, model_dir, steps=2):
    return [f"model.path={model_dir}", "model.base=bf16", "model.dtype=float32", f"trainer.run_dir={run_dir}",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=1", "data.train_batch_size=2", "rollout.n=2",
            "data.max_response_length=6", "data.val_size=4", "check.batch_prompts=2", "logger.wandb_mode=disabled",
            "logger.console=false"]


def compose_cfg(overrides):
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_tiny_model(dtype="float32").vllm)


@pytest.fixture(scope="module")
def session(tmp_path_factory, model_dir):
    from rl.session import Session

    cfg = compose_cfg(fast_overrides(tmp_path_factory.mktemp("run"), model_dir))
    with Session(cfg) as s:
        yield s


def test_two_step_smoke_run(session):
    import rl.train as train

    gc.unfreeze()  # the engine froze its startup heap; the loop freezes what the session built after it
    summary = train.run(session)
    assert gc.get_freeze_count() > 0
    run = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/mean", "reward/acc", "response/length", "train_rollout/kl_k1", "train_rollout/kl_k3",
                "is/ratio_mean", "is/ratio_max", "is/capped_frac", "agreement/routing", "train/grad_norm",
                "sync/ms", "sync/bytes", "time/generate_s", "time/score_s", "time/train_s", "time/sync_s",
                "train/micro_batches"):
        assert all(key in r for r in rows), key
    check = summary["check_step0"]
    assert check["passed"] and check["weights_exact"] and check["replayed"] == {"routing": 1.0, "blocks": 1.0}
    assert (run / "summary.json").is_file() and (run / "config.yaml").is_file()
    assert (run / "checkpoints" / "step_000002" / "adapter" / "adapter_model.safetensors").is_file()
    assert (Path(summary["final_adapter"]) / "adapter_config.json").is_file()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])  # the second divides by the padded L
def test_micro_batches_accumulate_the_whole_batch_gradient(session, agg):
    """actor.ppo_micro_batch_size_per_gpu / use_dynamic_bsz: the adapter's gradient, the logprobs and the agreement
    of micro-batches of 1 and 3 sequences and of <= 110 tokens equal the one-pass batch's (fp32 tiny model; only the
    summation order differs)."""
    import rl.train as train

    scored = train.score(session, *train.generate(session, 7))
    batch = train.pack_rollouts(scored.rollouts)
    old_lp, mask = batch.to_matrix(batch.rollout_logprobs)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask  # any advantages: nonzero grads
    info = train.batch_info(session, mask)
    actor = session.cfg.actor
    keys = ("ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu")
    keep = [actor[k] for k in keys], session.cfg.algorithm.loss_agg_mode
    session.cfg.algorithm.loss_agg_mode = agg
    runs, parts = {}, {}
    try:
        for name, values in (("one", (None, False, 16384)), (1, (1, False, 16384)), (3, (3, False, 16384)),
                             ("tokens", (None, True, 110))):
            for k, v in zip(keys, values):
                actor[k] = v
            parts[name] = len(train.micro_batches(session, torch.diff(batch.cu_seqlens).tolist()))
            lp, agreement, finite, passes = train.forward_backward(session, batch, old_lp, mask, adv, info)
            assert finite and passes == parts[name]
            runs[name] = [None if p.grad is None else p.grad.clone() for p in session.params], lp, agreement
    finally:
        for k, v in zip(keys, keep[0]):
            actor[k] = v
        session.cfg.algorithm.loss_agg_mode = keep[1]
        session.optimizer.zero_grad(set_to_none=True)
    grads, lp, agreement = runs["one"]
    assert len(batch.cu_seqlens) - 1 == 4 and int(batch.cu_seqlens[-1]) > 110  # so 110 tokens make >= 2 parts
    assert parts["one"] == 1 and parts[1] == 4 and parts[3] == 2 and parts["tokens"] >= 2, parts
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0
    for size in (1, 3, "tokens"):
        assert [g is None for g in runs[size][0]] == [g is None for g in grads]
        for g, ref in zip(runs[size][0], grads):
            if ref is not None:
                torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
        torch.testing.assert_close(runs[size][1], lp, rtol=0, atol=1e-5)
        assert runs[size][2].keys() == agreement.keys()
        assert all(abs(runs[size][2][k] - agreement[k]) < 1e-9 for k in agreement)


def test_micro_batch_spans_match_the_rank_with_the_most():
    """Spans of sequences in order, by count or by tokens; every rank runs as many as the rank that needs the most
    (FSDP's collectives pair them): a rank with fewer splits its largest spans, then repeats its first sequence at
    weight 0."""
    from types import SimpleNamespace

    import rl.train as train

    def spans(lengths, others, size=None, tokens=None):
        actor = SimpleNamespace(ppo_micro_batch_size_per_gpu=size, use_dynamic_bsz=tokens is not None,
                                ppo_max_token_len_per_gpu=tokens)
        return train.micro_batches(SimpleNamespace(cfg=SimpleNamespace(actor=actor), all_gather=lambda x: [x, *others]),
                                   lengths)

    assert spans([9] * 5, []) == [(0, 5, 1.0)]
    assert spans([9] * 5, [1], size=2) == [(0, 2, 1.0), (2, 4, 1.0), (4, 5, 1.0)]
    assert spans([9] * 4, [3], size=4) == [(0, 1, 1.0), (1, 2, 1.0), (2, 4, 1.0)]  # split to the agreed count
    assert spans([9] * 2, [4], size=1) == [(0, 1, 1.0), (1, 2, 1.0), (0, 1, 0.0), (0, 1, 0.0)]
    # by tokens: packed in order up to the budget, a sequence over it alone
    assert spans([5, 4, 3, 9, 1, 12, 2], [1], tokens=10) == [(0, 2, 1.0), (2, 3, 1.0), (3, 5, 1.0), (5, 6, 1.0),
                                                             (6, 7, 1.0)]
    assert spans([5, 4, 3, 1], [3], tokens=10) == [(0, 1, 1.0), (1, 2, 1.0), (2, 4, 1.0)]  # the 9-token span split


def test_nonfinite_loss_skips_step_without_sync_and_stops_with_checkpoint(session, monkeypatch):
    import rl.train as train

    before = session.engine.llm.collective_rpc("m3_installed_checksum", args=(1,))[0]
    monkeypatch.setattr(train, "policy_loss", lambda *a, **k: (torch.tensor(float("nan"), requires_grad=True), {}))
    metrics = train.grpo_step(session, 100)
    assert metrics["train/skipped_nonfinite"] == 1.0
    assert session.engine.llm.collective_rpc("m3_installed_checksum", args=(1,))[0] == before  # not synced
    session.cfg.trainer.total_training_steps = 5
    session.cfg.trainer.max_nan_steps = 2
    shutil.rmtree(session.run_dir / "checkpoints")  # start over: from step 0
    with pytest.raises(RuntimeError, match="2 non-finite steps in a row"):
        train.run(session)
    latest = (session.run_dir / "checkpoints" / "latest").read_text().strip()
    state = json.loads((session.run_dir / "checkpoints" / latest / "state.json").read_text())
    assert state["stopped"] == "non-finite loss"


@pytest.mark.parametrize("override,message", [
    ("algorithm.rollout_correction.rollout_iss=token", "Could not override"),
    ("actor.optim.lr=fast", "fast"),
    ("trainer.total_steps=3", "Could not override"),
    ("model.base=fp8", r"Invalid value 'fp8', expected one of \[quantized, bf16\]"),  # Enum-typed choices
    ("data.kind=dapo", "Invalid value 'dapo'"),
    ("algorithm.rollout_correction.loss_type=ppo", "Invalid value 'ppo'"),
])
def test_unknown_or_mistyped_keys_fail_at_composition(override, message):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg([override])
    assert re.search(message, f"{err.value} {err.value.__cause__}"), f"{err.value} {err.value.__cause__}"


@pytest.mark.parametrize("override,message", [
    ("rollout.n=1", "rollout.n must be >= 2"),
    ("model.lora.rank=24", "model.lora.rank=24"),
    ("trainer.save_freq=0", "trainer.save_freq=0: must be >= 1"),
    ("trainer.max_nan_steps=0", "trainer.max_nan_steps=0: must be >= 1"),
    ("algorithm.loss_agg_mode=token-avg", "algorithm.loss_agg_mode='token-avg'"),
    ("algorithm.rollout_correction.rollout_rs=token_k9", r"\['token_k9'\] not among verl's options"),
    ("model.lora.target_modules=[q_proj,qproj]", r"\['qproj'\] name no projection"),
    ("algorithm.rollout_correction.bypass_mode=false", "bypass_mode=false"),
    ("actor.ppo_mini_batch_size=3", "one optimizer step per batch"),
    (["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=100"],
     r"actor.ppo_max_token_len_per_gpu=100 < data.max_prompt_length \+ data.max_response_length = 272"),
])
def test_bad_values_fail_before_any_heavy_work(override, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg(override if isinstance(override, list) else [override]))


@pytest.mark.parametrize("world,override,message", [
    (2, "rollout.tensor_model_parallel_size=3", r"rollout.tensor_model_parallel_size=3 does not divide the world "
                                                r"size 2"),
    (1, "rollout.tensor_model_parallel_size=2", "rollout.tensor_model_parallel_size=2 does not divide the world "
                                                "size 1"),
    (2, "rollout.tensor_model_parallel_size=0", "rollout.tensor_model_parallel_size=0: must be >= 1"),
    (4, "data.train_batch_size=3", r"data.train_batch_size=3 < world size 4"),
])
def test_impossible_engine_layout_fails_naming_the_key(monkeypatch, world, override, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # what torchrun sets; validate reads it before any process group
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg([override]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    validate(compose_cfg(["rollout.tensor_model_parallel_size=2"]))  # a layout that exists passes


def test_missing_files_are_named(tmp_path, model_dir):
    from rl.session import Session

    with pytest.raises(FileNotFoundError, match="data.train_files"):
        Session(compose_cfg(fast_overrides(tmp_path, model_dir) + ["data.train_files=/nope.parquet"]))
    with pytest.raises(FileNotFoundError, match="model.path"):
        Session(compose_cfg(fast_overrides(tmp_path, "/no/such/model")))


def test_no_train_prompt_that_fits_fails_before_the_model(tmp_path, model_dir):
    from rl.prompts import NoPromptFits
    from rl.session import Session

    # prompts are tokenized as drawn; the session's up-front check still fails here, not at step 1
    with pytest.raises(NoPromptFits, match=r"data.max_prompt_length=4: no train prompt fits \(all longer\)"):
        Session(compose_cfg(fast_overrides(tmp_path, model_dir) + ["data.max_prompt_length=4"]))


def test_bad_rows_are_counted_or_rejected_with_the_row_id(tmp_path, model_dir):
    from rl.data import BadRowError, load_splits, make_addition_splits, write_rows

    train, evals = make_addition_splits(n_train=20, n_eval=5)
    train[3] = {k: v for k, v in train[3].items() if k != "reward_model"}
    write_rows(train, tmp_path / "train.parquet")
    write_rows(evals, tmp_path / "eval.parquet")
    files = [f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'eval.parquet'}"]
    rows, _, stats = load_splits(compose_cfg(fast_overrides(tmp_path, model_dir) + files).data)
    assert len(rows) == 19 and stats["bad_rows_train"] == 1
    with pytest.raises(BadRowError, match="index="):
        load_splits(compose_cfg(fast_overrides(tmp_path, model_dir) + files + ["data.on_bad_row=error"]).data)


def _train_cmd(run_dir, model_dir, steps):
    return [sys.executable, "-m", "rl.train", *fast_overrides(run_dir, model_dir, steps)]


# Wall-clock fields, the only ones a resumed run's metrics rows may differ in.
TIMING_FIELDS = ("time/", "sync/ms", "sync/verify_ms")


def comparable_rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_FIELDS)} for r in rows]


def adapter_bytes(run_dir, step=3) -> bytes:
    return (Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "adapter" / "adapter_model.safetensors").read_bytes()


def sigkill_after_checkpoint(cmd: list[str], env: dict, run_dir: Path, step: int, timeout: float) -> None:
    """Start `cmd` (a training run writing to `run_dir`) and SIGKILL its whole process group once the checkpoint of
    `step` exists (or the run ended, or `timeout` passed); that checkpoint must be there."""
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    while not ckpt.is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt.is_dir()


def test_resume_after_sigkill_past_a_corrupt_checkpoint_matches_an_uninterrupted_run(tmp_path, model_dir):
    """SIGKILL after the second checkpoint, then the newest checkpoint's adapter is truncated: the same command again
    warns with the file's name, resumes from the checkpoint before it, and finishes with the adapter bytes and the
    per-step metrics (timing aside) of a run never killed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    full = tmp_path / "full"
    subprocess.run(_train_cmd(full, model_dir, 3), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    killed = tmp_path / "killed"
    sigkill_after_checkpoint(_train_cmd(killed, model_dir, 3), env, killed, step=2, timeout=600)
    newest = max((killed / "checkpoints").glob("step_*"))  # step 2, or 3 if the kill came after its checkpoint
    corrupt = newest / "adapter" / "adapter_model.safetensors"
    corrupt.write_bytes(corrupt.read_bytes()[: corrupt.stat().st_size // 2])
    p = subprocess.run(_train_cmd(killed, model_dir, 3), cwd=ROOT, env=env, check=True, capture_output=True,
                       text=True, timeout=600)
    assert f"skipping checkpoint: {corrupt}: checksum mismatch" in p.stderr, p.stderr[-3000:]
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_from_step"] == int(newest.name.removeprefix("step_")) - 1 >= 1
    assert adapter_bytes(full) == adapter_bytes(killed)
    expect = comparable_rows(full)
    assert [r["step"] for r in expect] == [1, 2, 3] and comparable_rows(killed) == expect
