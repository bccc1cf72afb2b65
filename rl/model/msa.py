"""MiniMax Sparse Attention (MSA) for the trainer: block selection, replay checks, differentiable block-sparse
attention.

The rollout engine (vLLM) computes, per sparse layer and per KV head h:
  score[h,t,b] = max over keys p of block b (128 tokens) with p <= pos(t) of <index_q[t,h], index_k[p]>
                 (index q/k rounded to bf16, fp32 accumulation, no scale)
  blocks b < init are forced (1e30), then the local blocks b >= valid-local (1e29, wins over init),
  valid = pos//128 + 1; keep the top-k, -1 padded when fewer blocks are visible;
  attention of query head h (KV head h // group) over the keys of its KV head's selected blocks, causal,
  softmax scale head_dim**-0.5.
`rollout.plugin.portable_ops` holds the per-request engine-side ports that define these semantics; this module
computes the same thing on packed batches (varlen, `cu_seqlens`; positions and blocks restart per sequence).

Selection is discontinuous, so it carries no gradient: the trainer either recomputes it (`select_blocks`) or
replays the engine's ids (`validate_block_ids` first), and differentiates `sparse_attention` w.r.t. q, k, v.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from m3.ops import FORCED_INIT_SCORE, FORCED_LOCAL_SCORE, NAN_SCORE
from m3.ops import MSA_BLOCK as BLOCK  # also the FlexAttention tile size below
from rl.model.packed import seq_bounds, to_device, token_positions
# Transient fp32 score memory per chunk. Both chunked loops are exact: chunking only splits independent queries.
SELECT_CHUNK_BYTES = 512 << 20
REFERENCE_CHUNK_BYTES = 512 << 20


# --- selection ---------------------------------------------------------------------------------------------------

@torch.no_grad()
def select_blocks(
    index_q: torch.Tensor, index_k: torch.Tensor, cu_seqlens, topk: int, init_blocks: int, local_blocks: int, *,
    index_dtype: torch.dtype | None = torch.bfloat16, chunk_size: int | None = None, impl: str = "auto",
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's MSA block selection on a packed batch: index_q [T, H, D], index_k [T, D] -> int32 [T, H, topk].

    Rows are sorted by score (forced blocks first; their mutual order is not part of the contract) and -1 padded.
    `index_dtype` rounds index q/k as vLLM's index cache does (bf16 even for fp32 models); None keeps them as given.
    Queries are processed in chunks so the fp32 score buffer stays under SELECT_CHUNK_BYTES.
    impl: "reference" (this torch code), "triton" (rl.model.msa_triton's scoring kernel, then the same choice; bf16
    index q/k only), "auto" (triton on CUDA with index_dtype bf16).
    positions: `token_positions(cu_seqlens)` on index_q's device, when the caller has them (the trainer's layers).
    """
    t_count, heads, dim = index_q.shape
    if index_k.shape != (t_count, dim):
        raise ValueError(f"index_k must be [T, D] = {[t_count, dim]}, got {list(index_k.shape)}")
    if impl not in ("auto", "reference", "triton"):
        raise ValueError(f"impl must be 'auto', 'reference' or 'triton', got {impl!r}")
    if impl == "triton" or (impl == "auto" and index_q.is_cuda and index_dtype == torch.bfloat16):
        from rl.model import msa_triton  # imports Triton: only on this path

        scores = msa_triton.index_block_scores(index_q, index_k, cu_seqlens)
        if positions is None:
            positions = token_positions(cu_seqlens, index_q.device)
        return top_blocks(scores, positions, topk, init_blocks, local_blocks)
    if index_dtype is not None:
        index_q, index_k = index_q.to(index_dtype), index_k.to(index_dtype)
    out = torch.full((t_count, heads, topk), -1, dtype=torch.int32, device=index_q.device)
    for start, end in seq_bounds(cu_seqlens):
        length = end - start
        if length == 0:
            continue
        nb = -(-length // BLOCK)
        # Zero keys past the end sit at positions no query of the sequence can see: the causal mask hides them.
        keys = F.pad(index_k[start:end].float(), (0, 0, 0, nb * BLOCK - length))
        step = chunk_size or max(1, SELECT_CHUNK_BYTES // (heads * nb * BLOCK * 4))
        for c0 in range(0, length, step):
            c1 = min(c0 + step, length)
            out[start + c0:start + c1] = _select_chunk(
                index_q[start + c0:start + c1].float(), keys, c0, c1, topk, init_blocks, local_blocks)
    return out


def _select_chunk(q, keys, c0, c1, topk, init_blocks, local_blocks):
    """Selection for the queries at positions [c0, c1) of one sequence; q [C, H, D] fp32, keys [nb*128, D] fp32."""
    device = q.device
    nb = -(-c1 // BLOCK)  # later blocks are invisible to every query of the chunk
    keys = keys[:nb * BLOCK]
    # bf16-valued inputs multiply exactly even under TF32, so only the fp32 summation order can differ from vLLM.
    scores = torch.matmul(q.transpose(0, 1), keys.T)  # [H, C, nb*128]
    pos = torch.arange(c0, c1, device=device)
    scores.masked_fill_(torch.arange(nb * BLOCK, device=device)[None, :] > pos[:, None], float("-inf"))
    block_scores = scores.view(scores.shape[0], c1 - c0, nb, BLOCK).amax(-1)
    del scores
    return top_blocks(block_scores, pos, topk, init_blocks, local_blocks)


def top_blocks(block_scores: torch.Tensor, pos: torch.Tensor, topk: int, init_blocks: int,
               local_blocks: int) -> torch.Tensor:
    """vLLM's choice from block scores [H, C, nb] (fp32; -inf = invisible) of queries at positions pos [C]: forced
    init and local blocks, top-k, -1 for invisible picks and padding -> int32 [C, H, topk]."""
    device, nb = block_scores.device, block_scores.shape[-1]
    block_scores = torch.nan_to_num(block_scores, nan=NAN_SCORE, posinf=float("inf"), neginf=float("-inf"))
    ids = torch.arange(nb, device=device)[None, :]
    valid = (pos // BLOCK + 1)[:, None]
    is_init = (ids < init_blocks) & (ids < valid)
    is_local = (ids >= valid - local_blocks) & (ids < valid)
    block_scores.masked_fill_(is_init[None], FORCED_INIT_SCORE)
    block_scores.masked_fill_(is_local[None], FORCED_LOCAL_SCORE)  # after init: local wins when a block is both

    k = min(topk, nb)
    vals, top = block_scores.topk(k, dim=-1)
    top = top.masked_fill(vals == float("-inf"), -1).to(torch.int32)  # invisible blocks: -1 padding
    return F.pad(top, (0, topk - k), value=-1).transpose(0, 1)


# --- replay ------------------------------------------------------------------------------------------------------

def validate_block_ids(
    block_ids: torch.Tensor, cu_seqlens, *, num_heads: int | None = None, topk: int | None = None,
    init_blocks: int | None = None, local_blocks: int | None = None,
) -> None:
    """Check engine-provided ids [T, H, topk] (one sparse layer) against vLLM's selection contract.

    Raises one ValueError naming the problem and the first offending (token, head) row: shape, dtype, id < -1,
    id beyond the blocks the query sees (pos//128 + 1), duplicate ids, a block count other than
    min(topk, visible) (vLLM always fills every slot it can), -1 before a real id, and, when init/local are
    given and fit in topk, a missing forced block. Misaligned rows (a token shift between engine and trainer)
    usually surface as ids beyond the visible blocks or as a wrong count at block boundaries.
    """
    bounds = seq_bounds(cu_seqlens)
    total = bounds[-1][1]
    if block_ids.dim() != 3:
        raise ValueError(f"block_ids must be [T, H, topk], got shape {list(block_ids.shape)}")
    t_count, heads, k = block_ids.shape
    expected = [total, num_heads if num_heads is not None else heads, topk if topk is not None else k]
    if [t_count, heads, k] != expected:
        raise ValueError(f"block_ids shape {list(block_ids.shape)} != expected [T, H, topk] = {expected} "
                         "(T = cu_seqlens[-1]; engine capture is per layer [tokens, kv_heads, topk])")
    if block_ids.dtype.is_floating_point or block_ids.dtype.is_complex or block_ids.dtype == torch.bool:
        raise ValueError(f"block_ids must be an integer tensor, got {block_ids.dtype}")
    if t_count == 0:
        return
    ids = block_ids.long()
    pos = token_positions(cu_seqlens, ids.device)
    visible = (pos // BLOCK + 1)[:, None, None]
    seq_of = torch.bucketize(torch.arange(total, device=ids.device),
                             to_device([e for _, e in bounds], ids.device), right=True)

    def fail(bad: torch.Tensor, what: str):
        rows = bad.reshape(t_count, heads, -1).any(-1)
        if not bool(rows.any()):
            return
        t, h = (int(i) for i in rows.nonzero()[0])
        raise ValueError(
            f"block_ids: {what} in {int(rows.sum())} (token, head) row(s); first: token {t} (sequence "
            f"{int(seq_of[t])}, position {int(pos[t])}, sees blocks 0..{int(visible[t]) - 1}), head {h}: "
            f"{block_ids[t, h].tolist()}")

    fail(ids < -1, "id < -1 (only -1 marks an empty slot)")
    fail(ids >= visible, "block id beyond the query's visible blocks")
    srt = ids.sort(-1).values
    fail((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0), "duplicate block id")
    real = ids >= 0
    fail(real[..., 1:] & ~real[..., :-1], "-1 padding before a real id")
    fail(real.sum(-1, keepdim=True) != visible.clamp(max=k), "selected block count != min(topk, visible blocks)")
    if init_blocks is not None and local_blocks is not None and init_blocks + local_blocks <= k:
        forced = [(b, "init") for b in range(init_blocks)] + [(-1 - j, "local") for j in range(local_blocks)]
        for offset, kind in forced:
            # local offsets count back from the last visible block; init ones forward from block 0
            block = visible + offset if offset < 0 else torch.full_like(visible, offset)
            applies = (block >= 0) & (block < visible)
            fail(applies & ~(ids == block).any(-1, keepdim=True), f"forced {kind} block {offset} missing")


def block_sets_equal(ids_a: torch.Tensor, ids_b: torch.Tensor) -> torch.Tensor:
    """bool [T, H]: whether the two selections pick the same set of blocks (order and -1 padding ignored)."""
    if ids_a.shape != ids_b.shape:
        raise ValueError(f"selections differ in shape: {list(ids_a.shape)} vs {list(ids_b.shape)}")
    return (ids_a.long().sort(-1).values == ids_b.long().sort(-1).values).all(-1)


def selection_match_rate(ids_a: torch.Tensor, ids_b: torch.Tensor) -> torch.Tensor:
    """selection_agreement as a 0-d tensor on the ids' device: no host sync where it is computed (each layer, and
    each sequence group, of the trainer's forward and recompute); the trainer reads it after the forward."""
    equal = block_sets_equal(ids_a, ids_b)
    return equal.float().mean() if equal.numel() else torch.ones((), device=equal.device)


def selection_agreement(ids_a: torch.Tensor, ids_b: torch.Tensor) -> float:
    """Fraction of (query, head) rows whose block sets match, e.g. trainer selection vs engine replay."""
    return float(selection_match_rate(ids_a, ids_b))


# --- attention ---------------------------------------------------------------------------------------------------

def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor, cu_seqlens,
    scale: float | None = None, impl: str = "auto", *, validate: bool = True, chunk_size: int | None = None,
    kernel_options: dict | None = None,
) -> torch.Tensor:
    """Block-sparse attention on a packed batch, differentiable w.r.t. q, k, v.

    q [T, Hq, D]; k, v [T, Hkv, D]; block_ids [T, Hkv, topk] per-sequence block ids (-1 = empty);
    scale defaults to D**-0.5. Query head h reads KV head h // (Hq // Hkv) and that head's blocks.
    impl: "reference" (chunked dense masked attention, exact, any device), "block" (rl.model.msa_block_outer: KV-block-
    outer kernels, CUDA bf16/fp16), "triton" (rl.model.msa_triton: per-token block-sparse kernels, CUDA bf16/fp16), "flex"
    (FlexAttention with a BlockMask, CUDA; forward only on CPU), "auto" (block on CUDA in bf16/fp16, flex on CUDA in
    fp32, reference elsewhere).
    Returns [T, Hq, D] in q's dtype.
    """
    t_count, hq, dim = q.shape
    if k.shape[0] != t_count or v.shape != k.shape or k.shape[2] != dim or hq % k.shape[1]:
        raise ValueError(f"expected q [T, Hq, D], k = v [T, Hkv, D] with Hkv | Hq; got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if validate:
        validate_block_ids(block_ids, cu_seqlens, num_heads=k.shape[1])
    scale = dim ** -0.5 if scale is None else scale
    if impl == "auto":  # the Triton kernels are measured and tested in bf16 (fp32 tiles exceed shared memory)
        # block-outer beats the per-token kernels at every length measured, 4K-64K (results/gpu/issue18_targets.json)
        impl = ("block" if q.dtype != torch.float32 else "flex") if q.is_cuda else "reference"
    if impl == "reference":
        return _reference_attention(q, k, v, block_ids, cu_seqlens, scale, chunk_size)
    if impl == "block":
        from rl.model import msa_block_outer  # imports Triton: only on this path

        return msa_block_outer.sparse_attention(q, k, v, block_ids, cu_seqlens, scale)
    if impl == "triton":
        from rl.model import msa_triton  # imports Triton: only on this path

        return msa_triton.sparse_attention(q, k, v, block_ids, cu_seqlens, scale)
    if impl == "flex":
        return _flex_attention(q, k, v, block_ids, cu_seqlens, scale, kernel_options)
    raise ValueError(f"impl must be 'reference', 'block', 'triton', 'flex' or 'auto', got {impl!r}")


def _reference_attention(q, k, v, block_ids, cu_seqlens, scale, chunk_size):
    """Per sequence and query chunk: dense scores against the sequence's keys up to the chunk end, masked to the
    selected blocks and causality. Chunks are recomputed in backward (checkpoint), so memory stays at one chunk."""
    hq = q.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    differentiable = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs = []
    for start, end in seq_bounds(cu_seqlens):
        length = end - start
        # Upcast k/v once per sequence: every chunk adds to their gradients, and those sums must run in fp32,
        # not in a bf16 gradient buffer, for the bf16 reference to be "fp32 math, rounded once".
        ks, vs = k[start:end].to(acc), v[start:end].to(acc)
        step = chunk_size or max(1, REFERENCE_CHUNK_BYTES // (hq * max(length, 1) * 4))
        for c0 in range(0, length, step):
            c1 = min(c0 + step, length)
            mask = _key_mask(block_ids[start + c0:start + c1], c0, c1)
            args = (q[start + c0:start + c1], ks[:c1], vs[:c1], mask, scale)
            if differentiable:
                outs.append(torch.utils.checkpoint.checkpoint(_masked_attention, *args, use_reentrant=False))
            else:
                outs.append(_masked_attention(*args))
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def _key_mask(ids: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """bool [Hkv, C, c1]: key p of the sequence is in a block the query selected and p <= the query's position."""
    nb = -(-c1 // BLOCK)
    ids = ids.long().transpose(0, 1)  # [Hkv, C, topk]
    chosen = torch.zeros(*ids.shape[:2], nb + 1, dtype=torch.bool, device=ids.device)
    chosen.scatter_(2, torch.where(ids < 0, nb, ids), True)  # -1 lands in a spill column
    mask = chosen[..., :nb].repeat_interleave(BLOCK, dim=-1)[..., :c1]
    pos = torch.arange(c0, c1, device=ids.device)
    return mask & (torch.arange(c1, device=ids.device)[None, :] <= pos[:, None])


def _masked_attention(q, k, v, mask, scale):
    """q [C, Hq, D], k/v [L, Hkv, D], mask [Hkv, C, L]; math in fp32 (fp64 stays fp64, for gradcheck), the result
    in q's dtype."""
    c, hq, dim = q.shape
    hkv = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(acc).view(c, hkv, hq // hkv, dim).permute(1, 2, 0, 3)  # [Hkv, G, C, D]
    kf = k.to(acc).permute(1, 0, 2)[:, None]  # [Hkv, 1, L, D]
    vf = v.to(acc).permute(1, 0, 2)[:, None]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [Hkv, G, C, D]
    return out.permute(2, 0, 1, 3).reshape(c, hq, dim).to(q.dtype)


# --- FlexAttention -----------------------------------------------------------------------------------------------
#
# Mask construction. FlexAttention's BlockMask works on a grid of 128 x 128 tiles of one long sequence, so:
# 1. Layout: every sequence is right-padded to a multiple of 128 and placed at a 128-aligned offset. MSA block b
#    of a sequence is then exactly one flex KV tile, and each flex Q tile holds queries of one sequence only.
#    Padding keys sit after every real query of their sequence (causality hides them); padding queries copy the
#    selection of their sequence's last real query, so no row is empty and full tiles stay full; their outputs
#    are dropped.
# 2. Heads: KV heads become the batch dimension and each group's query heads the head dimension (q
#    [Hkv, G, Tpad, D], k/v [Hkv, 1, Tpad, D]). The BlockMask is then [Hkv, 1, ...]: one selection per KV head,
#    shared by its query heads (flex indexes the mask's head axis by query head modulo its size, so a [1, Hkv]
#    mask would pair query head h with KV head h % Hkv rather than h // G).
# 3. Tiles: Q tile i lists every KV tile that some query of the tile selected (the union, so it grows when
#    neighbouring queries disagree). A listed tile is "full" (mask_mod skipped) when all 128 queries selected it
#    and it lies strictly below the diagonal; otherwise it is partial.
# 4. mask_mod, applied on partial tiles: the query selected the key's block (a [Hkv, Tpad, max_blocks] bool table
#    indexed by the block's number inside the query's sequence) and kv <= q in the padded coordinates, which is
#    causality within the sequence. Keys of other sequences fail it too, so the eager (unfused) flex path, which
#    ignores the tile lists, computes the same thing.

class PackedLayout:
    """Where each packed token lives in the 128-aligned padded layout used for FlexAttention."""

    def __init__(self, cu_seqlens, device):
        bounds = seq_bounds(cu_seqlens)
        lens = [e - s for s, e in bounds]
        padded = [-(-n // BLOCK) * BLOCK for n in lens]
        self.padded_tokens = sum(padded)
        self.max_blocks = max(padded) // BLOCK if padded else 0
        dest, src, base = [], [], []
        offset = 0
        for (start, end), n, p in zip(bounds, lens, padded):
            if n:
                local = torch.arange(p, device=device)
                dest.append(offset + local[:n])
                src.append(start + local.clamp(max=n - 1))  # padding rows repeat the last real token
                base.append(torch.full((p,), offset // BLOCK, device=device))
            offset += p
        empty = torch.empty(0, dtype=torch.long, device=device)
        self.dest = torch.cat(dest) if dest else empty  # padded row of each packed token [T]
        self.src = torch.cat(src) if src else empty  # packed token each padded row copies its selection from
        self.base_block = torch.cat(base) if base else empty  # first KV tile of each padded row's sequence


def build_block_mask(block_ids: torch.Tensor, cu_seqlens, layout: PackedLayout | None = None):
    """BlockMask [Hkv, 1, Tpad, Tpad] for `block_ids` [T, Hkv, topk]; returns (block_mask, layout).

    Expects validated ids: a duplicate id would count twice towards a tile's 128 and could mark it full."""
    from torch.nn.attention.flex_attention import BlockMask

    device = block_ids.device
    layout = layout or PackedLayout(cu_seqlens, device)
    hkv = block_ids.shape[1]
    tiles = layout.padded_tokens // BLOCK
    ids = block_ids.long()[layout.src].transpose(0, 1)  # [Hkv, Tpad, topk], per-sequence block numbers
    real = ids >= 0

    selected = torch.zeros(hkv, layout.padded_tokens, layout.max_blocks + 1, dtype=torch.bool, device=device)
    selected.scatter_(2, torch.where(real, ids, layout.max_blocks), True)
    selected = selected[..., :layout.max_blocks].contiguous()

    # Queries per (KV head, Q tile, KV tile): > 0 lists the tile, == 128 may make it full.
    q_tile = torch.arange(layout.padded_tokens, device=device) // BLOCK
    kv_tile = torch.where(real, ids + layout.base_block[None, :, None], tiles)
    flat = (torch.arange(hkv, device=device)[:, None, None] * tiles + q_tile[None, :, None]) * (tiles + 1) + kv_tile
    counts = torch.zeros(hkv * tiles * (tiles + 1), dtype=torch.int32, device=device)
    counts.scatter_add_(0, flat.reshape(-1), torch.ones(flat.numel(), dtype=torch.int32, device=device))
    counts = counts.view(hkv, tiles, tiles + 1)[..., :tiles]
    below_diagonal = torch.arange(tiles, device=device)[None, :] < torch.arange(tiles, device=device)[:, None]
    full = (counts == BLOCK) & below_diagonal
    partial = (counts > 0) & ~full

    base_block = layout.base_block
    last_block = max(layout.max_blocks - 1, 0)

    def mask_mod(b, h, q_idx, kv_idx):
        local = kv_idx // BLOCK - base_block[q_idx]
        return (kv_idx <= q_idx) & (local >= 0) & selected[b, q_idx, local.clamp(0, last_block)]

    def ordered(tile_mask):  # (count [Hkv,1,tiles], indices [Hkv,1,tiles,tiles]): listed tiles first, ascending
        order = torch.sort(tile_mask.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return tile_mask.sum(-1).to(torch.int32)[:, None], order.to(torch.int32)[:, None]

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                          seq_lengths=(layout.padded_tokens, layout.padded_tokens))
    return block_mask, layout


@functools.cache
def _compiled_flex(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled flex materialises every score and ignores the tile lists; only the compiled kernel is sparse.
    # CUDA: automatic dynamic shapes, so a new batch length reuses one kernel instead of recompiling until the
    # recompile limit silently drops to the dense eager path. CPU (tests only): the C++ flex template fails to
    # build with symbolic shapes (torch 2.13), so compile per shape.
    return torch.compile(flex_attention, dynamic=False if device_type == "cpu" else None)


def _flex_attention(q, k, v, block_ids, cu_seqlens, scale, kernel_options):
    _, hq, dim = q.shape
    hkv = k.shape[1]
    if not q.is_cuda and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("FlexAttention has no backward on CPU; use impl='reference' there")
    layout = PackedLayout(cu_seqlens, q.device)
    if layout.padded_tokens == 0:
        return q.new_empty(q.shape)
    block_mask, _ = build_block_mask(block_ids, cu_seqlens, layout)

    def padded(x):  # [T, H, D] -> [Tpad, H, D], zeros in padding rows
        return x.new_zeros(layout.padded_tokens, *x.shape[1:]).index_copy(0, layout.dest, x)

    qp = padded(q).view(layout.padded_tokens, hkv, hq // hkv, dim).permute(1, 2, 0, 3).contiguous()
    kp = padded(k).permute(1, 0, 2)[:, None].contiguous()
    vp = padded(v).permute(1, 0, 2)[:, None].contiguous()
    flex = _compiled_flex(q.device.type)
    out = flex(qp, kp, vp, block_mask=block_mask, scale=scale, enable_gqa=hq != hkv, kernel_options=kernel_options)
    return out.permute(2, 0, 1, 3).reshape(layout.padded_tokens, hq, dim)[layout.dest]
