"""`python -m rollout.serve`: vLLM's OpenAI server with our plugin, serving the tiny M3 and a LoRA adapter.

One server process per test session (shared with tests/rl/test_eval.py through `shared_server`): booting it costs
two vLLM imports, most of a minute on the 2-core CI machine. It is always stopped by the fixture finalizers, by
atexit if pytest exits before them, and by the kernel if pytest is killed (`die_with_parent`: a timeout's SIGKILL
runs neither, and left servers running).
"""

import atexit
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from m3.tiny import ensure_tiny_model
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
ADAPTER_NAME, BASE_NAME = "policy-test", "tiny-m3"
BOOT_TIMEOUT_S = 300  # a busy 2-core machine has taken ~80 s
STOP_TIMEOUT_S = 30
PORT_TAKEN = "Address already in use"


def export_adapter(model_dir, out_dir, seed: int = 0) -> Path:
    """The trainer's adapter (peft format) with random A and B, so it visibly changes the served logprobs."""
    from rl.model import M3ForTraining, TrainerModelConfig
    from rl.model.lora import lora_parameters, save_adapter

    # base="bf16": the adapter's names and shapes do not depend on the base's quantization, and skipping it is faster
    model = M3ForTraining(TrainerModelConfig(path=str(model_dir), dtype="bfloat16", base="bf16"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return save_adapter(model, model.mcfg.lora, out_dir)


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    model_dir: Path
    adapter_dir: Path
    base_name: str = BASE_NAME
    adapter_name: str = ADAPTER_NAME
    _log: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = BOOT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM lets vLLM shut its engine-core process down; the group kill is for a server that hangs.
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_TIMEOUT_S)
        if self._log is not None and not self._log.closed:
            self._log.close()


# Runs a command as this process's child that Linux sends SIGTERM when its parent dies (PR_SET_PDEATHSIG survives
# exec), exiting at once if the parent is already gone. In the child rather than a preexec_fn: the test process has
# threads (vLLM's), with which preexec_fn can deadlock.
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.argv[2], sys.argv[2:])")


