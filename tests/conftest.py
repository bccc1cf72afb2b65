import os

# In-process engine (one process, closures in collective_rpc); must be set before vLLM builds an engine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# make test runs the suite on 2 pytest-xdist workers, one per core of the CI machine (Makefile: TEST_WORKERS). Beside
# another worker, each worker and what it starts compute on one thread: OpenMP threads spin on a core that another
# process holds (2 threads beside a busy core made the engine's generate 3-20x slower, results/make_train_cpu.json).
# Set before torch is imported here; an in-process vLLM engine later blocks torch.set_num_threads for the process.
PARALLEL = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
if PARALLEL:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("M3RL_TORCH_THREADS", "1")  # rl.train's RL phase (rl/session.py)

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.triton_interpreter import SITES as TRITON_SITES  # noqa: E402

if PARALLEL and "torch" in sys.modules:  # imported by a plugin
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Tests started before all others: on 2 workers the rest of the suite runs beside them (the embedded
# default's 40-step run alone takes ~5 min; started last, it would run alone at the end).
RUN_FIRST = ("tests/rl/test_train_learns.py::",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(RUN_FIRST))  # stable sort: otherwise collection order


@pytest.fixture(params=list(TRITON_SITES))
def triton_version(request) -> str:
    """Each Triton the trainer's torch releases require (tests/triton_interpreter.py), for the kernel tests."""
    return request.param


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
