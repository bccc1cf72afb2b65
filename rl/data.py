"""Prompt data in verl's parquet schema, validated before anything expensive happens.

A row (verl ``examples/data_preprocess``, DAPO-Math-17K)::

    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "MATH",
     "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": "34"},
     "extra_info": {"index": 0, ...}}

- ``load_verl_parquet`` reads any file in that schema; rows with missing or malformed fields are counted
  and skipped, or rejected with their row ids (``on_bad_row="skip"|"error"``). Files are read through Hugging Face
  ``datasets`` (parquet, json/jsonl, or a ``save_to_disk`` folder), memory-mapped Arrow in batches, offline, cached
  under the run's ``trainer.cache_dir``/datasets. The kept rows come back as ``rl.rows.Rows``: the memory-mapped
  table plus the kept positions (8 bytes a row); a row is a dict only while it is read, normalised then.
- ``load_dapo_math_17k`` / ``load_aime_2024`` read those data sets from a path (nothing is fetched). AIME-2024
  comes in three layouts: verl schema (``BytedTsinghua-SIA/AIME-2024``, 30 problems x 32 copies = 960 rows),
  ``ID/Problem/Solution/Answer`` (``Maxwell-Jia/AIME_2024``, lm-eval's ``aime24``) and lower-case
  ``id/problem/solution/answer`` (``HuggingFaceH4/aime_2024``); the flat ones get DAPO's prompt.
- ``make_addition_splits``: the built-in task, split by a hash of the question.
- ``prompt_token_ids``: a chat prompt to token ids through the tokenizer's chat template.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

import numpy as np

from rl.rewards import BUILTIN_ADDITION_SOURCE, route
from rl.rows import Rows, records

OnBadRow = Literal["skip", "error"]
SCHEMA_FIELDS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
ROLES = ("system", "user", "assistant")
DAPO_SOURCE = "math_dapo"
AIME_SOURCE = "aime-2024"  # verl routes every aime* source to math_dapo
# DAPO-Math-17K's user message; flat AIME rows get it too, so eval prompts match training prompts.
DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")
ADDITION_QUESTION = "What is {a} + {b}? Put the final answer in \\boxed{{}}."
_INT = re.compile(r"[+-]?[0-9]+")
_MAX_IDS_IN_ERROR = 10


class SchemaError(ValueError):
    """The file as a whole has the wrong columns: no row could be valid."""


class BadRowError(ValueError):
    """Raised with ``on_bad_row="error"``; ``bad`` holds every bad row found."""

    def __init__(self, path, bad: list[BadRow]):
        self.bad = bad
        shown = "; ".join(f"{b.row_id}: {', '.join(b.reasons)}" for b in bad[:_MAX_IDS_IN_ERROR])
        more = f" (and {len(bad) - _MAX_IDS_IN_ERROR} more)" if len(bad) > _MAX_IDS_IN_ERROR else ""
        super().__init__(f"{path}: {len(bad)} bad row(s): {shown}{more}")


@dataclass
class BadRow:
    position: int  # 0-based row number in the file
    row_id: str  # "index=<extra_info.index>" when the row has one, else "row <position>"
    reasons: list[str]


@dataclass
class LoadReport:
    path: str
    layout: str
    n_read: int = 0
    n_kept: int = 0
    n_duplicates: int = 0  # dropped by dedup
    n_gt_normalized: int = 0  # integer ground truths rewritten, e.g. "035" -> "35"
    n_duplicate_ids: int = 0  # kept rows whose extra_info.index an earlier kept row has (their ids are ambiguous)
    bad: list[BadRow] = field(default_factory=list)

    @property
    def n_bad(self) -> int:
        return len(self.bad)

    def summary(self) -> str:
        return (f"{self.path} [{self.layout}]: read {self.n_read}, kept {self.n_kept}, bad {self.n_bad}, "
                f"duplicates dropped {self.n_duplicates}, ground truths normalized {self.n_gt_normalized}, "
                f"duplicate ids {self.n_duplicate_ids}")


# ----------------------------------------------------------------------------------------------
# validation

def row_id(row: Mapping, position: int) -> str:
    extra = row.get("extra_info")
    if isinstance(extra, Mapping) and extra.get("index") is not None:
        return f"index={extra['index']}"
    return f"row {position}"


def _nonempty_str(x) -> bool:
    return isinstance(x, str) and bool(x.strip())


def validate_row(row: Mapping) -> list[str]:
    """Every problem with ``row``; an empty list means the row is usable."""
    problems: list[str] = []
    source = row.get("data_source")
    if not _nonempty_str(source):
        problems.append("data_source missing or empty")
    prompt = row.get("prompt")
    if not isinstance(prompt, (list, tuple)) or not prompt:
        problems.append("prompt is not a non-empty list of {role, content} messages")
    else:
        for i, msg in enumerate(prompt):
            if not isinstance(msg, Mapping):
                problems.append(f"prompt[{i}] is not a {{role, content}} mapping")
                continue
            if msg.get("role") not in ROLES:
                problems.append(f"prompt[{i}].role {msg.get('role')!r} not in {ROLES}")
            if not _nonempty_str(msg.get("content")):
                problems.append(f"prompt[{i}].content missing or empty")
        last = prompt[-1]
        if isinstance(last, Mapping) and last.get("role") in ROLES and last.get("role") != "user":
            # add_generation_prompt opens the assistant turn right after the last message.
            problems.append(f"prompt ends with a {last.get('role')!r} message, not 'user'")
    if not _nonempty_str(row.get("ability")):
        problems.append("ability missing or empty")
    reward_model = row.get("reward_model")
    gt = None
    if not isinstance(reward_model, Mapping):
        problems.append("reward_model missing")
    else:
        gt = reward_model.get("ground_truth")
        if not _nonempty_str(gt):
            problems.append("reward_model.ground_truth missing or empty")
            gt = None
        if not isinstance(reward_model.get("style"), str):
            problems.append("reward_model.style missing")
    extra = row.get("extra_info")
    if not isinstance(extra, Mapping) or extra.get("index") is None:
        problems.append("extra_info.index missing")
    if gt is not None and _nonempty_str(source) and route(source) == "strict_int" and not _INT.fullmatch(gt.strip()):
        problems.append(f"reward_model.ground_truth {gt!r} is not an integer (reward strict_int)")
    return problems


def canonical_int(answer: str) -> str:
    """``"035"`` -> ``"35"``; anything that is not a plain integer is returned unchanged. math_dapo compares
    strings, so a zero-padded AIME key would mark every unpadded correct answer wrong."""
    s = answer.strip()
    return str(int(s)) if _INT.fullmatch(s) else answer


def _dedup_key(row: Mapping) -> bytes:
    """16 bytes per row (collision odds ~1e-27 at 1M rows): a 1M-row file's dedup keeps 16 MB of numpy keys, not a
    set of 1M Python strings."""
    payload = [row["data_source"], [[m["role"], m["content"]] for m in row["prompt"]],
               row["reward_model"]["ground_truth"]]
    return hashlib.blake2b(json.dumps(payload, ensure_ascii=False).encode(), digest_size=16).digest()


def _id_key(row_id_text: str) -> bytes:
    # 8 bytes: it only feeds the n_duplicate_ids count (a collision, ~3e-8 at 1M rows, would add one)
    return hashlib.blake2b(row_id_text.encode(), digest_size=8).digest()


# ----------------------------------------------------------------------------------------------
# loading

def _cache_dir(cache_dir=None) -> str:
    """Where `datasets` keeps its Arrow copies: the caller's (a run's trainer.cache_dir), HF_DATASETS_CACHE, else
    ./cache/datasets; never $HOME."""
    return str(cache_dir or os.environ.get("HF_DATASETS_CACHE") or Path("cache") / "datasets")


def open_dataset(path, cache_dir=None):
    """A memory-mapped `datasets.Dataset` of a parquet / json(l) file or a `save_to_disk` folder; local files only."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read before `datasets` is first imported: never the Hub
    import datasets

    datasets.disable_progress_bars()  # stdout/stderr carry our reports
    p = Path(path)
    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
        return ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
    if not p.is_file():
        raise FileNotFoundError(f"no data file or dataset folder at {path}")
    builder = "json" if p.suffix in (".json", ".jsonl") else "parquet"
    return datasets.load_dataset(builder, data_files=str(p.resolve()), split="train", cache_dir=_cache_dir(cache_dir))


