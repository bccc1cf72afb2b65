"""Rows as an Arrow-backed view (rl/rows.py) and training prompts tokenized when drawn (rl/prompts.py): a 50K-row
file loads with Python memory bounded far below a dict per row; the view reads rows as the loaders define them;
draws skip over-long prompts (counted, logged once) and a resumed cursor reproduces the uninterrupted draws; no
prompt that fits is one clear error, before and at a draw."""

import importlib.util
import sys
import tracemalloc
from pathlib import Path

import pytest

from rl.data import (
    load_dapo_math_17k,
    load_verl_parquet,
    open_dataset,
    prompt_token_ids,
    write_rows,
)
from rl.prompts import DataCursor, NoPromptFits, TrainPrompts, prompt_lengths
from rl.rows import Rows

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    path = ROOT / "scripts" / "bench_data_load.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _row(i: int, content: str | None = None, index: int | None = None) -> dict:
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": content or f"Find {i} + 1."}],
            "ability": "MATH", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i if index is None else index}}


def test_many_rows_load_without_a_dict_per_row(tmp_path):
    # 50K rows: tracemalloc makes each allocation ~8x dearer, and the load's per-row validation allocates (~3 s here)
    n = 50_000
    path, cache = tmp_path / "big.parquet", tmp_path / "cache"
    # every 1000th row repeats its predecessor's problem; every 7th has a zero-padded answer ("0" + answer)
    _bench().write_synthetic(path, n, duplicate_every=1000, pad_every=7)
    open_dataset(path, cache)  # datasets' Arrow copy is built before measuring: it is a file, not Python memory
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        rows, report = load_dapo_math_17k(path, cache_dir=cache)
        retained, peak = (m - start for m in tracemalloc.get_traced_memory())
        # The comparison: a dict per kept row, as the loader returned before, measured on 5,000 of these rows.
        before_sample = tracemalloc.get_traced_memory()[0]
        sample = list(rows[:5000])
        per_row = (tracemalloc.get_traced_memory()[0] - before_sample) / len(sample)
    finally:
        tracemalloc.stop()
    dicts = per_row * len(rows)
    assert retained < dicts / 50 and peak < dicts / 5, (retained, peak, dicts)
    assert retained < 16 * n + 2**18, retained  # measured: 8 bytes a kept row (its position) and a fixed cost
    duplicates = (n - 1) // 1000
    assert (report.n_read, report.n_kept, report.n_bad) == (n, n - duplicates, 0)
    # normalised before dedup: row 7000 ("0" + row 6999's answer) is still row 6999's duplicate
    assert report.n_duplicates == duplicates and report.n_gt_normalized == len(range(0, n, 7))
    assert report.n_duplicate_ids == 0
    assert rows[999]["extra_info"]["index"] == 999 and rows[1000]["extra_info"]["index"] == 1001
    assert rows[0]["reward_model"]["ground_truth"] == "0" and rows[-1]["extra_info"]["index"] == n - 1
    assert [r["reward_model"]["ground_truth"] for r in rows.take([7, 14, 6])] == ["7", "14", "6"]


def test_rows_view_reads_what_was_written(tmp_path):
    written = [_row(i) for i in range(10)]
    write_rows(written, tmp_path / "rows.parquet")
    rows, _ = load_verl_parquet(tmp_path / "rows.parquet", cache_dir=tmp_path / "cache")
    assert isinstance(rows, Rows) and len(rows) == 10 and list(rows) == written
    assert rows[-1] == written[-1] and rows[3] == written[3]
    tail = rows[7:]
    assert isinstance(tail, Rows) and list(tail) == written[7:] and list(rows[::-3]) == written[::-3]
    assert rows.take([4, 1, 4]) == [written[4], written[1], written[4]] and rows.take([]) == []
    assert list(rows.select([9, 0])) == [written[9], written[0]]
    for bad in (10, -11):
        with pytest.raises(IndexError):
            rows[bad]
    with pytest.raises(IndexError):
        rows.take([0, 10])
    with pytest.raises(TypeError, match="integers or slices"):
        rows["prompt"]
    in_memory = Rows.from_list(written)
    assert list(in_memory) == written and len(Rows.from_list([])) == 0 and list(Rows.from_list([])) == []


