"""`python -m rl.train` leaves its plots and an offline W&B run in the run folder: the PNGs decode at their size and
show curves; the `.wandb` file, read back as wandb's protobuf records, holds the config, every step's metrics, the
eval curve, the rollouts tables, the plots and the final adapter artifact."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from m3.tiny import ensure_tiny_model
from rl.plots import DPI, PANELS, SIZE_IN, write_plots
from tests.rl.test_train import ROOT, fast_overrides
from tests.rl.wandb_records import read_records, run_file, summarize

C0 = (31, 119, 180)  # matplotlib's first line colour: a drawn curve, not just axes
PNGS = sorted([f"{name}.png" for name, *_ in PANELS] + ["step_time.png"])
STEPS = 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("wandb_run") / "run"
    overrides = fast_overrides(run, str(ensure_tiny_model(dtype="float32").vllm), steps=STEPS)
    overrides = [o for o in overrides if not o.startswith("logger.wandb_mode")] + [
        "logger.wandb_mode=offline", "trainer.test_freq=1", "trainer.check_at_start=false"]
    env = {**os.environ, "WANDB_SILENT": "true", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "rl.train", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _has_colour(img: np.ndarray, rgb, tol=8) -> bool:
    return bool((np.abs(img[..., :3].astype(int) - np.array(rgb)).max(-1) <= tol).sum() > 20)


def test_plots_are_images_of_the_expected_size_and_not_blank(run_dir):
    files = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert files == PNGS
    size = (int(SIZE_IN[0] * DPI), int(SIZE_IN[1] * DPI))
    for name in files:
        img = np.asarray(Image.open(run_dir / "plots" / name).convert("RGB"))
        assert (img.shape[1], img.shape[0]) == size, name
        assert img.std() > 5 and len(np.unique(img.reshape(-1, 3), axis=0)) > 20, f"{name} is blank"
        assert _has_colour(img, C0), f"{name}: no curve drawn"


def test_a_panel_without_data_says_so(tmp_path):
    paths = write_plots([], [], tmp_path)
    assert sorted(p.name for p in paths) == PNGS
    img = np.asarray(Image.open(tmp_path / "reward.png").convert("RGB"))
    assert not _has_colour(img, C0) and img.std() > 5  # axes and the "no data yet" text, no curve


def test_offline_wandb_run_has_config_metrics_eval_curve_table_plots_and_adapter(run_dir):
    records = read_records(run_file(run_dir))
    assert records and {r.WhichOneof("record_type") for r in records} >= {"run", "history", "artifact"}
    w = summarize(run_file(run_dir))
    assert w["config"]["algorithm"]["adv_estimator"] == "grpo"
    assert w["config"]["trainer"]["total_training_steps"] == STEPS
    by_step = {}
    for row in w["history"]:
        by_step.setdefault(row["_step"], {}).update(row)
    assert sorted(by_step) == [0, 1, 2]  # eval before, then one row per step
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1, 2]  # test_freq=1: the last step's eval is the final one, run once
    assert {"step": 2, **json.loads((run_dir / "summary.json").read_text())["eval_after"]} == evals[-1]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # every scalar of metrics.jsonl went to W&B at its step
        logged = by_step[m["step"]]
        for k, v in m.items():
            if isinstance(v, float) and k != "step":
                assert logged[k] == pytest.approx(v), k
    assert all(f"eval/{k}" in by_step[s] for s in (0, 1, 2) for k in ("pass@1", "pass@k", "greedy_pass@1", "maj@4"))
    for s in (1, 2):  # the rollouts table at each eval after a step, and every plot
        assert by_step[s]["rollouts/_type"] == "table-file" and by_step[s]["rollouts/nrows"] > 0
        assert all(by_step[s][f"plots/{Path(p).stem}/_type"] == "image-file" for p in PNGS)
    table = json.loads(next((run_file(run_dir).parent / "files").glob("media/table/rollouts_2_*.table.json"))
                       .read_text())
    assert table["columns"] == ["prompt", "response", "reward", "is_ratio_mean", "is_ratio_max", "tokens"]
    assert all(r[0] and isinstance(r[2], float) and r[4] >= r[3] > 0 for r in table["data"])
    models = [a for a in w["artifacts"] if a[1] == "model"]
    assert len(models) == 1 and models[0][0].startswith("final_adapter-")
    assert sorted(models[0][2]) == ["adapter_config.json", "adapter_model.safetensors"]


def test_final_adapter_config_is_peft_loraconfig(run_dir):
    from peft import LoraConfig

    from rl.model.lora import LoRAConfig, peft_config

    loaded = LoraConfig.from_pretrained(str(run_dir / "final_adapter"))
    assert (loaded.r, loaded.lora_alpha, sorted(loaded.target_modules)) == (32, 64.0, sorted(LoRAConfig().target_modules))
    assert loaded.target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    written = json.loads((run_dir / "final_adapter" / "adapter_config.json").read_text())
    assert written == peft_config(LoRAConfig())  # what the engine receives in memory is what is on disk
    resaved = run_dir / "resaved"
    loaded.save_pretrained(str(resaved))  # peft's own writer: the same keys and values (lists up to order)
    theirs = json.loads((resaved / "adapter_config.json").read_text())
    assert {k: sorted(v) if isinstance(v, list) else v for k, v in theirs.items()} == {
        k: sorted(v) if isinstance(v, list) else v for k, v in written.items()}
