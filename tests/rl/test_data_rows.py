"""Rows as an Arrow-backed view (rl/rows.py): the view reads rows as the loaders define them; dedup and duplicate
ids are counted from fixed-size hashes."""

import pytest

from rl.data import load_dapo_math_17k, load_verl_parquet, write_rows
from rl.rows import Rows


def _row(i: int, content: str | None = None, index: int | None = None) -> dict:
    return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": content or f"Find {i} + 1."}],
            "ability": "MATH", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i if index is None else index}}


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