def test_duplicate_ids_and_dedup_counted_from_hashes(tmp_path):
    rows = [_row(0), _row(1, index=1), _row(2, index=1), _row(3, index=2), _row(4, index=2), _row(5, index=2),
            _row(0, index=9)]  # the last: row 0's problem again, under another id
    write_rows(rows, tmp_path / "ids.parquet")
    kept, report = load_verl_parquet(tmp_path / "ids.parquet", cache_dir=tmp_path / "cache")
    assert len(kept) == 7 and report.n_duplicate_ids == 3 and report.n_duplicates == 0
    kept, report = load_dapo_math_17k(tmp_path / "ids.parquet", cache_dir=tmp_path / "cache")
    assert [r["extra_info"]["index"] for r in kept] == [0, 1, 1, 2, 2, 2] and report.n_duplicates == 1
    assert report.n_duplicate_ids == 3


def _mixed(n=10):
    """Rows 1, 4, 7: prompts far longer than the others."""
    return Rows.from_list([_row(i, "long " * 100 if i % 3 == 1 else None) for i in range(n)])


def test_draws_skip_long_prompts_and_resume_exactly(tokenizer):
    rows = _mixed()
    limit = max(len(prompt_token_ids(tokenizer, rows[i]["prompt"])) for i in range(10) if i % 3 != 1)
    logs = []
    prompts, cursor = TrainPrompts(rows, tokenizer, limit, log=logs.append), DataCursor(10, seed=5)
    straight = [prompts.draw(cursor, 4) for _ in range(5)]  # 20 of 7 usable rows: three epochs, batches across them
    order = [i for e in range(4) for i in DataCursor(10, seed=5).epoch_order(e) if i % 3 != 1]
    assert [i for idx, _ in straight for i in idx] == order[:20]
    assert all(ids == [prompt_token_ids(tokenizer, rows[i]["prompt"]) for i in idx] for idx, ids in straight)
    assert prompts.n_too_long == 3 and sorted(prompts.too_long.nonzero()[0]) == [1, 4, 7]
    text = " ".join(logs)
    assert all(text.count(f"index={i} ") == 1 for i in (1, 4, 7)), logs  # each logged once, not every epoch
    assert prompt_lengths(rows, tokenizer).tolist() == [len(prompt_token_ids(tokenizer, r["prompt"])) for r in rows]

    for stop in (1, 2, 4):  # a resumed run: fresh prompts (nothing known too long) and the cursor's saved state
        first = TrainPrompts(rows, tokenizer, limit)
        c = DataCursor(10, seed=5)
        got = [first.draw(c, 4) for _ in range(stop)]
        resumed, c = TrainPrompts(rows, tokenizer, limit), DataCursor.from_state(dict(c.state_dict()))
        got += [resumed.draw(c, 4) for _ in range(5 - stop)]
        assert got == straight, stop


def test_no_prompt_that_fits_is_one_clear_error(tokenizer):
    rows = _mixed()
    short = len(prompt_token_ids(tokenizer, rows[0]["prompt"]))
    with pytest.raises(NoPromptFits, match=r"data.max_prompt_length=3: no train prompt fits \(all longer\)"):
        TrainPrompts(rows, tokenizer, 3).first_fit()
    prompts = TrainPrompts(rows, tokenizer, 3)
    with pytest.raises(NoPromptFits, match="no train prompt fits"):
        prompts.draw(DataCursor(10, seed=0), 2)
    assert prompts.n_too_long == 10
    # the up-front check stops at the first prompt that fits: only the rows before it are tokenized
    only_last = Rows.from_list([_row(i, "long " * 100) for i in range(5)] + [_row(0, index=5)])
    check = TrainPrompts(only_last, tokenizer, short)
    assert check.first_fit() == 5 and check.n_too_long == 5
    assert TrainPrompts(rows, tokenizer, short).first_fit() == 0
    with pytest.raises(ValueError, match="cursor over 9 rows, prompts over 10"):
        TrainPrompts(rows, tokenizer, short).draw(DataCursor(9), 1)