def die_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` (an absolute executable first) wrapped so that it ends with the process that starts it."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


def launch_server(model_dir, adapter_dir, log_path: Path, *extra: str) -> Server:
    port = free_port()
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the test session's in-process setting is not the server's
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "rollout.serve", "--model", str(model_dir),
           "--adapter", f"{ADAPTER_NAME}={adapter_dir}", "--port", str(port),
           "--served-model-name", BASE_NAME, "--dtype", "bfloat16", *extra]
    proc = subprocess.Popen(die_with_parent(cmd), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return Server(proc, port, log_path, Path(model_dir), Path(adapter_dir), _log=log)


_SHARED: dict = {}


def shared_adapter(tmp_path_factory) -> Path:
    if "adapter" not in _SHARED:
        _SHARED["adapter"] = export_adapter(ensure_tiny_model(dtype="bfloat16").vllm,
                                            tmp_path_factory.mktemp("serve") / "adapter")
    return _SHARED["adapter"]


def launch_shared_server(tmp_path_factory) -> Server:
    """Start the session's server without waiting for it (so other work can overlap its boot)."""
    if "server" not in _SHARED:
        adapter = shared_adapter(tmp_path_factory)
        srv = launch_server(ensure_tiny_model(dtype="bfloat16").vllm, adapter, adapter.parent / "server.log")
        atexit.register(srv.stop)
        _SHARED["server"] = srv
    return _SHARED["server"]


def _boot_error(srv: Server) -> str | None:
    """None once `srv` is healthy, else why it is not (and `srv` stopped)."""
    try:
        srv.wait_healthy()
        return None
    except (RuntimeError, TimeoutError) as e:
        srv.stop()
        return str(e)


def shared_server(tmp_path_factory) -> Server:
    """The session's server, healthy. A failed boot is remembered, so a second user fails at once.

    A boot that lost its port to another process (EADDRINUSE) is retried once on a new port: `free_port` makes
    that rare, not impossible, and it is the test machine's doing, not the server's.
    """
    srv = launch_shared_server(tmp_path_factory)
    if "boot_error" not in _SHARED:
        error = _boot_error(srv)
        if error and PORT_TAKEN in srv.log_tail():
            del _SHARED["server"]
            srv = launch_shared_server(tmp_path_factory)
            error = _boot_error(srv)
        _SHARED["boot_error"] = error
    if _SHARED["boot_error"]:
        pytest.fail(_SHARED["boot_error"])
    return srv


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = shared_server(tmp_path_factory)
    yield srv
    srv.stop()


def post(url: str, payload: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(url: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_killed_test_process_takes_its_server_with_it():
    # A stand-in for pytest starts two sleepers, one through die_with_parent as the server is started, and is killed
    # by SIGKILL (a timeout's): the wrapped one ends, the other one (the control) outlives it.
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time; from tests.rollout.test_serve import die_with_parent; "
        f"cmd = {sleeper!r}; "
        "kids = [subprocess.Popen(die_with_parent(cmd), start_new_session=True), "
        "subprocess.Popen(cmd, start_new_session=True)]; "
        "print(*[k.pid for k in kids], flush=True); time.sleep(120)")], cwd=REPO, stdout=subprocess.PIPE, text=True)
    wrapped, control = map(int, parent.stdout.readline().split())
    try:
        time.sleep(1)  # the wrapper has exec'd the sleeper
        assert _alive(wrapped) and _alive(control)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(wrapped) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(wrapped), "the wrapped child outlived its killed parent"
        assert _alive(control), "the control child died too: the test shows nothing"
    finally:
        for pid in (wrapped, control):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.kill()


# ----------------------------------------------------------------------------------------------
# bad input: one clear error, before vLLM is imported

def run_serve(*args: str, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_flags, "-m", "rollout.serve", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_missing_model_dir_is_one_clear_error(tmp_path):
    # -X importtime lists every module the process imported (on stderr): the error comes before vLLM's ~15 s import
    p = run_serve("--model", str(tmp_path / "nope"), python_flags=("-X", "importtime"))
    assert p.returncode == 2
    assert "rollout.serve: error: --model" in p.stderr and "no such directory" in p.stderr
    assert "Traceback" not in p.stderr
    imported = [line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")]
    assert "rollout" in imported, "no import list: the check below would show nothing"
    heavy = [m for m in imported if m.split(".")[0] in ("vllm", "torch")]
    assert not heavy, f"refused only after importing {heavy[:3]}"


def test_adapter_without_config_is_one_clear_error(tmp_path):
    model = ensure_tiny_model(dtype="bfloat16").vllm
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    p = run_serve("--model", str(model), "--adapter", f"a={tmp_path / 'adapter'}")
    assert p.returncode == 2
    assert "adapter_config.json" in p.stderr and "Traceback" not in p.stderr
    p = run_serve("--model", str(model), "--adapter", str(tmp_path / "adapter"))  # no NAME=
    assert p.returncode == 2 and "expected NAME=PATH" in p.stderr


def test_vllm_command_line_defaults_lora_and_overrides(tmp_path):
    from rollout.plugin.lora import TARGET_MODULES
    from rollout.serve import build_vllm_argv

    model = ensure_tiny_model(dtype="bfloat16").vllm
    adapter = tmp_path / "a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 16}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    argv = build_vllm_argv(["--model", str(model), "--adapter", f"pol={adapter}", "--port", "9", "--max-model-len",
                            "512", "--seed", "3"], on_cpu=True)
    assert argv[0] == str(model.resolve()) and argv[argv.index("--port") + 1] == "9"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv.count("--max-model-len") == 1 and argv[argv.index("--max-model-len") + 1] == "512"
    for flag in ("--enforce-eager", "--enable-lora", "--kv-cache-memory-bytes", "--max-num-seqs"):
        assert flag in argv
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert argv[argv.index("--block-size") + 1] == "128" and argv[argv.index("--max-lora-rank") + 1] == "32"
    i = argv.index("--lora-target-modules")
    assert argv[i + 1:i + 1 + len(TARGET_MODULES)] == TARGET_MODULES
    assert argv[argv.index("--lora-modules") + 1] == f"pol={adapter.resolve()}"
    assert argv[-2:] == ["--seed", "3"]  # the rest goes to vLLM untouched
    gpu = build_vllm_argv(["--model", str(model)], on_cpu=False)
    assert "--kv-cache-memory-bytes" not in gpu and "--distributed-executor-backend" not in gpu
    with pytest.raises(ValueError, match="rank 16 > --max-lora-rank 8"):
        build_vllm_argv(["--model", str(model), "--adapter", f"pol={adapter}", "--max-lora-rank", "8"], on_cpu=True)


# ----------------------------------------------------------------------------------------------
# the running server

def completion(server: Server, model: str, prompt: list[int]) -> dict:
    return post(server.url + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
        "logprobs": 0, "prompt_logprobs": 0, "return_token_ids": True})


def test_serves_base_and_adapter_and_the_adapter_changes_logprobs(server):
    ids = {m["id"] for m in get(server.url + "/v1/models")["data"]}
    assert {server.base_name, server.adapter_name} <= ids
    messages = [{"role": "user", "content": "What is 12 + 34? Put the final answer in \\boxed{}."}]
    prompt = post(server.url + "/tokenize", {"model": server.base_name, "messages": messages,
                                             "add_generation_prompt": True})["tokens"]
    assert len(prompt) > 5
    out = {name: completion(server, name, prompt) for name in (server.adapter_name, server.base_name)}
    prompt_lp = {}
    for name, resp in out.items():
        assert resp["model"] == name
        choice = resp["choices"][0]
        assert isinstance(choice["text"], str) and len(choice["token_ids"]) == 4
        assert resp["usage"]["completion_tokens"] == 4
        token_lp = choice["logprobs"]["token_logprobs"]
        assert len(token_lp) == 4 and all(math.isfinite(x) and x <= 0 for x in token_lp)
        # Logprobs of the same prompt tokens under each model: a comparison that does not depend on sampling.
        plp = choice["prompt_logprobs"]
        prompt_lp[name] = [plp[i][str(t)]["logprob"] for i, t in enumerate(prompt) if i > 0]
        assert len(prompt_lp[name]) == len(prompt) - 1 and all(math.isfinite(x) for x in prompt_lp[name])
    diff = max(abs(a - b) for a, b in zip(prompt_lp[server.adapter_name], prompt_lp[server.base_name]))
    print(f"max |adapter - base| prompt logprob: {diff:.3g}")
    assert diff > 0.05
