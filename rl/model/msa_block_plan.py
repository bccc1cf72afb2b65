"""The work plan of the block-outer MSA kernels (rl.model.msa_block_outer): which (token, KV head, slot) selections
each program handles, built from block_ids without waiting for the device.

Every selection is an *entry*; entries are grouped by (KV head, key block) with one stable sort and each group is cut
into *items* of at most `Config.item_tokens` tokens (one program each). The number of items is only known on the
device, so the item tables get a host-computed upper bound of rows (`Plan.n_max`); the rows past the real items are
empty and launched last. On CUDA two small Triton kernels build the tables around the sort, the second one also
sorting short calls' items into their launch order (KERNEL_SORT_MAX); without Triton (CPU) torch ops build the same
tables (`_plan_torch`; the interpreter tests compare the two). Host work is what a 4K-token call waits on before its
first heavy kernel (results/gpu/run92-93, scripts/gpu/msa_host_probe.py: ~15-35 us per Triton launch, ~45-65 us per
torch.sort, ~300 us for a plan of three launches and two sorts), hence two launches and one sort there, and for short
calls (GRAPH_MAX_ENTRIES) from a batch layout's second call on one CUDA graph of them (`_PlanGraph`): the ids copied
in, one replay, the tables cloned out.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from m3.ops import MSA_BLOCK as BLOCK  # keys per program
from rl.model.packed import seq_bounds, to_device

try:  # module-level jit functions: Triton's interpreter resolves callees from module globals
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch plan
    triton = None


@dataclass(frozen=True)
class Config:
    """Tile shapes and launch parameters (scripts/bench_msa.py --sweep times alternatives)."""

    # Defaults from the sweeps of results/gpu/run12 and run12c (64 q / 4 KV heads, d 128, top-16; 4K, 32K, 64K).
    fwd_rows: int = 64  # rows per forward tile: rows // G tokens x their G query heads (4 tokens for M3)
    fwd_warps: int = 4
    fwd_stages: int = 3  # run12c, fwd: 11.5 vs 12.0 ms (2 stages) at 32K, 21.4 vs 22.6 at 64K
    bwd_rows: int = 64
    bwd_keys: int = 128  # keys per backward program (64: two programs per item, half the dK/dV registers)
    bwd_warps: int = 8
    bwd_stages: int = 2  # Triton's num_stages; gluon_ws: stages of its ring of gathered rows
    # "gluon": rl.model.msa_block_outer_gluon (Hopper, 128-key programs: MMAs overlapped with the softmax work),
    # "gluon_ws": the Gluon kernel warp-specialized (a loader partition gathers the rows; run44: 24.1 vs 25.0 ms
    # fwd+bwd at 32K), "triton": the Triton kernel (any device, the interpreter, 64-key programs); "auto": gluon_ws
    # where its tiles fit (msa_block_outer.ws_fits), else gluon, else triton
    bwd_kernel: str = "auto"
    # the same choice for the forward kernel ("gluon": 64- or 128-row tiles, warps = rows/16; "gluon_ws": a TMA loader
    # warp and two math warpgroups on alternate 64-row tiles of whole tokens, run46: 8.44 vs 9.04 ms fwd at 32K;
    # "auto": gluon_ws where its tiles fit (msa_block_outer.ws_fits), else gluon, else triton)
    fwd_kernel: str = "auto"
    part_dtype: str = "bf16"  # storage of partial outputs / dQ partials: "bf16" or "fp32"
    dq: str = "partial"  # "partial" (per-entry partials, then a sum) or "atomic" (fp32 atomic adds)
    # gluon_ws: dQ partials leave "tma" (through shared memory and TMA stores that run under the next tile; where
    # ws_fits allows) or "registers" (stored from the math warps, as _bwd_gluon does)
    dq_store: str = "tma"
    # gluon_ws backward: "split" runs the tiles that can meet the causal edge in a masked loop and the rest in one
    # without masks (run82 at 32K: backward 9.41 vs 10.71 ms with TMA dQ stores); "masked" masks every tile in one
    # loop; "auto": split with TMA dQ stores, masked with register ones, and masked under Triton 3.8+ (torch 2.14),
    # where only "masked" compiles without spills in the MMA loop and is the faster (run126; msa_block_outer.bwd_loops)
    bwd_loops: str = "auto"
    item_tokens: int = 512  # entries per work item
    # Prefix tokens per sequence from which SDPA takes the dense prefix; 0 = never. Off: the kernels take those
    # tokens for less than SDPA plus gathering them (run12 sweep: 33.6 vs 34.9 ms at 32K, 5.1 vs 5.5 ms at 4K).
    dense_prefix_min: int = 0
    row_tile: int = 128  # rows per program of the row-wise kernels (merge, delta, dQ sum)
    # head-dim columns per program of the dK/dV sum over a key block's items (a power of two): one program per key
    # block is fewer programs than SMs at 4K tokens (Hkv*NKB = 128)
    dkdv_cols: int = 32
    # Sequences per kernel call: consecutive sequences of at most this many tokens together (0: the whole batch). The
    # per-entry partials scale with the tokens of a call (~0.26 MB per token for M3); 16K-token calls run at the
    # 64K-token rate per token (run14c: 14.0 vs 55.9 ms fwd+bwd per 16K / 64K).
    group_tokens: int = 16384
    # Short calls' plans from a CUDA graph per batch layout (build_plan, GRAPH_MAX_ENTRIES); False: always launched
    plan_graphs: bool = True
    order: str = "token"  # launch order of work items: "size" (largest first), "token" (by first token: programs
    # running together read the same tokens' q/dO, which may then come from L2) or "key" (the item tables' own
    # (KV head, key block) order; run91, when it saved a torch.sort: fwd+bwd 2.98 vs 2.80 ms at 4K, 21.37 vs 21.18 at
    # 32K, slower back to back too)

    def __post_init__(self):
        choices = {"part_dtype": ("bf16", "fp32"), "dq": ("partial", "atomic"), "order": ("size", "token", "key"),
                   "bwd_kernel": ("auto", "gluon", "gluon_ws", "triton"),
                   "fwd_kernel": ("auto", "gluon", "gluon_ws", "triton"), "dq_store": ("tma", "registers"),
                   "bwd_loops": ("auto", "split", "masked")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"msa_block_outer Config.{name}={getattr(self, name)!r}: expected one of {allowed}")
        if self.dkdv_cols < 1 or self.dkdv_cols & (self.dkdv_cols - 1):
            raise ValueError(f"msa_block_outer Config.dkdv_cols={self.dkdv_cols}: expected a power of two")
        if self.bwd_keys not in (64, 128):
            raise ValueError(f"msa_block_outer Config.bwd_keys={self.bwd_keys}: expected 64 or 128")


DEFAULT = Config()


@dataclass
class Plan:
    """Index tables for one (block_ids, cu_seqlens); built on the ids' device without a host sync.

    The number of work items is only known on the device, so the item tables have a host-computable upper bound of
    rows (`n_max`); rows past the real items are empty (lo == hi) and launched last: their programs do no work."""

    entries: torch.Tensor  # [NE] int32 flat (token*Hkv + head)*topk + slot, grouped by (head, block), tokens ascending
    item_key: torch.Tensor  # [n_max] int32 head*NKB + global block of each item (items in key order; 0 when empty)
    item_lo: torch.Tensor  # [n_max] int32 range of the item in `entries` (lo == hi: an empty row)
    item_hi: torch.Tensor
    order: torch.Tensor  # [n_max] int32 launch order (Config.order), empty rows last
    key_item0: torch.Tensor  # [Hkv*NKB + 1] int32 first item of each key
    kstart: torch.Tensor  # [NKB] int32 packed index of each global block's first key
    kend: torch.Tensor  # [NKB] int32 end of that block's sequence (keys past it belong to the next one)
    slot_gid: torch.Tensor  # [T, Hkv, topk] int32 global block per slot; -1 empty or dense-prefix token
    slot_pos: torch.Tensor  # [T, Hkv, topk] int32 position of the slot in `entries` (its partials' row / G); -1 as gid
    dense_row: torch.Tensor | None  # [T] int32 row in the dense-prefix output, -1 for kernel tokens; None: no prefix
    dense_idx: torch.Tensor  # [Tp] int64 tokens of the dense prefixes, in order
    prefixes: list  # [(start, length)] SDPA calls, offsets into the packed tokens
    nkb: int
    n_max: int  # rows of the item tables: Hkv*NKB + ceil(NE / item_tokens) >= the number of items


_EMPTY_KEY = 2 ** 31 - 1  # launch-order key of the empty item rows: after every real one
# Item rows up to which the plan kernel sorts them into their launch order itself (one program, a bitonic sort of the
# next power of two of keys in registers: 2048 rows, an 8K-token sequence); past it, torch.sort does. The one-program
# sort saves a torch.sort's host time, which matters where the kernels are short (4K: plan 0.16 vs 0.22 ms), and costs
# GPU time at size (32K, 8192 rows: plan 0.44 vs 0.30 ms; results/gpu/run94).
KERNEL_SORT_MAX = 2048


def _host_tables(bounds, topk: int, dense_prefix_min: int):
    """Per-sequence and per-block tables from the (host) sequence bounds, in plain Python: [start, base, plen] per
    sequence, [kstart], [kend] per global block, the dense prefixes (Config.dense_prefix_min) and the block count."""
    seq, kstart, kend, prefixes, nkb = [], [], [], [], 0
    for s, e in bounds:
        nblk = (e - s + BLOCK - 1) // BLOCK
        # Dense prefixes: positions < topk*128 select every visible block, i.e. causal attention over the prefix.
        plen = min(e - s, topk * BLOCK)
        plen = plen if dense_prefix_min > 0 and plen >= dense_prefix_min else 0
        seq.append((s, nkb, plen))
        kstart += range(s, s + BLOCK * nblk, BLOCK)
        kend += [e] * nblk
        if plen:
            prefixes.append((s, plen))
        nkb += nblk
    return seq, kstart, kend, prefixes, nkb


@functools.lru_cache(maxsize=16)
def _device_tables(bounds: tuple, t_count: int, topk: int, dense_prefix_min: int, device: torch.device):
    """`_host_tables` on the device, once per batch layout: every layer of a step (and its backward) has the same one,
    and pinning + copying them was the largest host cost of a call (results/gpu/run57 traces: ~0.5 ms of the ~1 ms
    before the first kernel). Read-only: kernels and index ops read them, nothing writes them."""
    seq, kstart, kend, prefixes, nkb = _host_tables(bounds, topk, dense_prefix_min)
    host = to_device([x for row in seq for x in row] + kstart + kend, device, torch.int32)
    seq_d, kstart_d, kend_d = host.split([3 * len(seq), nkb, nkb])
    dense_row, dense_idx = None, torch.empty(0, dtype=torch.int64, device=device)
    if prefixes:
        dense_idx = to_device([i for s, p in prefixes for i in range(s, s + p)], device)  # <= topk*128 per sequence
        dense_row = torch.full((t_count,), -1, dtype=torch.int32, device=device)
        dense_row[dense_idx] = torch.arange(len(dense_idx), dtype=torch.int32, device=device)
    return seq_d, len(seq), kstart_d, kend_d, prefixes, nkb, dense_row, dense_idx


def _layout_tables(block_ids: torch.Tensor, bounds: tuple, config: Config):
    """`_device_tables` of this call's batch layout (cached: the same for every layer of a step)."""
    return _device_tables(bounds, block_ids.shape[0], block_ids.shape[2], config.dense_prefix_min, block_ids.device)


