"""pass@1 and avg@k of a policy on a verl-schema parquet set, through the colocated engine or a vLLM server.

    python -m rl.eval --data eval.parquet --model DIR [--adapter PEFT_DIR]           # colocated RolloutEngine
    python -m rl.eval --data eval.parquet --url http://127.0.0.1:8000 --served-model NAME  # rollout.serve / vllm serve
        [--k 4 --temperature 1.0 --top-p 1.0 --max-tokens 256 --seed S --limit N --details]

Prints one JSON object on stdout (vLLM's logs go to stderr). Each prompt gets k samples, scored by
`rl.rewards.compute_score(data_source, text, ground_truth)`:
- `pass@1`: mean over prompts of the first sample's acc (one sampled answer per prompt);
- `avg@k`: mean acc over all prompts x k samples (DAPO's avg@32 with k=32) - the lower-variance estimate of
  the same quantity;
- `pass@k`: fraction of prompts with at least one correct sample.
Metric names are fixed (`avg@k`, not `avg@4`) so that callers (rl.train) read the same keys for every k; `k`
is in the result.

Library: `evaluate(engine_or_client, rows, k, ...)` with a `rollout.engine.RolloutEngine` (its loaded adapter,
if any, is what gets evaluated) or a `CompletionsClient`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from rl.data import load_verl_parquet, prompt_token_ids
from rl.rewards import compute_score
from rollout.adapter_sync import SERVED_LORA_RANKS

ScoreFn = Callable[[str, str, str], dict]


@dataclass
class Sample:
    text: str
    n_tokens: int
    finish_reason: str | None


# ----------------------------------------------------------------------------------------------
# samplers: (rows' chat prompts) -> k decoded samples each

class CompletionsClient:
    """An OpenAI-compatible vLLM server's /v1/completions, fed prompt token ids.

    Token ids come from the server's own chat template (POST /tokenize with the messages), or from a local
    tokenizer when one is given, so what is sampled from is exactly the prompt the colocated engine sees."""

    def __init__(self, url: str, model: str | None = None, tokenizer=None, timeout_s: float = 600.0,
                 concurrency: int = 8):
        self.url = url.rstrip("/")
        self.tokenizer, self.timeout_s, self.concurrency = tokenizer, timeout_s, concurrency
        models = self._get("/v1/models")["data"]
        ids = [m["id"] for m in models]
        if model is None:
            # The base model comes first in vLLM's listing; adapters follow.
            model = ids[0]
        elif model not in ids:
            raise ValueError(f"{self.url} does not serve model {model!r}; it serves {ids}")
        self.model = model
        # vLLM lists max_model_len on the base entry only (adapters have a `parent`).
        lens = [m.get("max_model_len") for m in models if m["id"] == model and m.get("max_model_len")]
        lens += [m.get("max_model_len") for m in models if m.get("parent") is None and m.get("max_model_len")]
        self.max_model_len = int(lens[0]) if lens else None

    def _request(self, path: str, payload: dict | None = None) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")[:500]
            raise RuntimeError(f"{self.url}{path}: HTTP {e.code}: {body}") from None

    def _get(self, path: str) -> dict:
        return self._request(path)

    def encode(self, messages: list[dict]) -> list[int]:
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.tokenizer is not None:
            return prompt_token_ids(self.tokenizer, messages)
        out = self._request("/tokenize", {"model": self.model, "messages": messages, "add_generation_prompt": True})
        return [int(t) for t in out["tokens"]]

    def complete(self, prompt: list[int], n: int, temperature: float, max_tokens: int, top_p: float = 1.0,
                 seed: int | None = None) -> list[Sample]:
        payload = {"model": self.model, "prompt": prompt, "n": n, "temperature": temperature, "top_p": top_p,
                   "max_tokens": max_tokens, "return_token_ids": True}
        if seed is not None:
            payload["seed"] = seed
        out = self._request("/v1/completions", payload)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise RuntimeError(f"asked {self.url} for n={n} samples, got {len(choices)}")
        return [Sample(c["text"], len(c.get("token_ids") or []), c.get("finish_reason")) for c in choices]

    def sample(self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int, top_p: float = 1.0,
               seed: int | None = None) -> list[list[Sample]]:
        # One request per prompt, several in flight: the server batches them, and a choice never has to be
        # mapped back to its prompt through vLLM's batched-prompt index arithmetic.
        with ThreadPoolExecutor(max_workers=max(1, self.concurrency)) as pool:
            futures = [pool.submit(self.complete, p, n, temperature, max_tokens, top_p, seed) for p in prompts]
            return [f.result() for f in futures]


class EngineSampler:
    """The colocated RolloutEngine (with whatever adapter it has loaded)."""

    def __init__(self, engine, batch_size: int = 64):
        self.engine, self.batch_size = engine, batch_size
        self.tokenizer = engine.llm.get_tokenizer()
        self.max_model_len = engine.cfg.max_model_len

    def encode(self, messages: list[dict]) -> list[int]:
        return prompt_token_ids(self.tokenizer, messages)

    def sample(self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int, top_p: float = 1.0,
               seed: int | None = None) -> list[list[Sample]]:
        out = []
        # Chunks bound what the engine's routing capture holds at once (one row per token per sample).
        for i in range(0, len(prompts), self.batch_size):
            groups = self.engine.generate(prompts[i:i + self.batch_size], n=n, temperature=temperature,
                                          max_tokens=max_tokens, top_p=top_p, seed=seed)
            out += [[Sample(self.tokenizer.decode(r.token_ids, skip_special_tokens=True), len(r.token_ids),
                            r.finish_reason) for r in group] for group in groups]
        return out


def as_sampler(engine_or_client):
    if hasattr(engine_or_client, "sample") and hasattr(engine_or_client, "encode"):
        return engine_or_client
    if hasattr(engine_or_client, "llm") and hasattr(engine_or_client, "generate"):
        return EngineSampler(engine_or_client)
    raise TypeError(f"evaluate needs a RolloutEngine or a CompletionsClient, got {type(engine_or_client).__name__}")


# ----------------------------------------------------------------------------------------------
# metrics

def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def pass_at(n: int, c: int, j: int) -> float:
    """Unbiased pass@j from n samples with c correct (Chen et al. 2021): 1 - C(n-c, j) / C(n, j)."""
    return 1.0 - math.comb(n - c, j) / math.comb(n, j)


def aggregate(details: list[dict], k: int) -> dict:
    """Metrics of per-row details (each with `acc`/`score`/`response_tokens`/`finish_reason` lists of length k).

    avg@k and `val_core` come from verl's `process_validation_metrics` (mean@k, bootstrap best@k / maj@k over the
    `pred`s, reduced over prompts as verl's trainer does). pass@1 (the first sample), pass@k (any correct) and the
    unbiased pass@j stay ours: verl has only the bootstrap best@N (resampled with replacement, so below pass@N)."""
    if not details:
        raise ValueError("no rows to aggregate")
    for d in details:
        if len(d["acc"]) != k:
            raise ValueError(f"row {d.get('index')}: {len(d['acc'])} samples, expected k={k}")
    flat = [(a, s, t, f) for d in details
            for a, s, t, f in zip(d["acc"], d["score"], d["response_tokens"], d["finish_reason"])]
    val_core = verl_validation_metrics(details, k)
    return {
        "n_prompts": len(details),
        "k": k,
        "pass@1": _mean(d["acc"][0] for d in details),
        "avg@k": val_core[f"acc/mean@{k}"],
        "pass@k": _mean(float(max(d["acc"])) for d in details),
        # unbiased pass@j for j = 1, 2, 4, .. <= k from the same k samples (pass@k above is its j = k case)
        "pass@j_unbiased": {str(j): _mean(pass_at(k, sum(d["acc"]), j) for d in details)
                            for j in (2 ** i for i in range(k.bit_length())) if j <= k},
        "val_core": val_core,
        "score_mean": _mean(s for _, s, _, _ in flat),
        "response_tokens_mean": _mean(t for _, _, t, _ in flat),
        "truncated_frac": _mean(float(f == "length") for *_, f in flat),
    }


def verl_validation_metrics(details: list[dict], k: int, seed: int = 42) -> dict:
    """verl's per-prompt validation statistics of acc and score, averaged over prompts (its trainer's `val-core`
    reduction); keys as verl names them: `acc/mean@k`, `acc/best@k/mean`, `acc/maj@k/mean`, ..."""
    from verl.trainer.ppo.metric_utils import process_validation_metrics  # verl's import costs seconds: on use

    uids = [str(i) for i, d in enumerate(details) for _ in range(k)]  # one group per row, whatever its index
    infos = {"acc": [float(a) for d in details for a in d["acc"]]}  # score: a second bootstrap, same signal
    if all("pred" in d for d in details):
        infos["pred"] = [str(p) for d in details for p in d["pred"]]
    state = np.random.get_state()  # verl's bootstrap reseeds numpy's global generator
    try:
        var2metric = process_validation_metrics(["all"] * len(uids), uids, infos, seed=seed)["all"]
    finally:
        np.random.set_state(state)
    return {f"{var}/{name}": float(value) for var, metrics in var2metric.items() for name, value in metrics.items()}


def evaluate(engine_or_client, rows: Sequence[dict], k: int = 4, *, temperature: float = 1.0, max_tokens: int = 256,
             top_p: float = 1.0, seed: int | None = None, score_fn: ScoreFn = compute_score,
             return_details: bool = True) -> dict:
    """Sample k answers for every verl-schema row, score them, return the metrics (and, by default, `details`:
    one dict per scored row with its k accs, scores, preds, lengths, finish reasons).

    Rows whose prompt leaves no room for `max_tokens` within the engine's max-model-len are left out and
    counted in `n_dropped_too_long` (the server would reject them; the engine would truncate the answer)."""
    if k < 1:
        raise ValueError(f"k={k}: need at least one sample per prompt")
    if not rows:
        raise ValueError("evaluate: no rows")
    sampler = as_sampler(engine_or_client)
    t0 = time.perf_counter()
    limit = getattr(sampler, "max_model_len", None)
    kept, prompts, dropped = [], [], []
    for position, row in enumerate(rows):
        ids = sampler.encode(row["prompt"])
        if limit is not None and len(ids) + max_tokens > limit:
            dropped.append(position)
            continue
        kept.append(row)
        prompts.append(ids)
    if not kept:
        raise ValueError(f"every row's prompt + max_tokens={max_tokens} exceeds max_model_len={limit}")
    groups = sampler.sample(prompts, n=k, temperature=temperature, max_tokens=max_tokens, top_p=top_p, seed=seed)
    details = []
    for row, ids, group in zip(kept, prompts, groups):
        gt = str(row["reward_model"]["ground_truth"])
        scores = [score_fn(row["data_source"], s.text, gt) for s in group]
        details.append({
            "index": (row.get("extra_info") or {}).get("index"), "data_source": row["data_source"],
            "ground_truth": gt, "prompt_tokens": len(ids),
            "acc": [int(r["acc"]) for r in scores], "score": [float(r["score"]) for r in scores],
            "pred": [str(r["pred"]) for r in scores], "response_tokens": [s.n_tokens for s in group],
            "finish_reason": [s.finish_reason for s in group], "responses": [s.text for s in group],
        })
    result = aggregate(details, k)
    sources = sorted({d["data_source"] for d in details})
    if len(sources) > 1:
        result["by_source"] = {src: {key: aggregate([d for d in details if d["data_source"] == src], k)[key]
                                     for key in ("n_prompts", "pass@1", "avg@k", "pass@k")} for src in sources}
    result.update(n_dropped_too_long=len(dropped), temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                  seed=seed, elapsed_s=round(time.perf_counter() - t0, 3))
    if return_details:
        result["details"] = details
    return result


# ----------------------------------------------------------------------------------------------
# CLI

def load_adapter_files(path) -> tuple[dict, dict]:
    """(tensors, adapter_config) of a peft adapter directory, as RolloutEngine.load_adapter takes them."""
    from safetensors.torch import load_file

    adir = Path(path)
    missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (adir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"--adapter {path}: {', '.join(missing)} missing (expected peft's format)")
    return load_file(str(adir / "adapter_model.safetensors")), json.loads((adir / "adapter_config.json").read_text())


def _finite(obj):
    """JSON has no NaN: metrics of an empty subset become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rl.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="verl-schema parquet")
    p.add_argument("--model", help="checkpoint dir: the colocated engine's model (with --url: a local tokenizer)")
    p.add_argument("--adapter", help="peft adapter dir loaded into the colocated engine")
    p.add_argument("--url", help="an OpenAI-compatible vLLM server, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model", help="with --url: the model (or adapter) name to query; default: the base")
    p.add_argument("--k", type=int, default=4, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="first N rows only")
    p.add_argument("--dtype", default="bfloat16", help="colocated engine dtype")
    p.add_argument("--max-model-len", type=int, default=2048, help="colocated engine context length")
    p.add_argument("--details", action="store_true", help="include per-row samples and scores in the JSON")
    args = p.parse_args(argv)
    if args.url is None and args.model is None:
        p.error("give --model DIR (colocated engine) or --url URL (server)")
    if args.url is not None and args.adapter is not None:
        p.error("--adapter loads into the colocated engine; a server serves adapters by name "
                "(python -m rollout.serve --adapter NAME=PATH, then --served-model NAME)")
    if args.url is None and args.served_model is not None:
        p.error("--served-model needs --url")
    if args.model is not None and not Path(args.model).is_dir():
        p.error(f"--model {args.model}: no such directory")
    if not Path(args.data).is_file():
        p.error(f"--data {args.data}: no such file")
    if args.k < 1:
        p.error("--k must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the one JSON object
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocated: one process, as in training
    rows, report = load_verl_parquet(args.data, on_bad_row="skip")
    print(report.summary(), file=sys.stderr)
    if args.limit is not None:
        rows = rows[:args.limit]
    sampling = dict(k=args.k, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                    seed=args.seed, return_details=args.details)
    run = {"data": str(args.data), "rows_bad": report.n_bad}
    engine = None
    try:
        if args.url:
            tokenizer = None
            if args.model:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(args.model)
            client = CompletionsClient(args.url, args.served_model, tokenizer=tokenizer)
            run.update(url=args.url, served_model=client.model)
            result = evaluate(client, rows, **sampling)
        else:
            from rollout.engine import EngineConfig, RolloutEngine  # imports vLLM: not needed with --url

            adapter = load_adapter_files(args.adapter) if args.adapter else None
            rank = int(adapter[1].get("r", 32)) if adapter else 32
            # The smallest max rank vLLM serves that fits keeps the LoRA buffers small.
            max_rank = min((r for r in SERVED_LORA_RANKS if r >= rank), default=rank)
            engine = RolloutEngine(EngineConfig(
                model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enable_lora=adapter is not None,
                max_lora_rank=max_rank, capture_routing=False, seed=args.seed or 0))
            if adapter:
                run["adapter_checksum"] = engine.load_adapter(*adapter)["checksum"]
            run.update(model=args.model, adapter=args.adapter)
            result = evaluate(engine, rows, **sampling)
    finally:
        if engine is not None:
            engine.close()
    out = _finite({**run, **result})
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