def _records(ds) -> Iterator[dict]:
    # Batches from the memory-mapped Arrow table: the 1.79 M-row DAPO file never becomes a 1.79 M-dict list. 1024 rows
    # a batch: the load's peak is ~2 MB of dicts (8192: ~15 MB), at the same speed (measured on 200K rows).
    for batch in ds.iter(batch_size=1024):
        yield from records(batch)


AIME_FLAT_LAYOUTS = {
    "aime_pascal": {"problem": "Problem", "answer": "Answer", "id": "ID"},  # Maxwell-Jia/AIME_2024
    "aime_lower": {"problem": "problem", "answer": "answer", "id": "id"},  # HuggingFaceH4/aime_2024
}


def _answer_text(value) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float):  # pandas-written int columns with a null become float
        return str(int(value)) if value.is_integer() else None
    return str(value).strip() or None


@dataclass(frozen=True)
class RowReader:
    """A stored record -> the verl-schema row callers see. The load pass validates what it returns; `Rows` calls it
    again each time a kept row is read, so the normalised rows are never stored (the file is the storage)."""

    layout: str  # "verl" or a key of AIME_FLAT_LAYOUTS
    data_source: str = AIME_SOURCE  # flat layouts' rows get it
    normalize_int_answers: bool = False

    def read(self, record: dict, position: int) -> tuple[dict, list[str]]:
        """(row before normalisation, problems only a flat layout can know about: the row's own are validate_row's)"""
        if self.layout == "verl":
            return record, []
        spec = AIME_FLAT_LAYOUTS[self.layout]
        problem, answer = record.get(spec["problem"]), _answer_text(record.get(spec["answer"]))
        problems = []
        if not _nonempty_str(problem):
            problems.append(f"{spec['problem']} missing or empty")
        if answer is None:
            problems.append(f"{spec['answer']} missing or not a number/string")
        row = {
            "data_source": self.data_source,
            "prompt": [{"role": "user", "content": DAPO_PROMPT.format(problem=(problem or "").strip())}],
            "ability": "MATH",
            "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": answer or ""},
            "extra_info": {"index": position, "split": "test", "id": str(record.get(spec["id"], ""))},
        }
        return row, problems

    def normalized(self, row: dict) -> dict:
        gt = row["reward_model"]["ground_truth"]
        if not self.normalize_int_answers or canonical_int(gt) == gt:
            return row
        return {**row, "reward_model": {**row["reward_model"], "ground_truth": canonical_int(gt)}}

    def __call__(self, record: dict, position: int) -> dict:  # Rows' to_row: a kept (valid) row as read
        return self.normalized(self.read(record, position)[0])


