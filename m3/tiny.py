"""Deterministic random-init tiny MiniMax-M3 checkpoints for CPU tests (nothing from a model hub).

``make_tiny_model(DIR)`` writes ``DIR`` for vLLM (``model_type: minimax_m3_vl`` + legacy ``text_config``,
original MiniMax weight names) and ``DIR-hf`` for transformers' ``MiniMaxM3VLForCausalLM`` (HF-internal
names; transformers converts MiniMax names only for the VL class). Both hold bit-identical tensors.
Each tensor has its own generator seeded by (seed, vLLM name), so a variant that drops tensors (e.g.
no sparse layers) keeps all the others unchanged.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from m3.config import (
    DTYPES,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB,
    hf_config_json,
    resolve_text_config,
    validate_config,
)
from m3.weights import from_hf_state_dict, init_weights, to_hf_state_dict

FORMAT_VERSION = 1  # bump when the layout, init or tokenizer recipe changes (invalidates caches)
MANIFEST = "tiny_model.json"
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                 "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class TinyModelPaths(NamedTuple):
    vllm: Path  # served checkpoint (original MiniMax names)
    hf: Path  # transformers reference copy (DIR-hf)


def tokenizer_corpus() -> list[str]:
    """The stdlib json package sources (sorted) plus digits/arithmetic, so numbers and operators
    get merges. It follows the Python build, so its hash goes into manifests and cache keys."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    return texts + [" ".join(str(i) for i in range(200)), "0.5 1.25 3.14159 -7 2**10 = 1024 1e-6 100% 1,000",
                    "1 + 1 = 2\n12 * 12 = 144\n(3 + 4) * 5 = 35\n81 / 9 = 9\n10 - 3 = 7\nx^2 + y^2 = z^2"]


def corpus_sha256() -> str:
    return hashlib.sha256("\0".join(tokenizer_corpus()).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def build_tokenizer_files() -> tuple[tuple[str, bytes], ...]:
    """Train the byte-level BPE; return its PreTrainedTokenizerFast files as (name, bytes). BPE
    training has nothing to seed; the tests check it gives the same bytes in fresh processes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(tokenizer_corpus(), trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[EOS_ID],
                                   pad_token=SPECIAL_TOKENS[PAD_ID], chat_template=CHAT_TEMPLATE)
    if (got := (len(fast), fast.eos_token_id, fast.pad_token_id)) != (TOKENIZER_VOCAB, EOS_ID, PAD_ID):
        raise RuntimeError(f"tokenizer (size, eos, pad) = {got}: corpus too small or specials moved")
    with tempfile.TemporaryDirectory() as d:
        fast.save_pretrained(d)
        return tuple((p.name, p.read_bytes()) for p in sorted(Path(d).iterdir()) if p.is_file())


def _dump_json(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()  # no timestamps, stable order


def _write_dir(path: Path, files: dict[str, bytes], tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    save_file(dict(sorted(tensors.items())), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "model.safetensors").chmod(0o644)  # save_file leaves it 0600, unlike the other files


def _hash_files(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.iterdir()) if p.is_file() and p.name != MANIFEST}


def _replace_dir(src: Path, dst: Path) -> None:  # an existing dst goes to the temp dir, deleted later
    if dst.exists():
        os.rename(dst, src.with_name(src.name + ".old"))
    os.rename(src, dst)


def make_tiny_model(out_dir, seed: int = 0, dtype: str = "bfloat16", **config_overrides) -> TinyModelPaths:
    """Write the vLLM checkpoint to ``out_dir`` and its transformers twin to ``out_dir-hf``.
    Everything is validated first; both copies are built in a temp dir beside ``out_dir``, then
    renamed into place (the manifest-bearing vLLM copy last), so a crash never leaves a checkpoint
    that looks complete but is not. Same args -> same bytes."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(DTYPES)}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed={seed!r}: must be an int")
    t = resolve_text_config(**config_overrides)
    validate_config(t)
    out = Path(out_dir).absolute()
    paths = TinyModelPaths(out, out.with_name(out.name + "-hf"))
    tok_files = dict(build_tokenizer_files())
    # Only ever replace our own output (a manifest / only our file names), never someone's data.
    ok = {"vllm": lambda d: (d / MANIFEST).is_file() or not any(d.iterdir()),
          "hf": lambda d: {p.name for p in d.iterdir()} <= {"config.json", "model.safetensors", *tok_files}}
    for kind, d in paths._asdict().items():
        if d.exists() and not (d.is_dir() and ok[kind](d)):
            raise FileExistsError(f"{d} exists and was not written by make_tiny_model")
    sd = init_weights(t, seed, dtype)
    config = {"architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3_vl",
              "dtype": dtype, "tie_word_embeddings": False, "eos_token_id": EOS_ID,
              "pad_token_id": PAD_ID, "text_config": {**t, "dtype": dtype}}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_dir(tmp / "hf", {**tok_files, "config.json": _dump_json(hf_config_json(t))},
                   to_hf_state_dict(sd, t))
        _write_dir(tmp / "vllm", {**tok_files, "config.json": _dump_json(config)}, sd)
        manifest = {"generator": "m3.tiny", "format_version": FORMAT_VERSION, "seed": seed,
                    "dtype": dtype, "config_overrides": config_overrides, "torch": torch.__version__,
                    "corpus_sha256": corpus_sha256(),
                    "files": _hash_files(tmp / "vllm"), "hf_files": _hash_files(tmp / "hf")}
        (tmp / "vllm" / MANIFEST).write_bytes(_dump_json(manifest))
        _replace_dir(tmp / "hf", paths.hf)
        _replace_dir(tmp / "vllm", paths.vllm)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