def dense_prefixes(block_ids: torch.Tensor, cu_seqlens, config: Config = DEFAULT) -> tuple[list, torch.Tensor]:
    """`Plan.prefixes` and `Plan.dense_idx` of `build_plan` (the same cached tables), without the plan's kernels:
    the dense prefixes' SDPA can be queued before the plan's host work."""
    _, _, _, _, prefixes, _, _, dense_idx = _layout_tables(block_ids, tuple(seq_bounds(cu_seqlens)), config)
    return prefixes, dense_idx


def build_plan(block_ids: torch.Tensor, cu_seqlens, config: Config = DEFAULT) -> Plan:
    """The inverted lists, with no device->host sync (the plan is built inside every attention call; a sync there
    drains the launch queue of the whole layer): host tables in Python, copied in one transfer once per batch layout
    (`_device_tables`); then, with Triton, two kernels around one stable sort of the entries (`_plan_keys`,
    `_plan_index`, which also sorts the items into their launch order), replayed from a CUDA graph for short calls
    (`_plan_graphed`), and without Triton (CPU) the same tables from torch ops (`_plan_torch`)."""
    t_count, hkv, topk = block_ids.shape
    bounds = tuple(seq_bounds(cu_seqlens))
    seq_d, nseq, kstart_d, kend_d, prefixes, nkb, dense_row, dense_idx = _layout_tables(block_ids, bounds, config)
    ne = t_count * hkv * topk
    n_max = hkv * nkb + -(-ne // config.item_tokens)  # each key adds < 1 item to its share of ceil(NE / item_tokens)
    args = (block_ids, seq_d, nseq, nkb, n_max, config)
    if triton is None or not (block_ids.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        tables = _plan_torch(*args)  # (CPU tensors where Triton is installed, e.g. the GPU profile's CPU tests)
    elif (config.plan_graphs and block_ids.is_cuda and 0 < ne <= GRAPH_MAX_ENTRIES
          and not torch.cuda.is_current_stream_capturing()):  # (inside a caller's own capture: launched)
        tables = _split_tables(_plan_graphed(bounds, *args), block_ids.shape, nkb, n_max, config)
    else:
        tables = _plan_triton(*args)
    gid, pos, entries, item_key, lo, hi, order, key_item0 = tables
    return Plan(entries, item_key, lo, hi, order, key_item0, kstart_d, kend_d, gid, pos, dense_row, dense_idx,
                prefixes, nkb, n_max)


def _plan_torch(block_ids, seq_d, nseq, nkb, n_max, config):
    """`build_plan`'s device tables from torch ops (no Triton: CPU); the same tables as `_plan_triton`."""
    device = block_ids.device
    t_count, hkv, topk = block_ids.shape
    start, base, plen = seq_d.view(nseq, 3).long().unbind(1)
    tok = torch.arange(t_count, device=device)
    sq = (tok[:, None] >= start[None, 1:]).sum(1)  # the last sequence starting at or before the token
    dense = tok - start[sq] < plen[sq]
    ids = block_ids.long()
    gid = torch.where((ids >= 0) & ~dense[:, None, None], ids + base[sq][:, None, None], -1)
    big = hkv * nkb  # sorts after every real key
    head_base = (torch.arange(hkv, device=device) * nkb)[None, :, None]
    key, entries = torch.sort(torch.where(gid >= 0, head_base + gid, big).reshape(-1), stable=True)  # by token
    pos = torch.full((t_count * hkv * topk,), -1, dtype=torch.int32, device=device)
    pos[entries] = torch.where(key < big, torch.arange(len(key), device=device), -1).to(torch.int32)
    bounds_k = torch.searchsorted(key, torch.arange(big + 1, device=device))
    per_key = (bounds_k[1:] - bounds_k[:-1] + config.item_tokens - 1) // config.item_tokens
    key_item0 = F.pad(torch.cumsum(per_key, 0), (1, 0))
    item_key = torch.repeat_interleave(torch.arange(big, device=device), per_key)
    n_items = item_key.numel()
    lo = bounds_k[item_key] + (torch.arange(n_items, device=device) - key_item0[item_key]) * config.item_tokens
    hi = torch.minimum(lo + config.item_tokens, bounds_k[item_key + 1])
    okey = entries[lo] // (hkv * topk) if config.order == "token" else lo - hi  # largest first: stable on -size
    pad = lambda x, fill: F.pad(x, (0, n_max - n_items), value=fill).to(torch.int32)  # noqa: E731
    order = (_rows(n_max, device) if config.order == "key" else
             torch.sort(pad(okey, _EMPTY_KEY), stable=True).indices.to(torch.int32))
    return (gid.to(torch.int32).contiguous(), pos.view(gid.shape), entries.to(torch.int32), pad(item_key, 0),
            pad(lo, 0), pad(hi, 0), order, key_item0.to(torch.int32))


def _plan_triton(block_ids, seq_d, nseq, nkb, n_max, config):
    """`build_plan`'s device tables from the plan's launches (`_plan_launches`), as `_plan_torch` returns them."""
    return _split_tables(_plan_launches(block_ids, seq_d, nseq, nkb, n_max, config), block_ids.shape, nkb, n_max,
                         config)


def _plan_launches(block_ids, seq_d, nseq, nkb, n_max, config) -> torch.Tensor:
    """`_plan_keys` (slot -> global block and sort key), a stable sort of the keys and `_plan_index` (the sorted
    entries and each slot's position; in one more program the item rows by binary search and, up to KERNEL_SORT_MAX
    rows, their launch order): every table in one int32 buffer (`_split_tables` names its parts)."""
    device = block_ids.device
    t_count, hkv, topk = block_ids.shape
    ne = t_count * hkv * topk
    # int32 entries (int64 ones cost the backward kernel register spills), each slot's block and sorted position and
    # the item tables: one allocation (one clone out of a graph's buffers)
    tabs = torch.empty(3 * ne + 5 * n_max + hkv * nkb + 1, dtype=torch.int32, device=device)
    gid, entries, pos, item_key, lo, hi, okey, order, key_item0 = _parts(tabs, ne, n_max, hkv * nkb)
    # int16 sort keys where they fit (keys <= Hkv*NKB): a radix sort of 2 bytes, half the passes of int32's
    key = torch.empty(ne, dtype=torch.int16 if hkv * nkb < 2 ** 15 else torch.int32, device=device)
    if ne:
        _plan_keys[(triton.cdiv(ne, 1024),)](block_ids, seq_d, gid, key, ne, nseq, nkb, *block_ids.stride(),
                                             HKV=hkv, TOPK=topk, BE=1024)
    key, idx = torch.sort(key, stable=True)  # by token inside a key
    sort_np = _kernel_sort_rows(n_max, config)
    _plan_index[(triton.cdiv(ne, 1024) + 1,)](
        key, idx, entries, pos, key_item0, item_key, lo, hi, okey, order, ne, max(ne, 1).bit_length(), hkv * nkb,
        n_max, config.item_tokens, HKVTOPK=hkv * topk, SIZE_ORDER=config.order == "size", NP=sort_np, BE=1024,
        CH=1024)
    if config.order != "key" and not sort_np:
        order.copy_(torch.sort(okey, stable=True).indices)
    return tabs


def _kernel_sort_rows(n_max: int, config: Config) -> int:
    """The power of two of item rows `_plan_index` sorts into their launch order itself; 0: torch.sort does, or
    (Config.order "key") nothing does."""
    return triton.next_power_of_2(n_max) if config.order != "key" and n_max <= KERNEL_SORT_MAX else 0


def _parts(tabs: torch.Tensor, ne: int, n_max: int, nk: int) -> list:
    """gid, entries, pos, item_key, lo, hi, okey, order, key_item0: views of `_plan_launches`' buffer."""
    return tabs.split([ne] * 3 + [n_max] * 5 + [nk + 1])


def _split_tables(tabs, shape: torch.Size, nkb: int, n_max: int, config: Config):
    """`_plan_launches`' buffer for block ids of `shape` as `_plan_torch`'s tables (order "key": the rows as they
    are)."""
    t_count, hkv, topk = shape
    gid, entries, pos, item_key, lo, hi, _, order, key_item0 = _parts(tabs, t_count * hkv * topk, n_max, hkv * nkb)
    if config.order == "key":
        order = _rows(n_max, tabs.device)
    return gid.view(shape), pos.view(shape), entries, item_key, lo, hi, order, key_item0


# Calls of at most this many entries (8K tokens of M3: 64 per token) take their plan from a CUDA graph of
# `_plan_launches`, one per batch layout, from the layout's second call on: the ids copied in, one replay and one clone
# out cost ~3 launches of host time instead of ~2 launches and a sort (and the cold Python around them), which is what
# a short call waits on before its first kernel. Longer calls' kernels hide the plan's host time (32K: 20 ms of
# kernels), and each graph keeps its buffers (~1 MB per 32K entries).
GRAPH_MAX_ENTRIES = 2 ** 19
GRAPH_LAYOUTS = 4  # layouts remembered (seen once, or with a graph), least recently used dropped


@dataclass
class _PlanGraph:
    graph: "torch.cuda.CUDAGraph"
    ids: torch.Tensor  # its input: each call's block_ids are copied in (a layout's calls on one stream, as the trainer
    # makes them: the stream orders each copy after the previous replay)
    tabs: torch.Tensor  # its output, rewritten by every replay: cloned out (a plan lives until its backward)
    seq_d: torch.Tensor  # read by the graph: kept alive with it


_GRAPHS: OrderedDict = OrderedDict()  # layout key -> _PlanGraph, or None after the layout's first call


def _plan_graphed(bounds: tuple, block_ids, seq_d, nseq, nkb, n_max, config) -> torch.Tensor:
    """`_plan_launches`' buffer: launched on a layout's first call (a one-off layout pays no capture), launched on a
    buffer of the graph's own and captured on its second, replayed from its third."""
    args = (seq_d, nseq, nkb, n_max, config)
    key = (bounds, block_ids.shape, block_ids.dtype, block_ids.device, n_max, config.item_tokens, config.order,
           config.dense_prefix_min, _kernel_sort_rows(n_max, config))
    if key not in _GRAPHS:
        _remember(key, None)
        return _plan_launches(block_ids, *args)
    _GRAPHS.move_to_end(key)
    entry = _GRAPHS[key]
    if entry is None:
        with torch.inference_mode(False):  # a normal tensor: later calls copy into it in any mode (an inference
            ids = torch.empty(block_ids.shape, dtype=block_ids.dtype, device=block_ids.device)  # tensor refuses that)
        ids.copy_(block_ids)
        tabs = _plan_launches(ids, *args)  # compiles any specialization the static buffer needs, before the capture
        graph, out = _capture(lambda: _plan_launches(ids, *args), block_ids.device)
        _remember(key, _PlanGraph(graph, ids, out, seq_d))
        return tabs
    entry.ids.copy_(block_ids)
    entry.graph.replay()
    return entry.tabs.clone()


def _remember(key, value) -> None:
    _GRAPHS[key] = value
    while len(_GRAPHS) > GRAPH_LAYOUTS:
        _GRAPHS.popitem(last=False)


def _capture(fn, device: torch.device):
    """(graph, fn()'s result) with fn()'s launches captured, not run: on a side stream (capture needs one), this
    thread's capture only (the autograd engine's thread may run it, other threads keep allocating), without the
    synchronize / empty_cache of `torch.cuda.graph` (which would return the caching allocator's blocks mid-step)."""
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, out


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device=device)


@functools.lru_cache(maxsize=16)
def _rows(n: int, device: torch.device) -> torch.Tensor:
    """0..n-1 (int32, as launch orders): Config.order "key", the item rows launched as they are (empty rows are
    already last). Read-only, shared by the plans of one batch layout."""
    return torch.arange(n, dtype=torch.int32, device=device)


if triton is not None:
    @triton.jit
    def _plan_keys(ids_ptr, seq_ptr, gid_ptr, key_ptr, NE, NSEQ, NKB, s0, s1, s2, HKV: tl.constexpr,
                   TOPK: tl.constexpr, BE: tl.constexpr):
        # BE slots (token, head, slot) in flat order: global block (-1: empty or dense-prefix token) and sort key
        # head*NKB + block (HKV*NKB, after every real key, for the -1 slots).
        e = tl.program_id(0) * BE + tl.arange(0, BE)
        ok = e < NE
        t = e // (HKV * TOPK)
        h = (e // TOPK) % HKV
        ids = tl.load(ids_ptr + t.to(tl.int64) * s0 + h * s1 + (e % TOPK) * s2, mask=ok, other=-1).to(tl.int32)
        sq = tl.zeros([BE], tl.int32)
        for s in range(1, NSEQ):  # the last sequence starting at or before the token (empty ones start there too)
            sq += (t >= tl.load(seq_ptr + 3 * s)).to(tl.int32)
        start = tl.load(seq_ptr + 3 * sq, mask=ok, other=0)
        base = tl.load(seq_ptr + 3 * sq + 1, mask=ok, other=0)
        plen = tl.load(seq_ptr + 3 * sq + 2, mask=ok, other=0)
        gid = tl.where((ids >= 0) & (t - start >= plen), ids + base, -1)
        tl.store(gid_ptr + e, gid, mask=ok)
        tl.store(key_ptr + e, tl.where(gid >= 0, h * NKB + gid, HKV * NKB), mask=ok)

    @triton.jit
    def _plan_index(key_ptr, idx_ptr, ent_ptr, pos_ptr, key_item0_ptr, item_key_ptr, lo_ptr, hi_ptr, okey_ptr,
                    order_ptr, NE, STEPS, NK, NMAX, ITEM, HKVTOPK: tl.constexpr, SIZE_ORDER: tl.constexpr,
                    NP: tl.constexpr, BE: tl.constexpr, CH: tl.constexpr):
        # Programs 0..n-2: BE sorted positions each; the last one: the item tables, then (NP > 0) their launch order.
        if tl.program_id(0) < tl.num_programs(0) - 1:
            # Sorted position s -> entry: int32 copy of the sort indices, and the inverse map (slot -> s, -1 for the
            # slots sorted past every real key: empty or dense-prefix).
            s = tl.program_id(0) * BE + tl.arange(0, BE)
            ok = s < NE
            e = tl.load(idx_ptr + s, mask=ok, other=0).to(tl.int32)
            tl.store(ent_ptr + s, e, mask=ok)
            tl.store(pos_ptr + e, tl.where(tl.load(key_ptr + s, mask=ok, other=NK) < NK, s, -1), mask=ok)
        else:
            _plan_items(key_ptr, idx_ptr, key_item0_ptr, item_key_ptr, lo_ptr, hi_ptr, okey_ptr, NE, STEPS, NK, NMAX,
                        ITEM, HKVTOPK, SIZE_ORDER, CH)
            if NP > 0:
                # The launch order: a stable sort of the rows by their keys (the row in the low bits; keys made
                # non-negative, as "size" keys are not and % keeps the sign), in registers.
                tl.debug_barrier()  # the keys were stored by other threads of this program
                i = tl.arange(0, NP)
                okey = tl.load(okey_ptr + i, mask=i < NMAX, other=2147483647).to(tl.int64) + 2147483648
                tl.store(order_ptr + i, (tl.sort(okey * NP + i) % NP).to(tl.int32), mask=i < NMAX)

    @triton.jit
    def _lower_bound(sorted_ptr, n, x, steps):
        # First index i in [0, n] with sorted[i] >= x, per lane (binary search; steps >= bit length of n).
        lo = tl.zeros_like(x)
        hi = tl.zeros_like(x) + n
        for _ in range(steps):
            active = lo < hi
            mid = (lo + hi) // 2
            below = tl.load(sorted_ptr + mid, mask=active, other=0) < x
            lo = tl.where(active & below, mid + 1, lo)
            hi = tl.where(active & ~below, mid, hi)
        return lo

    @triton.jit
    def _plan_items(key_ptr, idx_ptr, key_item0_ptr, item_key_ptr, lo_ptr, hi_ptr, okey_ptr, NE, STEPS, NK, NMAX,
                    ITEM, HKVTOPK: tl.constexpr, SIZE_ORDER: tl.constexpr, CH: tl.constexpr):
        # Keys CH at a time, in order; each key's entries [lo_k, hi_k) become ceil(n / ITEM) items.
        # Every address is written once (rows past the last item get the empty row), so no ordering is needed.
        carry = 0
        for c in range(0, NK, CH):
            k = c + tl.arange(0, CH)
            kok = k < NK
            lo_k = _lower_bound(key_ptr, NE, k, STEPS)
            hi_k = _lower_bound(key_ptr, NE, k + 1, STEPS)
            n = tl.where(kok, (hi_k - lo_k + ITEM - 1) // ITEM, 0)
            first = carry + tl.cumsum(n, 0) - n
            tl.store(key_item0_ptr + k, first, mask=kok)
            for j in range(tl.max(n, 0)):
                m = j < n
                lo = lo_k + j * ITEM
                hi = tl.minimum(lo + ITEM, hi_k)
                if SIZE_ORDER:
                    okey = lo - hi  # largest first
                else:
                    okey = (tl.load(idx_ptr + lo, mask=m, other=0) // HKVTOPK).to(tl.int32)  # first token
                tl.store(item_key_ptr + first + j, k, mask=m)
                tl.store(lo_ptr + first + j, lo, mask=m)
                tl.store(hi_ptr + first + j, hi, mask=m)
                tl.store(okey_ptr + first + j, okey, mask=m)
            carry += tl.sum(n, 0)
        tl.store(key_item0_ptr + NK, carry)
        for c in range(carry, NMAX, CH):
            i = c + tl.arange(0, CH)
            m = i < NMAX
            tl.store(item_key_ptr + i, 0, mask=m)
            tl.store(lo_ptr + i, 0, mask=m)
            tl.store(hi_ptr + i, 0, mask=m)
            tl.store(okey_ptr + i, 2147483647, mask=m)