def _collect(path, ds, reader: RowReader, *, on_bad_row: OnBadRow, dedup: bool,
             expect_reward: str | None) -> tuple[Rows, LoadReport]:
    if on_bad_row not in ("skip", "error"):
        raise ValueError(f"on_bad_row must be 'skip' or 'error', got {on_bad_row!r}")
    report, n = LoadReport(str(path), reader.layout), len(ds)
    # Per kept row: its position (8 B), its dedup key (16 B) and a key of its id (8 B), in preallocated buffers.
    kept, keys, ids, k = np.empty(n, np.int64), bytearray(16 * n if dedup else 0), bytearray(8 * n), 0
    for position, record in enumerate(_records(ds)):
        report.n_read += 1
        row, problems = reader.read(record, position)
        problems = problems or validate_row(row)
        if not problems and expect_reward and route(row["data_source"]) != expect_reward:
            problems = [f"data_source {row['data_source']!r} routes to reward {route(row['data_source'])!r}, "
                        f"expected {expect_reward!r}"]
        if problems:
            report.bad.append(BadRow(position, row_id(row, position), problems))
            continue
        normalized = reader.normalized(row)
        report.n_gt_normalized += normalized is not row
        if dedup:
            keys[16 * k:16 * (k + 1)] = _dedup_key(normalized)
        ids[8 * k:8 * (k + 1)] = _id_key(row_id(row, position))
        kept[k], k = position, k + 1
    kept, ids = kept[:k], np.frombuffer(ids, np.uint64, count=k)
    if dedup:  # the first copy of each key, in file order (np.unique's return_index is the first occurrence)
        _, first = np.unique(np.frombuffer(keys, np.uint64, count=2 * k).reshape(k, 2), axis=0, return_index=True)
        first.sort()
        report.n_duplicates = k - len(first)
        kept, ids = kept[first], ids[first]
    report.n_duplicate_ids = len(kept) - len(np.unique(ids))  # kept rows whose id an earlier kept row has
    report.n_kept = len(kept)
    if report.bad and on_bad_row == "error":
        raise BadRowError(path, report.bad)
    return Rows(ds, kept, reader), report


