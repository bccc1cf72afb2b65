"""rl.eval: pass@1 / avg@k / pass@k over a verl parquet set, through the colocated engine and through the server.

The tiny random model never answers an addition right, so with the real reward every accuracy is 0; the metric
arithmetic is checked on the engine's real samples with a scorer that marks some of them correct (by text), and
on hand-made details.
"""

import hashlib
import json
import math

import pytest

from m3.tiny import ensure_tiny_model
from rl import eval as rl_eval
from rl.data import load_verl_parquet, make_addition_splits, prompt_token_ids, write_rows
from rl.rewards import compute_score
from tests.rollout.test_serve import launch_shared_server, server, shared_adapter  # noqa: F401 (fixture)

K, MAX_TOKENS, N_ROWS = 3, 6, 4
METRICS = ("n_prompts", "k", "pass@1", "avg@k", "pass@k", "score_mean", "response_tokens_mean", "truncated_frac")


@pytest.fixture(scope="module", autouse=True)
def boot_server_early(request, tmp_path_factory):
    """When this session will use the server, start it now: it boots while the colocated engine tests run."""
    if any("server" in item.fixturenames for item in request.session.items):
        launch_shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    _, rows = make_addition_splits(n_train=0, n_eval=N_ROWS)
    path = tmp_path_factory.mktemp("eval_data") / "eval.parquet"
    write_rows(rows, path)
    return path


@pytest.fixture(scope="module")
def rows(data):
    rows, report = load_verl_parquet(data, on_bad_row="error")
    assert report.n_kept == N_ROWS
    return rows


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from rollout.engine import EngineConfig, RolloutEngine

    eng = RolloutEngine(EngineConfig(model=str(ensure_tiny_model(dtype="bfloat16").vllm), dtype="bfloat16",
                                     capture_routing=False, max_num_seqs=N_ROWS * K))
    # The adapter from its peft files, as `python -m rl.eval --adapter` loads it.
    info = eng.load_adapter(*rl_eval.load_adapter_files(shared_adapter(tmp_path_factory)))
    assert info["checksum"]
    yield eng
    eng.close()


def parity_score(data_source, text, ground_truth):
    """Correct for about half the samples, decided by the text alone, so the checks below are not 0 == 0."""
    correct = hashlib.sha256(text.encode()).digest()[0] % 2 == 0
    return {"score": 1.0 if correct else -1.0, "acc": int(correct), "pred": text[-8:]}


def check_consistent(result: dict, k: int, n: int) -> None:
    for key in METRICS:
        assert key in result, key
    assert result["n_prompts"] == n and result["k"] == k and len(result["details"]) == n
    for key in ("pass@1", "avg@k", "pass@k", "truncated_frac"):
        assert 0.0 <= result[key] <= 1.0, (key, result[key])
    details = result["details"]
    for d in details:
        assert len(d["acc"]) == len(d["score"]) == len(d["pred"]) == len(d["responses"]) == k
        assert all(a in (0, 1) for a in d["acc"]) and all(1 <= t <= MAX_TOKENS for t in d["response_tokens"])
    first = [d["acc"][0] for d in details]
    every = [a for d in details for a in d["acc"]]
    assert result["pass@1"] == pytest.approx(sum(first) / n)
    assert result["avg@k"] == pytest.approx(sum(every) / (n * k))
    assert result["pass@k"] == pytest.approx(sum(max(d["acc"]) for d in details) / n)
    assert result["pass@1"] <= result["pass@k"] and result["avg@k"] <= result["pass@k"]


def test_colocated_engine_metrics_are_the_means_of_the_details(engine, rows):
    result = rl_eval.evaluate(engine, rows, k=K, temperature=1.0, max_tokens=MAX_TOKENS, seed=1,
                              score_fn=parity_score)
    check_consistent(result, K, N_ROWS)
    every = [a for d in result["details"] for a in d["acc"]]
    assert 0 < sum(every) < len(every), "parity scorer should mark some samples right and some wrong"
    assert result["score_mean"] == pytest.approx(sum(s for d in result["details"] for s in d["score"]) / len(every))
    assert any(len(set(d["responses"])) > 1 for d in result["details"])  # k distinct samples, not one copied k times


