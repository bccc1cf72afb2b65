"""A real engine dies under a real step: a run with vLLM's multiprocess engine (EngineCore and its worker in child
processes) whose EngineCore process is SIGKILLed, found with psutil among this process's children, as the step's
generate starts. With a restart left (rollout.max_restarts) the engine is rebuilt, the held adapter reinstalled and
the step finishes; without, the step fails naming the engine, its dead process and the cause, and the last
checkpoint stays as it was."""

import gc
import json
import os
import signal
import threading
import weakref

import psutil
import pytest

from m3.tiny import ensure_tiny_model
from rl import checkpointing
from rl.heap import freeze_heap
from tests.rl.test_train import compose_cfg, fast_overrides


@pytest.fixture(scope="module")
def mp_session(tmp_path_factory):
    from rl.session import Session

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    cfg = compose_cfg(fast_overrides(tmp_path_factory.mktemp("run"), ensure_tiny_model(dtype="float32").vllm)
                      + ["rollout.max_restarts=1"])
    with Session(cfg) as s:
        yield s
    mp.undo()


def engine_core() -> psutil.Process:
    found = [p for p in psutil.Process().children(recursive=True)
             if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "EngineCore" in p.name()]
    assert len(found) == 1, [(p.pid, p.name()) for p in psutil.Process().children(recursive=True)]
    return found[0]


def kill_as_it_starts(fn, deadline_s: float = 180):
    """fn() with the engine-core process SIGKILLed from another thread as soon as fn starts. fn runs in a thread:
    a wait that is never woken (vLLM without the plugin's engine_death_wakes_waiters) fails the test, not hangs it."""
    pid = engine_core().pid
    threading.Thread(target=os.kill, args=(pid, signal.SIGKILL)).start()
    result = {}

    def call():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised in the test's thread)
            result["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(deadline_s)
    assert not worker.is_alive(), f"still waiting {deadline_s} s after the engine core was killed"
    if "error" in result:
        raise result["error"]
    return pid, result["value"]


def test_dead_engine_core_is_rebuilt_once_then_fails_the_step_naming_it(mp_session):
    import rl.train as train

    s = mp_session
    assert not s.engine.in_process
    s.sync_adapter()
    s.save(1, {})
    ckpt = checkpointing.step_dirs(s.run_dir)[0]
    manifest = (ckpt / "manifest.json").read_bytes()

    # 1. a restart left: rebuilt, the adapter the trainer holds reinstalled, the step done; the dropped engine freed
    # although the heap was frozen (as rl.train's loop freezes it: frozen cycles are never collected), the heap
    # frozen again with the new engine
    freeze_heap()
    dropped, frozen = weakref.ref(s.engine.llm), gc.get_freeze_count()
    pid, metrics = kill_as_it_starts(lambda: train.grpo_step(s, 2))
    assert s.engine_restarts == 1 and engine_core().pid != pid
    assert dropped() is None and gc.get_freeze_count() > frozen
    assert metrics["train/skipped_nonfinite"] == 0.0 and metrics["sync/rank_checksums"] == [metrics["sync/checksum"]]
    assert s.engine.verify_adapter(*s.adapter())["installed_equals_held"]  # the new engine holds step 2's adapter

    # 2. none left: the step fails with the engine, its dead process and the cause; the checkpoint is untouched
    with pytest.raises(RuntimeError) as err:
        kill_as_it_starts(lambda: train.grpo_step(s, 3))
    message = str(err.value)
    assert "generate failed on rank(s) [0]" in message and "max_restarts=1" in message, message
    assert "vLLM engine for" in message and "EngineDeadError" in message, message
    assert "EngineCore pid" in message and "killed by SIGKILL" in message, message
    assert checkpointing.newest_valid(s.run_dir) == (ckpt, []) and (ckpt / "manifest.json").read_bytes() == manifest
    assert json.loads((ckpt / "state.json").read_text())["step"] == 1

    # 3. a sync to the dead engine fails the same way, naming it
    with pytest.raises(RuntimeError, match=r"adapter sync failed on rank\(s\) \[0\].*killed by SIGKILL"):
        s.sync_adapter()