def load_verl_parquet(path, *, on_bad_row: OnBadRow = "skip", dedup: bool = False,
                      normalize_int_answers: bool = False, expect_reward: str | None = None,
                      cache_dir=None) -> tuple[Rows, LoadReport]:
    """Rows of a verl-schema parquet file plus a report of what was dropped and why.

    ``expect_reward``: rows whose data_source routes to another reward are bad rows (e.g. a GSM8K file
    passed where DAPO was meant would otherwise be scored by a different function without notice)."""
    ds = open_dataset(path, cache_dir)
    missing = [c for c in SCHEMA_FIELDS if c not in ds.column_names]
    if missing:
        raise SchemaError(f"{path}: columns {missing} missing (has {list(ds.column_names)}); expected verl's schema")
    return _collect(path, ds, RowReader("verl", normalize_int_answers=normalize_int_answers), on_bad_row=on_bad_row,
                    dedup=dedup, expect_reward=expect_reward)


def load_dapo_math_17k(path, *, on_bad_row: OnBadRow = "skip", dedup: bool = True,
                       cache_dir=None) -> tuple[Rows, LoadReport]:
    """DAPO-Math-17K (verl schema, data_source ``math_dapo``). The Hub file repeats each of ~17.4 k problems
    ~100x (1.79 M rows); ``dedup`` keeps the first copy, so an epoch of the cursor sees each problem once
    and a GRPO batch never holds two groups of the same prompt."""
    return load_verl_parquet(path, on_bad_row=on_bad_row, dedup=dedup, normalize_int_answers=True,
                             expect_reward="math_dapo", cache_dir=cache_dir)


def detect_aime_layout(columns) -> str:
    cols = set(columns)
    if set(SCHEMA_FIELDS) <= cols:
        return "verl"
    for name, spec in AIME_FLAT_LAYOUTS.items():
        if {spec["problem"], spec["answer"]} <= cols:
            return name
    raise SchemaError(f"unknown AIME layout, columns {sorted(cols)}: expected verl's schema, "
                      f"ID/Problem/Answer or id/problem/answer")


def load_aime_2024(path, *, on_bad_row: OnBadRow = "skip", dedup: bool = False,
                   data_source: str = AIME_SOURCE, cache_dir=None) -> tuple[Rows, LoadReport]:
    """AIME-2024 in any of the three layouts, as verl-schema rows scored by math_dapo.

    ``dedup`` is off by default: the verl-schema file's 32 copies per problem are how DAPO measures avg@32
    with one sample per row. Flat layouts get ``data_source`` (default ``aime-2024``); verl-schema rows
    keep theirs, which must route to math_dapo."""
    ds = open_dataset(path, cache_dir)
    try:
        layout = detect_aime_layout(ds.column_names)
    except SchemaError as e:
        raise SchemaError(f"{path}: {e}") from None  # the file, as the other loaders' errors name it
    return _collect(path, ds, RowReader(layout, data_source, normalize_int_answers=True), on_bad_row=on_bad_row,
                    dedup=dedup, expect_reward="math_dapo")


def write_rows(rows, path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)


# ----------------------------------------------------------------------------------------------
# built-in task: 2-digit addition

def question_hash(question: str) -> int:
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "little")


def split_of(question: str, eval_mod: int = 10) -> str:
    """``"eval"`` for about 1 in ``eval_mod`` questions. A function of the text alone, so the split does
    not move with sampling order, seeds or sizes, and a question can never be in both."""
    return "eval" if question_hash(question) % eval_mod == 0 else "train"


def addition_row(a: int, b: int, split: str, index: int) -> dict:
    question = ADDITION_QUESTION.format(a=a, b=b)
    return {
        "data_source": BUILTIN_ADDITION_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        # target: the reference answer, for an SFT warm-up before GRPO
        "extra_info": {"index": index, "split": split, "a": a, "b": b, "target": f"\\boxed{{{a + b}}}"},
    }


