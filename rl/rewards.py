"""Rewards selected by ``data_source``, registry style (like verl's ``core_algos``: small functions
registered under a name, looked up by a string).

Every reward returns the same keys, ``{"score": float, "acc": 0|1, "pred": str}``: verl's reward
manager turns the extra keys into per-sample lists, so keys that differ between data sources in one
batch would break it.

Routing (``route``):

- ``m3rl/boxed_addition`` (built-in task) -> ``strict_int``: math-verify scores ``\\boxed{12+34}`` as 46, so a
  policy that copies the prompt into the box would be paid.
- ``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*`` -> ``math_dapo``: verl's own scorer, the one the
  reference run used (±1 scale).
- anything else -> ``math_verify``: symbolic equivalence for free-form answers.

``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` has verl's custom-reward
signature (``reward.custom_reward_function.path=rl/rewards.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import os
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Callable

BUILTIN_ADDITION_SOURCE = "m3rl/boxed_addition"
INVALID = "[INVALID]"

RewardFn = Callable[[str, str], dict]
REWARD_REGISTRY: dict[str, RewardFn] = {}
_SOURCE_TO_REWARD: dict[str, str] = {}
_PREFIX_TO_REWARD: list[tuple[str, str]] = []
DEFAULT_REWARD = "math_verify"


def register_reward(name: str, *, sources: tuple[str, ...] = (), prefixes: tuple[str, ...] = ()):
    """Register ``fn(solution_str, ground_truth) -> {"score", "acc", "pred"}`` under ``name`` and route
    the exact ``sources`` and any data_source starting with one of ``prefixes`` to it."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARD_REGISTRY and REWARD_REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered: {REWARD_REGISTRY[name]} vs {fn}")
        for s in sources:
            if _SOURCE_TO_REWARD.get(s, name) != name:
                raise ValueError(f"data_source {s!r} already routes to {_SOURCE_TO_REWARD[s]!r}")
        REWARD_REGISTRY[name] = fn
        _SOURCE_TO_REWARD.update({s: name for s in sources})
        _PREFIX_TO_REWARD.extend((p, name) for p in prefixes if (p, name) not in _PREFIX_TO_REWARD)
        return fn

    return decorator


def route(data_source: str) -> str:
    """The reward name used for ``data_source``: exact match, then prefix, then the default."""
    if data_source in _SOURCE_TO_REWARD:
        return _SOURCE_TO_REWARD[data_source]
    for prefix, name in _PREFIX_TO_REWARD:
        if data_source.startswith(prefix):
            return name
    return DEFAULT_REWARD


def get_reward_fn(name: str) -> RewardFn:
    if name not in REWARD_REGISTRY:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(REWARD_REGISTRY)}")
    return REWARD_REGISTRY[name]


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl's custom-reward entry point; ``extra_info``/kwargs are accepted and unused."""
    return get_reward_fn(route(data_source))(solution_str, str(ground_truth))


def _result(correct: bool, pred: str | None, *, wrong: float = 0.0) -> dict:
    return {"score": 1.0 if correct else wrong, "acc": int(bool(correct)), "pred": INVALID if pred is None else pred}


# ----------------------------------------------------------------------------------------------
# strict integer match (built-in task)

_BOX = "\\boxed{"
_INT = re.compile(r"-?[0-9]+")  # [0-9], not \d: int() would also accept other scripts' digits


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced; None if there is none or the last one
    is never closed (a truncated answer does not fall back to an earlier box)."""
    start = text.rfind(_BOX)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOX)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


@register_reward("strict_int", sources=(BUILTIN_ADDITION_SOURCE,))
def strict_int_score(solution_str: str, ground_truth: str) -> dict:
    """1/0 on an integer equality of the last box. Only a literal integer counts: ``\\boxed{12+34}``,
    ``\\boxed{46.0}`` and an unboxed 46 all score 0, so the reward cannot be reached by arithmetic the
    model did not do."""
    gt = str(ground_truth).strip()
    if not _INT.fullmatch(gt):
        raise ValueError(f"strict_int needs an integer ground truth, got {ground_truth!r}")
    content = last_boxed_content(solution_str)
    if content is None:
        return _result(False, None)
    pred = content.strip()
    return _result(bool(_INT.fullmatch(pred)) and int(pred) == int(gt), pred)


# ----------------------------------------------------------------------------------------------
# verl math_dapo (DAPO-Math-17K, AIME)

_math_dapo_module = None
_math_dapo_lock = threading.Lock()


def verl_math_dapo_path() -> str | None:
    """Path of the installed ``verl/utils/reward_score/math_dapo.py`` (found without importing verl)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "utils", "reward_score", "math_dapo.py")
    return path if os.path.isfile(path) else None


def verl_math_dapo():
    """verl's math_dapo module. Loaded from its file: the module needs only ``re``, while ``import verl``
    pulls ray/transformers/hydra (~8 s, 3,000 modules) into every reward worker."""
    global _math_dapo_module
    with _math_dapo_lock:
        if _math_dapo_module is None:
            path = verl_math_dapo_path()
            if path is None:
                _math_dapo_module = importlib.import_module("verl.utils.reward_score.math_dapo")
            else:
                spec = importlib.util.spec_from_file_location("m3rl_verl_math_dapo", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                _math_dapo_module = module
    return _math_dapo_module


@register_reward("math_dapo", sources=("math_dapo", "math", "math_dapo_reasoning"), prefixes=("aime",))
def math_dapo_score(solution_str: str, ground_truth: str) -> dict:
    """verl's scorer unchanged: ``Answer: ...`` (Minerva-normalized) else the last box as an exact string,
    on the last 300 characters only; +1 / -1. Answers compare as strings, so ``035`` != ``35``: the
    loaders strip leading zeros from integer ground truths."""
    res = verl_math_dapo().compute_score(solution_str, str(ground_truth))
    return {"score": float(res["score"]), "acc": int(bool(res["acc"])), "pred": str(res["pred"])}


# ----------------------------------------------------------------------------------------------
# math-verify (everything else)

MATH_VERIFY_TIMEOUT_S = 5
_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def _math_verify(solution_str: str, ground_truth: str, timeout_s: int | None) -> tuple[bool, str | None]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # Gold is boxed, as verl does, so a bare "3/4" ground truth parses as LaTeX.
    gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),), parsing_timeout=timeout_s)
    pred = parse(solution_str, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=timeout_s)
    if not gold or not pred:
        return False, None
    # parse gives [sympy value, source string]; the string is what a human would check.
    return bool(verify(gold, pred, timeout_seconds=timeout_s)), str(pred[-1])


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            # spawn: a forked child of a multi-threaded trainer can inherit held locks.
            _pool = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    return _pool


def shutdown_pool() -> None:
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.shutdown(wait=False, cancel_futures=True)
            _pool = None


@register_reward("math_verify")
def math_verify_score(solution_str: str, ground_truth: str, timeout_s: int = MATH_VERIFY_TIMEOUT_S) -> dict:
    """1/0 by math-verify. Its timeouts use ``signal.alarm``, which exists only on the main thread, so
    off the main thread (reward worker threads) the check runs in a spawned process with the timeout
    on the future; a timeout scores 0."""
    gt = str(ground_truth)
    if threading.current_thread() is threading.main_thread():
        correct, pred = _math_verify(solution_str, gt, timeout_s)
        return _result(correct, pred)
    future = _get_pool().submit(_math_verify, solution_str, gt, timeout_s)
    try:
        correct, pred = future.result(timeout=(timeout_s or MATH_VERIFY_TIMEOUT_S) * 3)
    except FuturesTimeout:
        return _result(False, None)
    return _result(correct, pred)
