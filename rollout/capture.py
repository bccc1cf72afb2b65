"""Routing and MSA block-selection capture inside vLLM workers (one output format on every platform).

Per request, over the tokens the model ran (prompt + generated - 1: the last sampled token is never fed back):
- routed experts: `[seq_len-1, num_layers, topk]`, uint8 when the model has < 256 experts (else uint16); rows of
  dense (non-MoE) layers hold `DENSE_LAYER` (the dtype's max value). Expert ids are logical, before EPLB.
- MSA blocks (off by default): `[seq_len-1, num_sparse_layers, num_kv_heads, topk_blocks]` int16, -1 padded,
  sparse layers in `sparse_layers` order. Cost: 2 * num_sparse_layers * num_kv_heads * topk_blocks bytes per
  token: 7,296 B/token for MiniMax-M3 (57 sparse layers, 4 KV heads, top-16), 12 B/token for the tiny model.

Both capture what the layers computed in each forward step, so a prefix-cache hit (tokens not recomputed) would
drop rows: the engine client refuses capture with prefix caching on.
"""

import numpy as np
import torch


def routing_dtype(num_experts: int):
    return np.uint8 if num_experts < 256 else np.uint16


def DENSE_LAYER(num_experts: int) -> int:
    return int(np.iinfo(routing_dtype(num_experts)).max)


def encode_array(a: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    return str(a.dtype), tuple(a.shape), a.tobytes()


def decode_array(t) -> np.ndarray:
    dtype, shape, data = t
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


class CaptureExtension:
    """vLLM worker extension methods (mixed into the worker with the adapter sync)."""

    def m3_enable_capture(self, routing: bool = True, blocks: bool = False) -> dict:
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
        from vllm.models.minimax_m3.common.indexer import MiniMaxM3Indexer

        runner = self.model_runner
        if getattr(runner, "_m3_capture", None) is not None:
            runner._m3_capture.update(routing=routing, blocks=blocks)
            return self._m3_capture_layout()
        state = runner._m3_capture = {"routing": routing, "blocks": blocks, "step_routing": {}, "step_blocks": {},
                                      "store": {}, "moe_layers": [], "sparse_layers": [], "num_experts": 0,
                                      "topk": 0}
        model = runner.model
        for module in model.modules():
            if isinstance(module, MoERunner):
                lid = module.layer_id
                state["moe_layers"].append(lid)
                state["num_experts"] = module.moe_config.num_experts
                state["topk"] = module.moe_config.experts_per_token

                def capture(ids, lid=lid):
                    if state["routing"]:
                        state["step_routing"][lid] = ids.detach().to("cpu", torch.int32, copy=True)

                module.router.set_capture_fn(capture)
            elif isinstance(module, MiniMaxM3Indexer):
                lid = _layer_index(module.index_cache.prefix)
                state["sparse_layers"].append(lid)
                forward = module.forward

                def forward_and_capture(*args, _forward=forward, _module=module, _lid=lid, **kwargs):
                    result = _forward(*args, **kwargs)
                    md = get_forward_context().attn_metadata
                    if state["blocks"] and isinstance(md, dict):
                        n = md[_module.index_cache.prefix].num_actual_tokens
                        buf = _module.impl.topk_indices_buffer  # [tokens, heads, topk], written by every impl
                        state["step_blocks"][_lid] = buf[:n].detach().to("cpu", torch.int16, copy=True)
                    return result

                module.forward = forward_and_capture
        state["moe_layers"].sort()
        state["sparse_layers"].sort()
        state["num_layers"] = model.config.num_hidden_layers
        execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            state["step_routing"].clear()
            state["step_blocks"].clear()
            out = execute(scheduler_output, *args, **kwargs)
            if state["step_routing"] or state["step_blocks"]:
                self._m3_split_step(scheduler_output)
            return out

        runner.execute_model = execute_model
        return self._m3_capture_layout()

    def _m3_capture_layout(self) -> dict:
        s = self.model_runner._m3_capture
        return {k: s[k] for k in ("moe_layers", "sparse_layers", "num_layers", "num_experts", "topk")}

    def _m3_split_step(self, scheduler_output) -> None:
        s = self.model_runner._m3_capture
        routing = blocks = None
        if s["step_routing"]:
            first = next(iter(s["step_routing"].values()))
            fill = DENSE_LAYER(s["num_experts"])
            routing = torch.full((first.shape[0], s["num_layers"], first.shape[1]), fill, dtype=torch.int32)
            for lid, ids in s["step_routing"].items():
                routing[:, lid] = ids
        if s["step_blocks"]:
            blocks = torch.stack([s["step_blocks"][lid] for lid in s["sparse_layers"]], dim=1)  # [T, L, H, k]
        offset = 0
        for rid in self.model_runner.input_batch.req_ids:
            n = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if not n:
                continue
            entry = s["store"].setdefault(rid, {"routing": [], "blocks": []})
            if routing is not None:
                entry["routing"].append(routing[offset:offset + n])
            if blocks is not None:
                entry["blocks"].append(blocks[offset:offset + n])
            offset += n

    def m3_pop_capture(self) -> dict[str, dict[str, tuple]]:
        """Everything captured since the last pop, per engine request id, as `encode_array` triples; clears it.

        Plain (dtype, shape, bytes): vLLM's multiprocess RPC does not hand numpy arrays back as arrays."""
        s = self.model_runner._m3_capture
        dtype = routing_dtype(s["num_experts"])
        out = {}
        for rid, entry in s["store"].items():
            out[rid] = {}
            if entry["routing"]:
                out[rid]["routing"] = encode_array(torch.cat(entry["routing"]).numpy().astype(dtype))
            if entry["blocks"]:
                out[rid]["blocks"] = encode_array(torch.cat(entry["blocks"]).numpy())
        s["store"] = {}
        return out