def make_addition_splits(n_train: int | None = None, n_eval: int | None = 500, seed: int = 0,
                         eval_mod: int = 10) -> tuple[list[dict], list[dict]]:
    """All 8,100 pairs a, b in 10..99, hash-split (797 eval / 7,303 train at eval_mod 10). Eval = the first ``n_eval``
    eval questions in hash order, whatever the seed, so runs with different seeds share one eval set;
    train = the train pool shuffled by ``seed``, first ``n_train``. ``index`` = 100a + b, stable everywhere."""
    pools: dict[str, list[tuple[int, int, str]]] = {"train": [], "eval": []}
    for a in range(10, 100):
        for b in range(10, 100):
            q = ADDITION_QUESTION.format(a=a, b=b)
            pools[split_of(q, eval_mod)].append((a, b, q))
    eval_pool = sorted(pools["eval"], key=lambda t: question_hash(t[2]))
    train_pool = list(pools["train"])
    random.Random(seed).shuffle(train_pool)
    for name, pool, n in (("train", train_pool, n_train), ("eval", eval_pool, n_eval)):
        if n is not None and not 0 <= n <= len(pool):
            raise ValueError(f"n_{name}={n}: the {name} split has {len(pool)} questions")
    train = [addition_row(a, b, "train", 100 * a + b) for a, b, _ in train_pool[:n_train]]
    evals = [addition_row(a, b, "eval", 100 * a + b) for a, b, _ in eval_pool[:n_eval]]
    return train, evals


def load_splits(data_cfg, cache_dir=None) -> tuple[Rows, Rows, dict]:
    """(train rows, eval rows, counts of bad rows) for a run's `data` config: the built-in addition task, or the
    parquet files of `data.kind` (DAPO-Math-17K trains against AIME-2024)."""
    if data_cfg.train_files == "builtin":
        train, evals = make_addition_splits(seed=data_cfg.seed, n_eval=data_cfg.val_size)
        return Rows.from_list(train), Rows.from_list(evals), {}
    for key in ("train_files", "val_files"):
        if not Path(data_cfg[key]).is_file():
            raise FileNotFoundError(f"data.{key}: no file at {data_cfg[key]}")
    loaders = {"verl": load_verl_parquet, "dapo_math_17k": load_dapo_math_17k, "aime_2024": load_aime_2024}
    train, rep_t = loaders[data_cfg.kind](data_cfg.train_files, on_bad_row=data_cfg.on_bad_row, cache_dir=cache_dir)
    val_loader = load_aime_2024 if data_cfg.kind == "dapo_math_17k" else load_verl_parquet
    evals, rep_e = val_loader(data_cfg.val_files, on_bad_row=data_cfg.on_bad_row, cache_dir=cache_dir)
    for key, rows, rep in (("train_files", train, rep_t), ("val_files", evals, rep_e)):
        if not rows:  # before any model starts, not as an empty batch deep in training
            raise ValueError(f"data.{key}: no usable row in {rep.summary()}"
                             + (f"; e.g. {rep.bad[0].row_id}: {', '.join(rep.bad[0].reasons)}" if rep.bad else ""))
    return train, evals[:data_cfg.val_size], {"bad_rows_train": rep_t.n_bad, "bad_rows_val": rep_e.n_bad}


# ----------------------------------------------------------------------------------------------
# tokenization

class PromptTooLong(ValueError):
    pass


def prompt_token_ids(tokenizer, messages, max_length: int | None = None, **template_kwargs) -> list[int]:
    """Token ids of a chat prompt with the assistant turn opened (``add_generation_prompt=True``), exactly
    as vLLM's chat path renders it, so the rollout and the trainer see the same prompt tokens."""
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kwargs)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    ids = [int(t) for t in out]
    if max_length is not None and len(ids) > max_length:
        raise PromptTooLong(f"prompt has {len(ids)} tokens > max_length {max_length}")
    return ids


def encode_prompts(rows, tokenizer, max_length: int | None = None,
                   on_overlong: OnBadRow = "skip") -> tuple[list[dict] | Rows, list[list[int]], list[str]]:
    """(kept rows, their token ids, ids of rows dropped as too long) of a set small enough to hold its token ids (an
    eval split: data.val_size rows); training prompts are tokenized per batch (rl.prompts). Rows must already be
    validated; kept rows are a view when `rows` is one."""
    kept, ids, dropped = [], [], []
    for position, row in enumerate(rows):
        try:
            tokens = prompt_token_ids(tokenizer, row["prompt"], max_length)
        except PromptTooLong as e:
            if on_overlong == "error":
                raise PromptTooLong(f"{row_id(row, position)}: {e}") from None
            dropped.append(row_id(row, position))
            continue
        kept.append(position if isinstance(rows, Rows) else row)
        ids.append(tokens)
    return (rows.select(kept) if isinstance(rows, Rows) else kept), ids, dropped
