"""FSDP2 on 2 gloo ranks computes what one process computes: the same loss and LoRA gradients (tiny model).

Each rank takes half of a packed batch of sequences; loss = -(sum of token logprobs) / (tokens in the whole batch).
FSDP2 averages gradients over ranks, so each rank backpropagates world_size x its share. Both ranks first run the
single-process reference on the whole batch with an unsharded model, then shard that same model and run their half.
Cases: bf16 and quantized bases in fp32 (tolerance 1e-5), the quantized base itself sharded over the ranks
(`shard_base`: packed bytes gathered per layer), and the production form, a bf16 model with a bf16 all-gather of the
LoRA weights (their values are bf16-representable, so only gradient rounding differs). Last, a model sharded layer by
layer while it is built (M3ForTraining's `on_layer`, how full-size models are built) gives the same logprobs.
"""

import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.ports import free_port

LENS = [37, 70, 25, 55, 48, 31]  # rank 0 takes the first 3 sequences, rank 1 the last 3
WORLD = 2
TIMEOUT_S = 150
# name -> (base, model dtype, FSDP mixed precision, shard the base); the last is the production setup: bf16 model,
# bf16 all-gather
CASES = {"bf16_fp32": ("bf16", "float32", None, False), "quantized_fp32": ("quantized", "float32", None, False),
         "quantized_fp32_shard_base": ("quantized", "float32", None, True),
         "quantized_bf16_mp": ("quantized", "bfloat16", "bfloat16", False)}
# relative error bounds (loss, worst gradient tensor); mixed precision: bf16 gradients, reduced in fp32
TOL = {"bf16_fp32": (1e-6, 1e-5), "quantized_fp32": (1e-6, 1e-5), "quantized_fp32_shard_base": (1e-6, 1e-5),
       "quantized_bf16_mp": (1e-5, 1e-2)}


def _batch(seqs):
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 512, (n + 1,), generator=g) for n in LENS]
    pick = [ids[i] for i in seqs]
    cu = torch.tensor([0] + [len(t) - 1 for t in pick]).cumsum(0)
    return torch.cat([t[:-1] for t in pick]), cu, torch.cat([t[1:] for t in pick])


