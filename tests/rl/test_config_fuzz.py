"""Config fuzz (hypothesis): for every leaf of the structured schema (rl/config.py), values of the wrong type and
values outside the key's bounds are rejected before any model or engine starts, by Hydra's composition or by
rl.config.validate, with the key named. A numeric field missing from rl.config.BOUNDS fails here."""

import dataclasses
import enum
import math
import typing

import pytest
from hydra.errors import ConfigCompositionException
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl.config import BOUNDS, NONEMPTY, Config, validate
from tests.rl.test_train import compose_cfg

# Keys whose values are free text (names, paths: a missing file is named when the run starts, test_train.py), or
# checked by name in validate (test_train.py's bad-value table).
FREE_TEXT = {"model.path", "data.train_files", "data.val_files", "trainer.run_dir", "trainer.cache_dir",
             "logger.project", "check.adapter", "algorithm.loss_agg_mode",
             "algorithm.rollout_correction.rollout_rs"}
WORD = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8).filter(
    lambda w: w not in ("true", "false", "yes", "no", "on", "off", "null", "nan", "inf", "y", "n"))


def leaves(cls=Config, prefix="") -> list[tuple[str, type]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out += leaves(t, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", t))
    return out


def base_type(t):
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if typing.get_origin(t) in (typing.Union, getattr(__import__("types"), "UnionType")) else t


def number(x) -> str:
    return repr(float(x)) if isinstance(x, float) and math.isfinite(x) else str(x)


def outside(bound, kind) -> st.SearchStrategy:
    lo_open, hi_open = bound[0] == "(", bound[-1] == ")"
    lo, hi = [b for b in bound if b not in ("(", ")")]
    parts = []
    if kind is int:
        if lo is not None:
            parts.append(st.integers(max_value=lo if lo_open else lo - 1, min_value=-(2**40)))
        if hi is not None:
            parts.append(st.integers(min_value=hi if hi_open else hi + 1, max_value=2**64))
    else:
        if lo is not None:
            parts.append(st.floats(max_value=lo, exclude_max=not lo_open, min_value=-1e30))
        if hi is not None:
            parts.append(st.floats(min_value=hi, exclude_min=not hi_open, max_value=1e30))
        parts.append(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return st.one_of(parts).map(number)


def bad_values(key: str, t) -> st.SearchStrategy:
    t = base_type(t)
    origin = typing.get_origin(t)
    if t is bool:
        return st.one_of(WORD, st.floats(0.01, 0.99).map(repr))
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return WORD.filter(lambda w: w not in {m.value for m in t})
    if t in (int, float):
        wrong = st.one_of(WORD, st.just("[1,2]")) if t is float else st.one_of(WORD, st.floats(0.1, 0.9).map(repr))
        return st.one_of(wrong, outside(BOUNDS[key], t))
    if origin is list:
        elem = typing.get_args(t)[0]
        if elem is float:
            return st.one_of(WORD, st.lists(outside(BOUNDS[key], float), min_size=2, max_size=2).map(
                lambda xs: f"[{','.join(xs)}]"))
        return st.one_of(st.just("{a: 1}"), st.integers().map(str))
    if origin is dict:
        return st.one_of(WORD, st.just("[1,2]"))
    if t is str:
        return st.just("''") if key in NONEMPTY else st.just("[1,2]")
    raise AssertionError(f"{key}: no strategy for {t}")


def test_every_numeric_key_has_bounds():
    numeric = {k for k, t in leaves() if base_type(t) in (int, float) or typing.get_origin(base_type(t)) is list
               and typing.get_args(base_type(t))[0] is float}
    assert numeric == set(BOUNDS), f"missing: {sorted(numeric - set(BOUNDS))}, stale: {sorted(set(BOUNDS) - numeric)}"


@pytest.mark.parametrize("key,type_", leaves(), ids=[k for k, _ in leaves()])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_value_is_rejected_naming_the_key(key, type_, data):
    if key in FREE_TEXT and key not in NONEMPTY and base_type(type_) is str:
        value = "[1,2]"  # the only wrong type for free text
    else:
        value = data.draw(bad_values(key, type_), label=key)
    try:
        cfg = compose_cfg([f"{key}={value}"])
    except ConfigCompositionException as e:
        assert key in f"{e} {e.__cause__}", f"{key}={value}: {e} {e.__cause__}"
        return
    with pytest.raises(ValueError) as err:
        validate(cfg)
    assert key in str(err.value) or key.removeprefix("model.") in str(err.value), f"{key}={value}: {err.value}"
