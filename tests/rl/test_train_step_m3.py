"""scripts/train_step_m3.py (the full-size launcher) at CPU scale under real torchrun + gloo, and the synthetic
served-format base it builds from."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m3.config import resolve_text_config
from quant.checkpoint import MXFP8Weight, NVFP4Weight
from rl.model.synthetic_base import SyntheticCheckpoint
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "num_local_experts": 8, "vocab_size": 1024, "shared_intermediate_size": 128, "dense_intermediate_size": 256,
         "sparse_attention_config": {"sparse_topk_blocks": 2, "sparse_num_index_heads": 2}}


def test_synthetic_checkpoint_serves_formats_deterministically():
    t = resolve_text_config(num_hidden_layers=2, sparse_topk_blocks=2)
    a, b = SyntheticCheckpoint(t, seed=3), SyntheticCheckpoint(t, seed=3)
    m = "model.layers.1.block_sparse_moe.experts.5"
    w1, w3, w2 = (a.read(f"{m}.{p}") for p in ("w1", "w3", "w2"))
    assert all(isinstance(w, NVFP4Weight) for w in (w1, w3, w2))
    assert torch.equal(w1.global_scale, w3.global_scale)  # fused w13: one global scale, the engine's
    assert not torch.equal(w1.global_scale, w2.global_scale)
    assert torch.equal(b.read(f"{m}.w3").packed, w3.packed)  # a function of (seed, name)
    assert not torch.equal(SyntheticCheckpoint(t, seed=4).read(f"{m}.w3").packed, w3.packed)
    q = a.read("model.layers.0.self_attn.q_proj")
    assert isinstance(q, MXFP8Weight) and q.shape == (t["num_attention_heads"] * t["head_dim"], t["hidden_size"])
    norm = a.tensor("model.layers.0.input_layernorm.weight")
    assert norm.dtype == torch.bfloat16 and a.tensor("model.layers.1.block_sparse_moe.gate.weight").dtype == torch.float32
    assert a.dequantized(f"{m}.w2").shape == w2.shape


# What the GPU machine's image lacks (it has torch, Triton, transformers, peft; no vLLM, no network): the launcher
# runs there, so here it runs with these unimportable. Run124 failed on the H200 at `import omegaconf`, pulled in by
# a helper imported from rl.session.
GPU_MACHINE_LACKS = ("omegaconf", "hydra", "vllm", "verl", "wandb")
# None in sys.modules: `import omegaconf` raises ModuleNotFoundError, importlib.util.find_spec (libraries probing
# optional packages) answers None, as for a package that is not installed
BLOCK = f"import sys\nsys.modules.update(dict.fromkeys({GPU_MACHINE_LACKS!r}))\n"


def _launch(tmp_path, *extra):
    out = tmp_path / f"step{len(extra)}.json"
    site = tmp_path / "gpu_machine_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "scripts" / "train_step_m3.py"), "--device", "cpu", "--layers", "2", "--seq-len", "260",
           "--seqs-per-rank", "2", "--steps", "1", "--override", json.dumps(SMALL), "--out", str(out), *extra]
    # the site folder first on the path; the launcher puts the repo root on it itself
    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    # faulthandler: an abort prints every thread's Python stack (an abort at exit showed none: it was in C++)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONPATH=path)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-3000:]
    return json.loads(out.read_text())


def test_launcher_two_gloo_ranks(tmp_path):
    r = _launch(tmp_path)
    assert r["world_size"] == 2 and r["shape"]["num_hidden_layers"] == 2 and r["shape"]["hidden_size"] == 256
    assert r["tokens_per_step"] == 2 * 2 * 260 and r["tokens_per_s"] > 0
    assert all(x["finite"] and len(x["step_s"]) == 2 for x in r["ranks"])
    # Python's collector timed per step (gc.callbacks), its passes counted over the timed steps
    assert all(len(x["gc_s"]) == 2 and len(x["gc_passes_timed_steps"]) == 3 for x in r["ranks"])
    # --shard-base 1 (default): each rank holds about half of the packed NVFP4/MXFP8 bytes the other run replicates
    replicated = _launch(tmp_path, "--shard-base", "0")["ranks"][0]["packed_local_gb"]
    sharded = [x["packed_local_gb"] for x in r["ranks"]]
    assert all(0.45 < s / replicated < 0.55 for s in sharded), (sharded, replicated)


def test_slice_pairs_ratios_per_round_and_incomplete_rounds_left_out(tmp_path):
    # scripts/gpu/slice_pairs.py on slices as train_step_m3.py writes them: round 1 lost its bf16 slice (cut by the
    # budget), so it gives a quantized/base ratio but no pair
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    import slice_pairs

    tok = {(0, "quantized"): 25100, (0, "bf16"): 25000, (0, "base_quantized"): 24900,
           (1, "quantized"): 24800, (1, "base_quantized"): 24900,
           (2, "quantized"): 25000, (2, "bf16"): 25200, (2, "base_quantized"): 25000}
    def write(i, cfg, t, chunk=16384):
        settings = {"layers": 4, "seqs_per_rank": 4, "moe_chunk_tokens": chunk, "base": cfg.removeprefix("base_")}
        (tmp_path / f"r{i}_{cfg}.json").write_text(json.dumps(
            {"tokens_per_s": t, "peak_allocated_gb_max": 70.0, "mfu_vs_989_tflops": 0.3, "settings": settings}))

    for (i, cfg), t in tok.items():
        write(i, cfg, t)
    out = tmp_path / "pairs.json"
    assert slice_pairs.main([str(tmp_path), "--out", str(out), "--meta", '{"step": "pairs:4:4:3:base"}']) == 0
    r = json.loads(out.read_text())
    assert r["step"] == "pairs:4:4:3:base" and r["complete_pairs"] == 2
    assert r["settings"] == {"layers": 4, "seqs_per_rank": 4, "moe_chunk_tokens": 16384}
    assert [row["first"] for row in r["rounds"]] == ["quantized", "bf16", "quantized"]
    assert "quantized_over_bf16" not in r["rounds"][1]
    assert r["quantized_over_bf16"] == {"median": round((25100 / 25000 + 25000 / 25200) / 2, 4),
                                        "min": round(25000 / 25200, 4), "max": round(25100 / 25000, 4), "n": 2}
    assert r["quantized_over_base"]["n"] == 3 and r["quantized_over_base"]["median"] == 1.0
    # a slice run without MoE chunks beside ones with them: not a pair, refused by name
    write(2, "bf16", 25200, chunk=0)
    with pytest.raises(ValueError, match=r"r2_bf16.json differs .* \['moe_chunk_tokens'\]"):
        slice_pairs.summarize(slice_pairs.load(tmp_path))
    assert slice_pairs.main([str(tmp_path), "--out", str(out)]) == 1
    # no slice JSON at all: an error, not an empty result
    assert slice_pairs.main([str(tmp_path / "none"), "--out", str(out)]) == 1


def test_trace_without_profile_is_refused(capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_step_m3

    with pytest.raises(SystemExit):
        train_step_m3.parse_args(["--trace", "step.json.gz"])
    assert "--trace writes the profiled step's trace: it needs --profile 1" in capsys.readouterr().err
    assert train_step_m3.parse_args(["--trace", "step.json.gz", "--profile", "1"]).trace == "step.json.gz"
