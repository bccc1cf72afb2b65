"""verl-schema data: the built-in task's hash split, row validation (skip / error with row ids), the
DAPO-Math-17K and AIME-2024 layouts on tiny fixtures, chat-template token ids and the resumable cursor."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl.data import (
    BadRowError,
    PromptTooLong,
    SchemaError,
    addition_row,
    detect_aime_layout,
    encode_prompts,
    load_aime_2024,
    load_dapo_math_17k,
    load_verl_parquet,
    open_dataset,
    make_addition_splits,
    prompt_token_ids,
    split_of,
    validate_row,
    write_rows,
)
from rl.prompts import DataCursor
from rl.rewards import compute_score, route

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- built-in task

def test_make_data_cli(tmp_path):
    make_data = _load_script(ROOT / "scripts" / "make_data.py")
    make_data.main(["--out", str(tmp_path), "--n-train", "200", "--n-eval", "50", "--seed", "1"])
    train, report = load_verl_parquet(tmp_path / "train.parquet", on_bad_row="error")
    evals, _ = load_verl_parquet(tmp_path / "eval.parquet", on_bad_row="error")
    assert (len(train), len(evals), report.n_bad) == (200, 50, 0)
    for row in [*train, *evals]:
        (msg,) = row["prompt"]
        a, b = map(int, re.fullmatch(r"What is (\d\d) \+ (\d\d)\? Put the final answer in \\boxed\{\}\.",
                                     msg["content"]).groups())
        assert msg["role"] == "user" and row["reward_model"]["ground_truth"] == str(a + b)
        assert row["extra_info"]["target"] == f"\\boxed{{{a + b}}}" and row["extra_info"]["index"] == 100 * a + b
        assert row["extra_info"]["split"] == split_of(msg["content"])
        # the reference answer earns the reward, through the routing the trainer uses
        assert compute_score(row["data_source"], row["extra_info"]["target"], row["reward_model"]["ground_truth"])[
            "acc"] == 1
    assert {r["extra_info"]["index"] for r in train}.isdisjoint({r["extra_info"]["index"] for r in evals})


def test_split_is_by_question_hash_not_position():
    train, evals = make_addition_splits(n_train=None, n_eval=None)
    assert (len(train), len(evals)) == (7303, 797)
    ids = lambda rows: [r["extra_info"]["index"] for r in rows]  # noqa: E731
    assert len(set(ids(train)) | set(ids(evals))) == 8100 and not set(ids(train)) & set(ids(evals))
    # Seeds and sizes move which training rows are used, never which questions are eval.
    t0, e0 = make_addition_splits(n_train=300, n_eval=100, seed=0)
    t1, e1 = make_addition_splits(n_train=300, n_eval=100, seed=1)
    assert ids(e0) == ids(e1) == ids(evals)[:100]
    assert ids(t0) != ids(t1) and set(ids(t0)) | set(ids(t1)) <= set(ids(train))
    assert ids(make_addition_splits(n_train=300, n_eval=100, seed=0)[0]) == ids(t0)
    q = addition_row(12, 34, "train", 1234)["prompt"][0]["content"]
    assert split_of(q) == split_of(str(q))  # a function of the text only
    with pytest.raises(ValueError, match="eval split has 797"):
        make_addition_splits(n_eval=798)


# ---------------------------------------------------------------- validation

def _good_row(**changes):
    row = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Find 1 + 1."}], "ability": "MATH",
           "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 7}}
    row.update(changes)
    return row


@pytest.mark.parametrize("changes, reason", [
    ({"data_source": None}, "data_source missing"),
    ({"prompt": []}, "prompt is not a non-empty list"),
    ({"prompt": "Find 1 + 1."}, "prompt is not a non-empty list"),
    ({"prompt": [{"role": "user"}]}, "prompt[0].content missing"),
    ({"prompt": [{"role": "robot", "content": "hi"}]}, "prompt[0].role 'robot'"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "not 'user'"),
    ({"ability": ""}, "ability missing"),
    ({"reward_model": None}, "reward_model missing"),
    ({"reward_model": {"style": "rule", "ground_truth": " "}}, "ground_truth missing"),
    ({"reward_model": {"ground_truth": "2"}}, "style missing"),
    ({"extra_info": {}}, "extra_info.index missing"),
    ({"data_source": "m3rl/boxed_addition", "reward_model": {"style": "rule", "ground_truth": "1/2"}},
     "not an integer"),
])
def test_validate_row(changes, reason):
    assert validate_row(_good_row()) == []
    problems = validate_row(_good_row(**changes))
    assert any(reason in p for p in problems), problems


def test_bad_rows_are_skipped_or_rejected_with_row_ids(tmp_path):
    rows = [_good_row(extra_info={"index": i}) for i in range(5)]
    rows[1]["reward_model"] = {"style": "rule", "ground_truth": None}
    rows[3]["prompt"] = []
    path = tmp_path / "mixed.parquet"
    write_rows(rows, path)
    kept, report = load_verl_parquet(path)
    assert [r["extra_info"]["index"] for r in kept] == [0, 2, 4]
    assert (report.n_read, report.n_kept, report.n_bad) == (5, 3, 2)
    assert [(b.position, b.row_id) for b in report.bad] == [(1, "index=1"), (3, "index=3")]
    with pytest.raises(BadRowError, match=r"2 bad row\(s\): index=1: reward_model.ground_truth.*index=3: prompt"):
        load_verl_parquet(path, on_bad_row="error")
    with pytest.raises(ValueError, match="on_bad_row"):
        load_verl_parquet(path, on_bad_row="warn")


def test_missing_column_is_a_schema_error(tmp_path):
    path = tmp_path / "no_extra.parquet"
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in _good_row().items() if k != "extra_info"}]), path)
    with pytest.raises(SchemaError, match=r"columns \['extra_info'\] missing"):
        load_verl_parquet(path)


# ---------------------------------------------------------------- DAPO-Math-17K and AIME-2024 fixtures

def test_fixtures_match_their_generator():
    gen = _load_script(FIXTURES / "make_fixtures.py")
    for name, table in gen.tables().items():
        assert pq.read_table(FIXTURES / name).equals(table), f"{name}: rerun tests/rl/fixtures/make_fixtures.py"
    assert sum(p.stat().st_size for p in FIXTURES.iterdir()) < 50_000


def test_dapo_math_17k():
    rows, report = load_dapo_math_17k(FIXTURES / "dapo_math_17k_tiny.parquet")
    assert [r["extra_info"]["index"] for r in rows] == [0, 2, 6]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["34", "7", "-3"]  # "07" -> "7"
    assert (report.n_read, report.n_duplicates, report.n_gt_normalized) == (7, 1, 1)
    reasons = {b.row_id: b.reasons for b in report.bad}
    assert set(reasons) == {"index=3", "index=4", "index=5"}
    assert "routes to reward 'math_verify'" in reasons["index=5"][0]  # a GSM8K row in a DAPO file
    assert all(route(r["data_source"]) == "math_dapo" and r["prompt"][0]["content"].startswith("Solve the following")
               for r in rows)
    undeduped, report = load_dapo_math_17k(FIXTURES / "dapo_math_17k_tiny.parquet", dedup=False)
    assert len(undeduped) == 4 and report.n_duplicates == 0
    with pytest.raises(BadRowError, match="index=3"):
        load_dapo_math_17k(FIXTURES / "dapo_math_17k_tiny.parquet", on_bad_row="error")


@pytest.mark.parametrize("name, layout, n_rows, answers, bad", [
    ("aime_2024_verl_tiny.parquet", "verl", 6, ["24", "24", "24", "43", "43", "43"], []),
    ("aime_2024_pascal_tiny.parquet", "aime_pascal", 2, ["79", "99"], ["index=2", "index=3"]),
    ("aime_2024_lower_tiny.parquet", "aime_lower", 2, ["33", "125"], []),
])
def test_aime_2024_layouts(name, layout, n_rows, answers, bad):
    rows, report = load_aime_2024(FIXTURES / name)
    assert report.layout == layout == detect_aime_layout(pq.read_schema(FIXTURES / name).names)
    assert len(rows) == n_rows and [r["reward_model"]["ground_truth"] for r in rows] == answers
    assert [b.row_id for b in report.bad] == bad
    for row in rows:
        assert validate_row(row) == [] and route(row["data_source"]) == "math_dapo"
        text = row["prompt"][0]["content"]
        assert text.startswith("Solve the following math problem") and text.endswith('after "Answer:".')
        gt = row["reward_model"]["ground_truth"]
        assert compute_score(row["data_source"], f"work...\nAnswer: {gt}", gt)["acc"] == 1
    if layout != "verl":
        assert rows[0]["data_source"] == "aime-2024" and rows[0]["extra_info"]["split"] == "test"


def test_aime_2024_dedup_and_unknown_layout(tmp_path):
    rows, report = load_aime_2024(FIXTURES / "aime_2024_verl_tiny.parquet", dedup=True)
    assert len(rows) == 2 and report.n_duplicates == 4
    pascal, report = load_aime_2024(FIXTURES / "aime_2024_pascal_tiny.parquet")
    assert pascal[0]["extra_info"]["id"] == "2024-I-1"
    assert any("Problem missing" in r for r in report.bad[0].reasons)
    assert any("Answer missing" in r for r in report.bad[1].reasons)
    pq.write_table(pa.table({"question": ["q"], "solution": ["s"]}), tmp_path / "x.parquet")
    with pytest.raises(SchemaError, match="unknown AIME layout"):
        load_aime_2024(tmp_path / "x.parquet")


# ---------------------------------------------------------------- tokenization

def test_prompt_token_ids_match_the_rendered_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 34?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = prompt_token_ids(tokenizer, messages)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    with pytest.raises(PromptTooLong):
        prompt_token_ids(tokenizer, messages, max_length=len(ids) - 1)
    assert prompt_token_ids(tokenizer, messages, max_length=len(ids)) == ids


def test_encode_prompts_skips_or_rejects_long_prompts(tokenizer):
    rows = [_good_row(extra_info={"index": 0}),
            _good_row(prompt=[{"role": "user", "content": "long " * 200}], extra_info={"index": 1})]
    limit = len(prompt_token_ids(tokenizer, rows[0]["prompt"]))
    kept, ids, dropped = encode_prompts(rows, tokenizer, max_length=limit)
    assert kept == rows[:1] and len(ids) == 1 and dropped == ["index=1"]
    with pytest.raises(PromptTooLong, match="index=1"):
        encode_prompts(rows, tokenizer, max_length=limit, on_overlong="error")


# ---------------------------------------------------------------- cursor

def test_cursor_epochs_are_seeded_permutations():
    c = DataCursor(10, seed=3)
    e0, e1 = c.next_batch(10), c.next_batch(10)
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
    assert c.state_dict()["epoch"] == 2 and c.state_dict()["position"] == 0
    assert DataCursor(10, seed=3).epoch_order(1) == e1 and DataCursor(10, seed=4).epoch_order(0) != e0
    assert DataCursor(8, seed=0).epoch_order(0) == [1, 5, 0, 7, 4, 3, 6, 2]  # pinned: a change reorders old runs
    assert DataCursor(4, shuffle=False).next_batch(6) == [0, 1, 2, 3, 0, 1]


def test_cursor_resumes_exactly():
    straight = DataCursor(7, seed=11)
    expected = [straight.next_batch(3) for _ in range(8)]  # crosses epochs mid-batch
    c = DataCursor(7, seed=11)
    got = [c.next_batch(3) for _ in range(3)]
    state = dict(c.state_dict())
    assert (state["epoch"], state["position"]) == (1, 2)
    resumed = DataCursor.from_state(state)
    got += [resumed.next_batch(3) for _ in range(5)]
    assert got == expected
    for bad in ({"seed": 12}, {"n": 8}, {"shuffle": False}, {"position": 7}, {"version": 0}):
        with pytest.raises(ValueError):
            DataCursor(7, seed=11).load_state_dict({**state, **bad})


def test_json_and_saved_datasets_load_offline_into_the_given_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # nothing may land in $HOME
    rows = [_good_row(extra_info={"index": i}) for i in range(5)]
    rows[2] = {**rows[2], "reward_model": {"style": "rule", "ground_truth": ""}}
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_rows(rows, tmp_path / "rows.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    cache = tmp_path / "cache"
    for source in ("rows.jsonl", "rows.parquet", "saved"):
        kept, report = load_verl_parquet(tmp_path / source, cache_dir=cache)
        assert [r["extra_info"]["index"] for r in kept] == [0, 1, 3, 4] and report.n_bad == 1, source
        assert report.bad[0].row_id == "index=2"
    assert any(cache.rglob("*.arrow")) and not (tmp_path / "home").exists()
    assert isinstance(open_dataset(tmp_path / "rows.parquet", cache), datasets.Dataset)
