"""The dry run (rl/plan.py): the recipe against a local M3-config checkpoint and data files in the public layouts
prints the plan and exits 0; a missing tensor, a layout the trainer cannot read, or too few usable prompts each fail
it, named."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from rl.plan import check_checkpoint, plan
from rl.sizing import compose_recipe
from tests.rollout.engine_fixtures import quantized_tiny_model

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "dapo_math_minimax_m31_flash.yaml"


def recipe(ckpt, math_data, *overrides):
    return compose_recipe(str(RECIPE), [f"model.path={ckpt}", f"data.train_files={math_data}/dapo-math-17k.parquet",
                                        f"data.val_files={math_data}/aime-2024-lower.parquet", "trainer.dry_run=true",
                                        *overrides])


def copy_with(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` whose tensors went through `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file(edit(load_file(str(f))), str(f))
    return dst


def test_recipe_dry_run_prints_the_plan_and_exits_0(math_data, tmp_path):
    ckpt = quantized_tiny_model("float32")
    p = subprocess.run([sys.executable, "-m", "rl.train", "--config-path", "../recipes", "--config-name", RECIPE.stem,
                        f"model.path={ckpt}", f"data.train_files={math_data}/dapo-math-17k.parquet",
                        f"data.val_files={math_data}/aime-2024-pascal.parquet", "trainer.dry_run=true",
                        f"trainer.run_dir={tmp_path}/run",  # Hydra's log and config there, not in the repo's runs/
                        # every library's debug log on: none of it may reach stdout, which carries only the plan
                        "hydra.job_logging.root.level=DEBUG"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["ranks"] == 16 and out["engine"] == {**out["engine"], "tensor_parallel": 4, "replicas": 4}
    assert out["checkpoint"]["problems"] == [] and out["checkpoint"]["expert_layouts"] == ["modelopt"]
    assert out["data"]["train_rows"] == 200 and out["data"]["val_rows"] == 8
    assert out["tokens_per_step"]["sequences"] == 64 * 16
    assert out["memory_per_gpu_gb"]["trainer_fits"] and out["resolved"]["rollout"]["max_model_len"] == 22528


def test_missing_expert_scale_fails_naming_the_tensor(math_data, tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight_scale_2"
    ckpt = copy_with(quantized_tiny_model("float32"), tmp_path / "ckpt",
                     lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=rf"{name}: missing \(modelopt NVFP4\)"):
        plan(recipe(ckpt, math_data))


def test_compressed_tensors_layout_is_recognised_but_the_trainer_cannot_read_it(math_data, tmp_path):
    renames = {".weight_scale_2": ".weight_global_scale"}

    def to_compressed_tensors(t):
        out = {}
        for k, v in t.items():
            if ".experts." in k and k.endswith(".weight"):
                k = k[:-len(".weight")] + ".weight_packed"
            for old, new in renames.items():
                k = k.replace(old, new) if ".experts." in k else k
            out[k] = v
        return out

    ckpt = copy_with(quantized_tiny_model("float32"), tmp_path / "ct", to_compressed_tensors)
    report = check_checkpoint(ckpt, json.loads((ckpt / "config.json").read_text())["text_config"])
    assert report["expert_layouts"] == ["compressed-tensors"] and report["problems"] == []
    assert not report["trainer_reader_opens_it"]
    with pytest.raises(ValueError, match="model.path: the trainer cannot read this checkpoint"):
        plan(recipe(ckpt, math_data))


def test_overlong_prompts_are_counted_and_too_few_left_fail(math_data):
    ckpt = quantized_tiny_model("float32")
    with pytest.raises(ValueError, match="data.train_files: 0 usable prompts < data.train_batch_size=64"):
        plan(recipe(ckpt, math_data, "data.max_prompt_length=100"))
    out = plan(recipe(ckpt, math_data, "data.train_batch_size=16"))
    assert out["data"]["train_dropped_overlong"] == 0 and out["data"]["steps_per_epoch"] == 12