def _is_complete(paths: TinyModelPaths) -> bool:
    try:
        m = json.loads((paths.vllm / MANIFEST).read_bytes())
        return m["files"] == _hash_files(paths.vllm) and m["hf_files"] == _hash_files(paths.hf)
    except (OSError, ValueError, KeyError):
        return False


def ensure_tiny_model(cache_dir=None, seed: int = 0, dtype: str = "bfloat16",
                      **config_overrides) -> TinyModelPaths:
    """``cache_dir/m3tiny-<key>`` (+ ``-hf``), built unless a copy matching its manifest exists.
    ``cache_dir`` defaults to $M3RL_TINY_MODEL_CACHE, else <repo>/cache/tiny_models (git-ignored).
    The key hashes everything that determines the files (resolved config, seed, dtype, recipe
    version, corpus, torch version). A lock file serialises concurrent builders (xdist workers)."""
    cache = Path(cache_dir or os.environ.get("M3RL_TINY_MODEL_CACHE")
                 or Path(__file__).resolve().parents[1] / "cache" / "tiny_models").absolute()
    blob = json.dumps({"v": FORMAT_VERSION, "seed": seed, "dtype": dtype, "torch": torch.__version__,
                       "text_config": resolve_text_config(**config_overrides),
                       "corpus": corpus_sha256()}, sort_keys=True)
    out = cache / f"m3tiny-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
    paths = TinyModelPaths(out, out.with_name(out.name + "-hf"))
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        return paths if _is_complete(paths) else make_tiny_model(out, seed, dtype, **config_overrides)


def write_served_copy(src: TinyModelPaths, out_dir, hf_state: dict[str, torch.Tensor], dtype: str) -> Path:
    """A vLLM-layout checkpoint with ``src``'s config and tokenizer and the given (trained) transformers weights."""
    cfg = json.loads((src.vllm / "config.json").read_text())
    t = cfg["text_config"]
    sd = from_hf_state_dict(hf_state, t)
    keep_fp32 = ("block_sparse_moe.gate.weight", "e_score_correction_bias")  # vLLM's router is fp32
    sd = {k: (v.float() if k.endswith(keep_fp32) else v.to(DTYPES[dtype])).contiguous() for k, v in sd.items()}
    cfg["dtype"] = cfg["text_config"]["dtype"] = dtype
    files = {p.name: p.read_bytes() for p in src.vllm.iterdir() if p.is_file()
             and p.name not in ("config.json", "model.safetensors", MANIFEST)}
    out = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    _write_dir(tmp / "ckpt", {**files, "config.json": _dump_json(cfg)}, sd)
    if out.exists():
        shutil.rmtree(out)
    (tmp / "ckpt").rename(out)
    tmp.rmdir()
    return out
