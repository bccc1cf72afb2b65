"""Data fuzz (hypothesis) over rl/data.py's loaders with real parquet files: missing columns, columns of the wrong
type, null / empty / whitespace / non-UTF-8 / over-long prompts, bad ground truths, duplicate ids. Every file is
either loaded with each bad row counted (skip) or rejected with one error naming the file and the rows or columns
(SchemaError, BadRowError); kept rows are valid, over-long prompts are counted when tokenized. Nothing else raises."""

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl.data import (
    SCHEMA_FIELDS,
    BadRowError,
    SchemaError,
    encode_prompts,
    load_aime_2024,
    load_dapo_math_17k,
    load_verl_parquet,
    validate_row,
)

TEXT = st.one_of(st.just("What is 2 + 3?"), st.just(""), st.just("   "), st.just("x " * 400),
                 st.text(max_size=20), st.none())
CONTENT = st.one_of(TEXT.map(lambda t: t.encode() if isinstance(t, str) else t), st.just(b"\xff\xfe bad utf-8"))
GT = st.one_of(st.sampled_from(["5", "035", "", "abc", " 7 "]), st.none())
SOURCE = st.one_of(st.sampled_from(["math_dapo", "aime-2024", "builtin_addition", "openai/gsm8k", ""]), st.none())
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.binary())])
# per column: its pyarrow type when present with the right shape, and wrong-typed alternatives
COLUMNS = {
    "data_source": (pa.string(), SOURCE),
    "prompt": (pa.list_(MESSAGE), st.one_of(st.none(), st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "robot"]), "content": CONTENT}), max_size=2))),
    "ability": (pa.string(), st.sampled_from(["MATH", "", None])),
    "reward_model": (pa.struct([("style", pa.string()), ("ground_truth", pa.string())]), st.one_of(
        st.none(), st.fixed_dictionaries({"style": st.sampled_from(["rule", None]), "ground_truth": GT}))),
    "extra_info": (pa.struct([("index", pa.int64())]), st.one_of(
        st.none(), st.fixed_dictionaries({"index": st.one_of(st.integers(0, 3), st.none())}))),  # duplicates
}
WRONG = {pa.string(): (pa.int64(), st.integers(-5, 5)), None: (pa.string(), st.sampled_from(["oops", ""]))}


@st.composite
def table(draw):
    n = draw(st.integers(1, 8))
    fields, data = [], {}
    for name, (typ, values) in COLUMNS.items():
        shape = draw(st.sampled_from(["ok", "ok", "ok", "missing", "wrong"]))
        if shape == "missing":
            continue
        if shape == "wrong":
            typ, values = WRONG.get(typ, WRONG[None])
        fields.append(pa.field(name, typ))
        data[name] = draw(st.lists(values, min_size=n, max_size=n))
    return pa.table(data, schema=pa.schema(fields))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=table(), on_bad_row=st.sampled_from(["skip", "error"]))
def test_bad_files_are_counted_or_rejected_with_one_clear_error(tmp_path_factory, tokenizer, t, on_bad_row):
    path = tmp_path_factory.mktemp("fuzz") / "data.parquet"
    pq.write_table(t, path)
    for loader in (load_verl_parquet, load_dapo_math_17k, load_aime_2024):
        try:
            rows, report = loader(path, on_bad_row=on_bad_row)
        except SchemaError as e:
            assert str(path) in str(e) and any(c not in t.column_names for c in SCHEMA_FIELDS), e
            continue
        except BadRowError as e:
            assert on_bad_row == "error" and str(path) in str(e) and e.bad and "bad row(s):" in str(e), e
            continue
        assert report.n_read == t.num_rows == report.n_kept + report.n_bad + report.n_duplicates
        assert len(rows) == report.n_kept and all(validate_row(r) == [] for r in rows)
        assert report.n_duplicate_ids <= max(0, len(rows) - 1)
        kept, ids, dropped = encode_prompts(rows, tokenizer, max_length=64)
        assert len(kept) + len(dropped) == len(rows) and all(len(i) <= 64 for i in ids)