def test_cli_colocated_with_the_real_reward(engine, rows, data, tmp_path_factory, monkeypatch, capsys):
    """`python -m rl.eval --model --adapter` through main(), on this module's engine (a second engine costs ~20 s)."""
    import rollout.engine

    built = []

    class Shared:  # main() closes its engine; this one belongs to the fixture
        def __init__(self, cfg):
            built.append(cfg)

        def __getattr__(self, name):
            return getattr(engine, name)

        def close(self):
            pass

    monkeypatch.setattr(rollout.engine, "RolloutEngine", Shared)
    model = str(ensure_tiny_model(dtype="bfloat16").vllm)
    out = rl_eval.main(["--data", str(data), "--model", model, "--adapter", str(shared_adapter(tmp_path_factory)),
                        "--k", str(K), "--max-tokens", str(MAX_TOKENS), "--seed", "0", "--details"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == out and printed["adapter_checksum"]
    assert built[0].enable_lora and built[0].max_lora_rank == 32 and not built[0].capture_routing
    check_consistent(printed, K, N_ROWS)
    for row, d in zip(rows, printed["details"]):
        assert d["index"] == row["extra_info"]["index"] and d["ground_truth"] == row["reward_model"]["ground_truth"]
        # Every sample is scored by compute_score on its returned text.
        scored = [compute_score(row["data_source"], t, d["ground_truth"]) for t in d["responses"]]
        assert d["acc"] == [r["acc"] for r in scored] and d["score"] == [r["score"] for r in scored]


def test_aggregate_on_hand_made_details():
    details = [{"acc": a, "score": [float(x) for x in a], "response_tokens": [5] * 4,
                "finish_reason": ["stop", "length", "stop", "stop"]}
               for a in ([1, 0, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0])]
    m = rl_eval.aggregate(details, k=4)
    assert m["pass@1"] == pytest.approx(1 / 3) and m["avg@k"] == pytest.approx(4 / 12)
    assert m["pass@k"] == pytest.approx(2 / 3) and m["truncated_frac"] == pytest.approx(0.25)
    # unbiased pass@2 by hand: 1 - C(n-c, 2) / C(4, 2) per row = 1 - 3/6, 1 - 0, 1 - 6/6
    assert m["pass@j_unbiased"] == pytest.approx({"1": 1 / 3, "2": (0.5 + 1 + 0) / 3, "4": 2 / 3})
    with pytest.raises(ValueError, match="expected k=3"):
        rl_eval.aggregate(details, k=3)


def test_cli_argument_errors(data, capsys):
    for argv, msg in ((["--data", str(data)], "--model DIR"),
                      (["--data", str(data), "--url", "http://127.0.0.1:1", "--adapter", "x"], "serves adapters"),
                      (["--data", str(data) + ".nope", "--model", "."], "no such file")):
        with pytest.raises(SystemExit):
            rl_eval.parse_args(argv)
        assert msg in capsys.readouterr().err


def test_server_eval_through_the_adapter(server, rows, data, capsys):
    client = rl_eval.CompletionsClient(server.url, server.adapter_name)
    assert client.max_model_len == 2048
    # The server's chat template gives the prompt ids the colocated engine gets from the tokenizer.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(server.model_dir))
    assert client.encode(rows[0]["prompt"]) == prompt_token_ids(tok, rows[0]["prompt"])
    result = rl_eval.evaluate(client, rows[:2], k=K, temperature=1.0, max_tokens=MAX_TOKENS, seed=0,
                              score_fn=parity_score)
    check_consistent(result, K, 2)
    # The CLI against the base model name, one JSON object on stdout.
    out = rl_eval.main(["--data", str(data), "--url", server.url, "--served-model", server.base_name,
                        "--k", "2", "--max-tokens", "2", "--limit", "2", "--details"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == out and printed["served_model"] == server.base_name and printed["n_prompts"] == 2
    assert all(len(d["acc"]) == 2 for d in printed["details"])
    assert all(math.isfinite(printed[m]) for m in ("pass@1", "avg@k", "pass@k"))
    with pytest.raises(ValueError, match="does not serve model"):
        rl_eval.CompletionsClient(server.url, "no-such-model")
