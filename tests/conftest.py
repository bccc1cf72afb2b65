import os

# In-process engine (one process, closures in collective_rpc); must be set before vLLM builds an engine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def math_data(tmp_path_factory):
    """The recipe's data in the public layouts (scripts/make_data.py --layout dapo): 200 DAPO-Math-17K problems,
    8 AIME-2024 problems in each of the three layouts rl.data reads."""
    out = tmp_path_factory.mktemp("math")
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "make_data.py"), "--out",
                    str(out), "--layout", "dapo", "--n-train", "200", "--n-eval", "8"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The tiny M3's tokenizer (m3.tiny's BPE), built once, without building the model."""
    from transformers import AutoTokenizer

    from m3.tiny import build_tokenizer_files

    d = tmp_path_factory.mktemp("tok")
    for name, data in build_tokenizer_files():
        (d / name).write_bytes(data)
    return AutoTokenizer.from_pretrained(d)
