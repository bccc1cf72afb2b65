"""The embedded default's model: the tiny M3 built locally, warmed up by supervised training on the built-in task
until GRPO has something to work with, then quantized into the served format. Cached by everything that
determines it, so a second `make train` starts from the same checkpoint in seconds.

GRPO makes no progress from a policy that is almost never right (shared notes: < 0.1 sampled accuracy stalls),
so the warm-up stops at the first evaluation whose expected sampled accuracy reaches the target. Expected sampled
accuracy = mean over eval prompts of p(reference answer tokens | prompt) at temperature 1: exact for sampling up
to other token spellings of the same answer, and a single teacher-forced forward instead of generation.
"""

import hashlib
import json
import time
from pathlib import Path

import torch

from m3.tiny import ensure_tiny_model, write_served_copy
from quant.convert import quantize_checkpoint
from rl.data import prompt_token_ids


def _examples(rows, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return [(prompt_token_ids(tokenizer, r["prompt"]),
             tokenizer.encode(r["extra_info"]["target"], add_special_tokens=False) + [eos]) for r in rows]


def _answer_logprobs(model, items) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean token NLL, per-example summed answer logprob) with right padding (positions unaffected)."""
    length = max(len(p) + len(a) for p, a in items)
    ids = torch.full((len(items), length), 3)
    labels = torch.full((len(items), length), -100)
    for i, (p, a) in enumerate(items):
        seq = p + a
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, len(p) - 1:len(seq) - 1] = torch.tensor(a)
    logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    mask = labels >= 0
    token_lp = logprobs.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
    return -token_lp.sum() / mask.sum(), token_lp.sum(-1)


def expected_sampled_accuracy(model, items, batch: int = 100) -> float:
    with torch.no_grad():
        return float(torch.cat([_answer_logprobs(model, items[i:i + batch])[1] for i in range(0, len(items), batch)])
                     .exp().mean())


def build_builtin_model(cfg, train_rows, eval_rows, log=print) -> tuple[Path, dict]:
    """Tiny M3 -> SFT warm-up -> served bf16 copy -> quantized served copy; cached. Returns (model dir, stats)."""
    from transformers import AutoTokenizer
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    w, seed = cfg.warmup, cfg.trainer.seed
    paths = ensure_tiny_model(Path(cfg.trainer.cache_dir) / "tiny_models", seed=seed, dtype="float32",
                              **dict(w.tiny_overrides))
    # The warm-up is keyed by what determines it; the served copies (dtype, base) are derived from it.
    key = hashlib.sha256(json.dumps({"tiny": paths.vllm.name, "warmup": {k: w[k] for k in w if k != "tiny_overrides"},
                                     "n_train": len(train_rows), "v": 2}, sort_keys=True, default=str).encode()
                         ).hexdigest()[:12]
    root = Path(cfg.trainer.cache_dir) / "builtin" / key
    sft_file, done = root / "sft.safetensors", root / "warmup.json"
    served = root / f"{cfg.model.dtype}-{cfg.model.base}"
    if done.is_file() and served.is_dir():
        stats = json.loads(done.read_text())
        log(f"warm-up: reusing {served} (expected sampled accuracy {stats['expected_sampled_acc']:.3f})")
        return served, stats
    if done.is_file() and sft_file.is_file():
        from safetensors.torch import load_file

        stats = json.loads(done.read_text())
        log(f"warm-up: reusing {sft_file}; writing the served copy {served.name}")
        return _serve(paths, load_file(str(sft_file)), root, served, cfg), stats

    tokenizer = AutoTokenizer.from_pretrained(str(paths.vllm))
    train, evals = _examples(train_rows, tokenizer), _examples(eval_rows[:200], tokenizer)
    model = MiniMaxM3VLForCausalLM.from_pretrained(str(paths.hf), dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, betas=(0.9, 0.98), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    t0, acc, step = time.time(), 0.0, 0
    for step in range(1, w.max_steps + 1):
        for group in opt.param_groups:  # linear warm-up over 50 steps, then constant
            group["lr"] = w.lr * min(1.0, step / 50)
        idx = torch.randint(0, len(train), (w.batch_size,), generator=g).tolist()
        loss, _ = _answer_logprobs(model, [train[i] for i in idx])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % (w.eval_every if acc >= w.target_sampled_acc / 3 else w.coarse_eval_every) == 0:
            model.eval()
            acc = expected_sampled_accuracy(model, evals)
            model.train()
            log(f"warm-up step {step}: loss {loss.item():.3f}, expected sampled accuracy {acc:.3f} "
                f"({time.time() - t0:.0f} s)")
            if acc >= w.target_sampled_acc:
                break
    root.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(sft_file))
    stats = {"steps": step, "expected_sampled_acc": acc, "seconds": time.time() - t0, "tiny_model": str(paths.vllm)}
    done.write_text(json.dumps(stats, indent=2) + "\n")
    return _serve(paths, state, root, served, cfg), stats


def _serve(paths, state, root: Path, served: Path, cfg) -> Path:
    """The served checkpoint of the warmed-up weights: unquantized in the model dtype, then quantized if asked."""
    import shutil

    plain = write_served_copy(paths, root / f"{cfg.model.dtype}-plain", state, cfg.model.dtype)
    if cfg.model.base != "quantized":
        return plain
    tmp = served.with_name(served.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    quantize_checkpoint(plain, tmp)
    tmp.rename(served)
    return served