def _worker(rank, port, path, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a busy 2-core box: OpenMP spinning makes 2 threads far slower
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from rl.model import M3ForTraining, TrainerModelConfig
    from rl.model.fsdp import BYTE_CONTAINER, full_adapter_state_dict, full_lora_tensors, init_distributed, shard_model
    from rl.model.lora import adapter_state_dict, lora_parameters

    info = init_distributed(backend="gloo", timeout_s=120)  # gloo on a GPU box too
    assert (info.rank, info.world_size, dist.get_backend()) == (rank, WORLD, "gloo")
    total = sum(LENS)
    mine = _batch(range(rank * 3, rank * 3 + 3))
    report = {}
    for case, (base, dtype, mixed, shard_base) in CASES.items():
        t0 = time.perf_counter()
        model = M3ForTraining(TrainerModelConfig(path=path, dtype=dtype, base=base))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # lora_B starts at 0, which would leave every lora_A gradient 0
            for p in lora_parameters(model):  # bf16 values: a bf16 all-gather is then exact
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).bfloat16())
        frozen = {n: b.dtype for n, b in model.named_buffers()}

        ids, cu, tgt = _batch(range(len(LENS)))
        ref_loss = -model.token_logprobs(ids, cu, tgt).sum() / total
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        ref_adapter = adapter_state_dict(model)
        model.zero_grad(set_to_none=True)

        if mixed is None:
            with pytest.raises(ValueError, match="would cast frozen base parameters"):
                shard_model(model, mixed_precision="bfloat16")  # fp32 norms/embeddings
        shard_model(model, mixed_precision=mixed, shard_base=shard_base)
        lora = [p for n, p in model.named_parameters() if p.requires_grad]
        assert lora and all(isinstance(p, DTensor) for p in model.parameters())
        assert not any(isinstance(b, DTensor) for b in model.buffers())
        byte = {torch.uint8: BYTE_CONTAINER}  # sharded uint8 bytes are held bit for bit in a 1-byte float dtype
        stored = {n: b.dtype for n, b in model.named_buffers()} | {n: p.dtype for n, p in model.named_parameters()
                                                                   if n in frozen}
        assert stored == ({n: byte.get(d, d) for n, d in frozen.items()} if shard_base else frozen)  # never cast
        if shard_base:  # every packed weight and scale is a sharded parameter now (global scales stay buffers)
            assert not any(b.dtype in (torch.uint8, torch.float8_e4m3fn) for b in model.buffers())
            assert sum(p.dtype == BYTE_CONTAINER for p in model.parameters()) > 0
        else:
            assert {n: b.dtype for n, b in model.named_buffers()} == frozen  # not sharded

        local_sum = model.token_logprobs(*mine).sum()
        (-local_sum / total * WORLD).backward()  # FSDP2 divides the reduced gradients by the world size
        loss = -local_sum.detach().clone()
        dist.all_reduce(loss)
        grads = full_lora_tensors(model, grads=True)
        adapter = full_adapter_state_dict(model, rank0_only=False)
        dsd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                   ignore_frozen_params=True))
        full = full_lora_tensors(model)
        if rank == 0:
            assert set(grads) == set(ref_grads) and grads, (sorted(set(grads) ^ set(ref_grads)))[:5]
            rel = {n: float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items()}
            worst = max(rel, key=rel.get)
            assert set(adapter) == set(ref_adapter)
            assert all(torch.equal(adapter[k], ref_adapter[k]) for k in adapter)
            assert all(torch.equal(dsd[k], full[k]) for k in full)  # same tensors as torch's full state dict
            report[case] = {"ref_loss": ref_loss.item(), "fsdp_loss": loss.item() / total,
                            "grad_tensors": len(rel), "max_rel_err": rel[worst], "worst": worst,
                            "no_grad": sorted(n for n, p in model.named_parameters()
                                              if p.requires_grad and n not in ref_grads)[:2],
                            "seconds": round(time.perf_counter() - t0, 1)}
        del model
    # Built and sharded layer by layer (base included), LoRA B = 0 as initialized: the same logprobs as a plain model.
    from rl.model.fsdp import default_mesh, shard_layer

    plain = M3ForTraining(TrainerModelConfig(path=path, dtype="float32")).token_logprobs(*mine).detach()
    mesh = default_mesh()
    model = M3ForTraining(TrainerModelConfig(path=path, dtype="float32"),
                          on_layer=lambda layer: shard_layer(layer, mesh, shard_base=True))
    shard_model(model, mesh=mesh, shard_base=True)
    with torch.no_grad():
        built = model.token_logprobs(*mine)
    report["built_sharded_max_abs"] = float((built - plain).abs().max()) if rank == 0 else None
    if rank == 0:
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def _run_ranks(*args):
    ctx = mp.start_processes(_worker, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"FSDP ranks still running after {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:  # only the ranks started here
            if p.is_alive():
                p.kill()


def test_fsdp2_two_gloo_ranks_match_one_process(tmp_path):
    from m3.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(dtype="float32").vllm)
    _run_ranks(free_port(), path, str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    print(json.dumps(report, indent=1))
    assert report.pop("built_sharded_max_abs") <= 1e-6
    assert set(report) == set(CASES)
    for base, r in report.items():
        assert r["fsdp_loss"] == pytest.approx(r["ref_loss"], rel=TOL[base][0], abs=0), base
        assert r["max_rel_err"] <= TOL[base][1], (base, r["worst"], r["max_rel_err"])
        assert r["grad_tensors"] >= 50, base  # every LoRA tensor but the indexer's (no gradient by design)


def test_shard_model_keeps_float8_frozen_tensors_out_of_mixed_precision():
    from rl.model.fsdp import frozen_params_to_buffers

    m = torch.nn.Module()
    m.codes = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), requires_grad=False)
    m.packed = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.uint8), requires_grad=False)
    m.norm = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    assert sorted(frozen_params_to_buffers(m)) == ["codes", "packed"]
    assert [n for n, _ in m.named_parameters()] == ["norm"]
    assert {n: b.dtype for n, b in m.named_buffers()} == {"codes": torch.float8_e4m3fn, "packed": torch.uint8}
