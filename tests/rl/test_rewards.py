"""Rewards by data_source: the strict integer match that math-verify's arithmetic cannot game, verl's
math_dapo for DAPO/AIME, math-verify elsewhere (and off the main thread)."""

import threading

import pytest

from rl import rewards
from rl.rewards import (
    BUILTIN_ADDITION_SOURCE,
    INVALID,
    compute_score,
    get_reward_fn,
    math_dapo_score,
    math_verify_score,
    register_reward,
    route,
    strict_int_score,
)

KEYS = {"score", "acc", "pred"}


@pytest.mark.parametrize("source, name", [
    (BUILTIN_ADDITION_SOURCE, "strict_int"),
    ("math_dapo", "math_dapo"), ("math", "math_dapo"), ("math_dapo_reasoning", "math_dapo"),
    ("aime-2024", "math_dapo"), ("aime24", "math_dapo"), ("aime_2025", "math_dapo"),
    ("openai/gsm8k", "math_verify"), ("HuggingFaceH4/MATH-500", "math_verify"), ("anything", "math_verify"),
])
def test_route(source, name):
    assert route(source) == name


def test_registry_refuses_a_second_function_under_a_name_and_unknown_names():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("strict_int")(lambda s, g: {})
    with pytest.raises(ValueError, match="already routes"):
        register_reward("other_fn", sources=("math_dapo",))(lambda s, g: {})
    assert "other_fn" not in rewards.REWARD_REGISTRY
    with pytest.raises(KeyError, match="unknown reward"):
        get_reward_fn("nope")


@pytest.mark.parametrize("text, score", [
    ("\\boxed{46}", 1.0),
    ("The sum is \\boxed{ 46 }.", 1.0),
    ("\\boxed{046}", 1.0),  # the same integer
    ("\\boxed{12+34}", 0.0),  # the hazard: math-verify evaluates this to 46
    ("\\boxed{46.0}", 0.0),
    ("\\boxed{{46}}", 0.0),
    ("46", 0.0),  # no box
    ("\\boxed{}", 0.0),
    ("\\boxed{٤٦}", 0.0),  # Arabic-Indic digits: int() would accept them
    ("\\boxed{12} then \\boxed{46}", 1.0),  # the last box counts
    ("\\boxed{46} then \\boxed{12}", 0.0),
    ("\\boxed{46} then \\boxed{4", 0.0),  # truncated last box: no fallback to the earlier one
    ("\\boxed 46", 0.0),
])
def test_strict_int(text, score):
    out = strict_int_score(text, "46")
    assert out["score"] == score and out["acc"] == int(score) and set(out) == KEYS


def test_strict_int_where_math_verify_is_fooled():
    gamed = "What is 12 + 34? \\boxed{12+34}"
    assert math_verify_score(gamed, "46")["acc"] == 1
    assert compute_score(BUILTIN_ADDITION_SOURCE, gamed, "46")["acc"] == 0


def test_strict_int_negative_and_bad_ground_truth():
    assert strict_int_score("\\boxed{-5}", "-5")["acc"] == 1
    assert compute_score(BUILTIN_ADDITION_SOURCE, "\\boxed{46}", 46)["acc"] == 1  # int ground truth from parquet
    with pytest.raises(ValueError, match="integer ground truth"):
        strict_int_score("\\boxed{1}", "1/2")


def test_math_dapo_is_verls_file_without_importing_verl():
    module = rewards.verl_math_dapo()
    assert module.__file__ == rewards.verl_math_dapo_path()
    assert module.__file__.endswith("verl/utils/reward_score/math_dapo.py")


@pytest.mark.parametrize("text, gt, score, pred", [
    ("... so the total is 34.\nAnswer: 34", "34", 1.0, "34"),
    ("Answer: $34$", "34", 1.0, "34"),
    ("Answer: 1,000", "1000", 1.0, "1000"),
    ("The answer is \\boxed{42}.", "42", 1.0, "42"),
    ("\\boxed{12+30}", "42", -1.0, "12+30"),  # exact string match on the box
    ("I do not know.", "42", -1.0, INVALID),
    ("Answer: 42\n" + "x" * 400, "42", -1.0, INVALID),  # only the last 300 characters are read
    ("Answer: 035", "35", -1.0, "035"),  # string compare: why the loaders strip leading zeros
    ("Answer: \\boxed{7}.", "7", -1.0, "7."),  # a trailing period survives normalization
    ("Answer: 7 \\boxed{7}", "7", -1.0, "77"),  # the whole line after "Answer:" is the answer
])
def test_math_dapo(text, gt, score, pred):
    out = compute_score("math_dapo", text, gt)
    assert out == {"score": score, "acc": int(score > 0), "pred": pred}
    assert compute_score("aime-2024", text, gt) == out


def test_math_verify_on_main_thread():
    assert math_verify_score("so x = \\boxed{\\frac{3}{4}}", "0.75") == {"score": 1.0, "acc": 1, "pred": "\\frac{3}{4}"}
    assert math_verify_score("\\boxed{0.7}", "3/4")["acc"] == 0
    assert math_verify_score("no answer at all", "3/4") == {"score": 0.0, "acc": 0, "pred": INVALID}
    assert set(compute_score("openai/gsm8k", "The answer is 42", "42")) == KEYS


def test_math_verify_off_main_thread_uses_a_process():
    # math-verify's signal.alarm timeouts raise off the main thread; the pool runs it in a process instead.
    results, errors = {}, []

    def worker():
        try:
            results["ok"] = math_verify_score("\\boxed{2\\pi}", "2\\pi")
            results["wrong"] = math_verify_score("\\boxed{6.28}", "2\\pi")
        except Exception as e:  # noqa: BLE001 - the failure is the point
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join(timeout=120)
    rewards.shutdown_pool()
    assert not errors and results["ok"]["acc"] == 1 and results["wrong"]["acc"] == 0


def test_same_keys_for_every_source():
    # verl's reward manager collects extra keys per sample; they must match across a mixed batch.
    outs = [compute_score(src, "\\boxed{7}\nAnswer: 7", "7", extra_info={"index": 0})
            for src in (BUILTIN_ADDITION_SOURCE, "math_dapo", "aime-2024", "other")]
    assert all(set(o) == KEYS and isinstance(o["acc"], int) and isinstance(o["score"], float) for o in outs)
    assert [o["score"] for o in outs] == [1.0, 1.0, 1.0, 1.0]
    assert math_dapo_score("Answer: 8", "7")["score"] == -1.0
