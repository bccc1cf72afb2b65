"""MSA training attention, KV-block-outer (issue 18): Triton forward and backward where each program owns a key block.

Same contract as `rl.model.msa.sparse_attention` (q [T, Hq, D], k/v [T, Hkv, D], block_ids [T, Hkv, topk] per-sequence
128-token blocks, -1 = empty, causal inside each packed sequence; validated ids expected).

Why block-outer: the per-token kernels (rl.model.msa_triton) fill 16-row tiles (one token x 16 query heads), a quarter of
a Hopper MMA tile, and add dK/dV atomically. Here the per-token top-k is inverted: every (sparse token, KV head, slot)
selection is an *entry*; entries are grouped by (KV head, key block) (one stable sort) and each group is cut into
*items* of at most `item_tokens` tokens. A program loads one item's K/V block once and walks its entries TM tokens at
a time, i.e. tiles of TM x G rows (G = Hq/Hkv query heads of a token share the KV head's selection), so the MMAs are
64/128 rows tall and never visit a block the token did not select.
- forward: per tile, softmax over this block alone; writes the normalised partial output and its log-sum-exp per
  (entry, query head), in sorted-entry order (a tile's rows are contiguous); `_merge` combines each row's <= topk
  partials (found through `Plan.slot_pos`, as split-KV decoding does) into O and the LSE;
- backward: per tile, P from the final LSE, dV += P^T dO, dK += dS^T Q in registers; dQ of the tile (dS K) is a
  partial per entry (summed per row by `_reduce_dq`) or an fp32 atomic add (`dq="atomic"`). An item stores its
  dK/dV sums to scratch and `_reduce_dkdv` adds a block's items in order: one owner, no atomics, deterministic.
- dense prefix: a query at position < topk*128 sees at most topk blocks and (validated ids) selects all of them, so
  its attention is plain causal attention over its sequence's prefix: those tokens go through SDPA (FlashAttention)
  when the prefix has >= `dense_prefix_min` tokens, and the kernels skip them.
Operands bf16, accumulation fp32, P and dS rounded to the operand type before their MMAs (as FlashAttention and
rl.model.msa_triton do); partials stored in `part_dtype`. Work items run largest first (LPT) for balance, or by token.
On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1; tests only).

The plan (`build_plan`) never waits for the device: the grid is a host-computed bound on the number of items, the
tail of the item tables is empty rows, launched last, whose programs do no work.

Measured on one H200 (results/gpu/run14c, issue18_targets.json; 64 q / 4 KV heads, d 128, top-16, bf16): fwd 10.3 ms,
fwd+bwd 27.7 ms at 32K tokens (per-token kernels 99 ms, dense causal SDPA 114 ms), 55.9 ms at 64K (SDPA 449 ms);
faster than SDPA from 8K tokens (single sequence), 1.5x slower at 4K. At 32K the block kernels take 21.6 ms (about
half their ceilings), the merge and dQ sum 4.7 ms (at bandwidth: the cost of the partials), the plan 0.26 ms of GPU
time; measured minus kernels is 0.6 ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from m3.ops import MSA_BLOCK as BLOCK  # keys per program
from rl.model.packed import seq_bounds


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
    bwd_stages: int = 2
    part_dtype: str = "bf16"  # storage of partial outputs / dQ partials: "bf16" or "fp32"
    dq: str = "partial"  # "partial" (per-entry partials, then a sum) or "atomic" (fp32 atomic adds)
    item_tokens: int = 512  # entries per work item
    # Prefix tokens per sequence from which SDPA takes the dense prefix; 0 = never. Off: the kernels take those
    # tokens for less than SDPA plus gathering them (run12 sweep: 33.6 vs 34.9 ms at 32K, 5.1 vs 5.5 ms at 4K).
    dense_prefix_min: int = 0
    row_tile: int = 128  # rows per program of the row-wise kernels (merge, delta, dQ sum)
    order: str = "token"  # launch order of work items: "size" (largest first) or "token" (by first token: programs
    # running together read the same tokens' q/dO, which may then come from L2)


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
    order: torch.Tensor  # [n_max] int64 launch order (Config.order), empty rows last
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


def _host_tables(bounds, topk: int, config: Config):
    """Per-sequence and per-block tables from the (host) sequence bounds, in plain Python: [start, base, plen] per
    sequence, [kstart], [kend] per global block, the dense prefixes and the block count."""
    seq, kstart, kend, prefixes, nkb = [], [], [], [], 0
    for s, e in bounds:
        nblk = (e - s + BLOCK - 1) // BLOCK
        # Dense prefixes: positions < topk*128 select every visible block, i.e. causal attention over the prefix.
        plen = min(e - s, topk * BLOCK)
        plen = plen if config.dense_prefix_min > 0 and plen >= config.dense_prefix_min else 0
        seq.append((s, nkb, plen))
        kstart += range(s, s + BLOCK * nblk, BLOCK)
        kend += [e] * nblk
        if plen:
            prefixes.append((s, plen))
        nkb += nblk
    return seq, kstart, kend, prefixes, nkb


def build_plan(block_ids: torch.Tensor, cu_seqlens, config: Config = DEFAULT) -> Plan:
    """The inverted lists, with no device->host sync (the plan is built inside every attention call; a sync there
    drains the launch queue of the whole layer): host tables in Python, copied in one transfer; then, with Triton,
    two kernels around one stable sort of the entries and one sort of the items (`_plan_keys`, `_plan_items`), and
    without Triton (CPU) the same tables from torch ops (`_plan_torch`)."""
    device = block_ids.device
    t_count, hkv, topk = block_ids.shape
    bounds = seq_bounds(cu_seqlens)
    seq, kstart, kend, prefixes, nkb = _host_tables(bounds, topk, config)
    nseq, ne = len(seq), t_count * hkv * topk
    n_max = hkv * nkb + -(-ne // config.item_tokens)  # each key adds < 1 item to its share of ceil(NE / item_tokens)
    host = torch.tensor([x for row in seq for x in row] + kstart + kend, dtype=torch.int32).to(device)
    seq_d, kstart_d, kend_d = host.split([3 * nseq, nkb, nkb])
    if triton is not None:
        tables = _plan_triton(block_ids, seq_d, nseq, nkb, n_max, config)
    else:
        tables = _plan_torch(block_ids, seq_d, nseq, nkb, n_max, config)
    gid, pos, entries, item_key, lo, hi, order, key_item0 = tables
    dense_row, dense_idx = None, torch.empty(0, dtype=torch.int64, device=device)
    if prefixes:
        dense_idx = torch.cat([torch.arange(s, s + p) for s, p in prefixes]).to(device)
        dense_row = torch.full((t_count,), -1, dtype=torch.int32, device=device)
        dense_row[dense_idx] = torch.arange(len(dense_idx), dtype=torch.int32, device=device)
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
    order = torch.sort(pad(okey, _EMPTY_KEY), stable=True).indices
    return (gid.to(torch.int32).contiguous(), pos.view(gid.shape), entries.to(torch.int32), pad(item_key, 0),
            pad(lo, 0), pad(hi, 0), order, key_item0.to(torch.int32))


def _plan_triton(block_ids, seq_d, nseq, nkb, n_max, config):
    """`build_plan`'s device tables: `_plan_keys` (slot -> global block and sort key), a stable sort of the keys,
    `_plan_items` (one program: per-key bounds by binary search, item rows, launch-order keys), a sort of those."""
    device = block_ids.device
    t_count, hkv, topk = block_ids.shape
    ne = t_count * hkv * topk
    gid = torch.empty(t_count, hkv, topk, dtype=torch.int32, device=device)
    key = torch.empty(ne, dtype=torch.int32, device=device)
    if ne:
        _plan_keys[(triton.cdiv(ne, 1024),)](block_ids, seq_d, gid, key, ne, nseq, nkb, *block_ids.stride(),
                                             HKV=hkv, TOPK=topk, BE=1024)
    key, idx = torch.sort(key, stable=True)  # by token inside a key
    # int32 entries (int64 ones cost the backward kernel register spills) and each slot's sorted position
    entries = torch.empty(ne, dtype=torch.int32, device=device)
    pos = torch.empty(t_count, hkv, topk, dtype=torch.int32, device=device)
    if ne:
        _plan_pos[(triton.cdiv(ne, 1024),)](key, idx, entries, pos, ne, hkv * nkb, BE=1024)
    tabs = torch.empty(4 * n_max + hkv * nkb + 1, dtype=torch.int32, device=device)
    item_key, lo, hi, okey, key_item0 = tabs.split([n_max] * 4 + [hkv * nkb + 1])
    _plan_items[(1,)](key, entries, key_item0, item_key, lo, hi, okey, ne, max(ne, 1).bit_length(), hkv * nkb, n_max,
                      config.item_tokens, HKVTOPK=hkv * topk, SIZE_ORDER=config.order == "size", CH=1024)
    return gid, pos, entries, item_key, lo, hi, torch.sort(okey, stable=True).indices, key_item0


try:  # module-level jit functions: Triton's interpreter resolves callees from module globals
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: only the reference paths
    triton = None

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
    def _plan_pos(key_ptr, idx_ptr, ent_ptr, pos_ptr, NE, BIG, BE: tl.constexpr):
        # Sorted position s -> entry: int32 copy of the sort indices, and the inverse map (slot -> s, -1 for the slots
        # sorted past every real key: empty or dense-prefix).
        s = tl.program_id(0) * BE + tl.arange(0, BE)
        ok = s < NE
        e = tl.load(idx_ptr + s, mask=ok, other=0).to(tl.int32)
        tl.store(ent_ptr + s, e, mask=ok)
        tl.store(pos_ptr + e, tl.where(tl.load(key_ptr + s, mask=ok, other=BIG) < BIG, s, -1), mask=ok)

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
    def _plan_items(key_ptr, ent_ptr, key_item0_ptr, item_key_ptr, lo_ptr, hi_ptr, okey_ptr, NE, STEPS, NK, NMAX,
                    ITEM, HKVTOPK: tl.constexpr, SIZE_ORDER: tl.constexpr, CH: tl.constexpr):
        # One program: keys CH at a time, in order; each key's entries [lo_k, hi_k) become ceil(n / ITEM) items.
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
                    okey = (tl.load(ent_ptr + lo, mask=m, other=0) // HKVTOPK).to(tl.int32)  # first token
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

    @triton.jit
    def _tile(ent_ptr, base, hi, h, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, TOPK: tl.constexpr,
              TM: tl.constexpr, BM: tl.constexpr):
        # Rows of the tile at entries [base, base+TM): row r = entry base + r//G, query head h*G + r%G.
        r = tl.arange(0, BM)
        slot = base + r // G
        ok = (r < TM * G) & (slot < hi)
        e = tl.load(ent_ptr + slot, mask=ok, other=0)
        tok = e // (HKV * TOPK)
        qrow = tok * HQ + h * G + r % G  # row of q / o / lse (token, query head)
        # Partials are stored by sorted position: the tile's rows are the contiguous rows [base*G, base*G + BM) (a
        # scalar base and small offsets: per-row 64-bit addresses cost the backward kernel 160 B/thread of spills).
        return ok, tok, qrow, r

    @triton.jit
    def _item(item_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, k_ptr, v_ptr, T, NKB, key0,
              HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
        # The launched item, its KV head, and the K/V rows [BN, D] it owns (BN keys from key0 inside the block).
        # An empty row of the item tables (lo == hi, past the real items) loops zero times; its K/V loads and (backward)
        # zero dK/dV stores go unmasked, to scratch nothing reads: masking them cost the backward kernel register
        # spills (224 -> 464 B per thread, Triton 3.6, sm_90).
        it = tl.load(item_ptr + tl.program_id(0)).to(tl.int32)  # int64 sort indices
        key = tl.load(key_ptr + it)
        lo = tl.load(lo_ptr + it)
        hi = tl.load(hi_ptr + it)
        h = key // NKB
        kidx = tl.load(kstart_ptr + key - h * NKB) + key0 + tl.arange(0, BN)
        rows = (kidx[:, None] * HKV + h) * D + tl.arange(0, D)[None, :]
        kt = tl.load(k_ptr + rows, mask=(kidx < T)[:, None], other=0.0)
        vt = tl.load(v_ptr + rows, mask=(kidx < T)[:, None], other=0.0)
        return it, h, lo, hi, kidx, kt, vt

    @triton.jit
    def _fwd(q_ptr, k_ptr, v_ptr, opart_ptr, lpart_ptr, ent_ptr, order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr,
             T, NKB, qk_scale, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, TOPK: tl.constexpr,
             TM: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
        it, h, lo, hi, kidx, kt, vt = _item(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, k_ptr, v_ptr, T, NKB, 0,
                                            HKV, D, 128)
        d = tl.arange(0, D)
        for base in range(lo, hi, TM):
            ok, tok, qrow, r = _tile(ent_ptr, base, hi, h, HQ, HKV, G, TOPK, TM, BM)
            q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale  # log2 units
            s = tl.where(kidx[None, :] <= tok[:, None], s, float("-inf"))
            m = tl.max(s, 1)
            m = tl.where(m == float("-inf"), 0.0, m)  # padding rows only: a selected block has a visible key
            p = tl.exp2(s - m[:, None])
            l = tl.sum(p, 1)
            o = tl.dot(p.to(vt.dtype), vt, input_precision=PREC) / tl.where(l > 0, l, 1.0)[:, None]
            prow0 = tl.cast(base, tl.int64) * G  # base: a Python int under the interpreter
            tl.store(opart_ptr + prow0 * D + r[:, None] * D + d[None, :], o.to(opart_ptr.dtype.element_ty),
                     mask=ok[:, None])
            tl.store(lpart_ptr + prow0 + r, m + tl.log2(l), mask=ok)

    @triton.jit
    def _rows(NROWS, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, R: tl.constexpr):
        # R consecutive (token, query head) rows of o / q: row index, its token, KV head, head inside the group.
        row = tl.program_id(0) * R + tl.arange(0, R)
        ok = row < NROWS
        row = tl.where(ok, row, 0)
        head = row % HQ
        return row, ok, row // HQ, head // G, head % G

    @triton.jit
    def _merge(opart_ptr, lpart_ptr, pos_ptr, dense_row_ptr, dense_ptr, o_ptr, lse_ptr, NROWS, HQ: tl.constexpr,
               HKV: tl.constexpr, G: tl.constexpr, TOPK: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
               HAS_DENSE: tl.constexpr):
        # O and LSE (log2 units) of R rows from their slots' partials; dense-prefix rows copy the SDPA output.
        row, ok, t, hk, g = _rows(NROWS, HQ, HKV, G, R)
        d = tl.arange(0, D)
        m = tl.full([R], float("-inf"), tl.float32)
        l = tl.zeros([R], tl.float32)
        acc = tl.zeros([R, D], tl.float32)
        for j in range(TOPK):
            pos = tl.load(pos_ptr + (t * HKV + hk) * TOPK + j, mask=ok, other=-1)  # sorted position of the slot
            used = pos >= 0
            prow = pos.to(tl.int64) * G + g
            lj = tl.load(lpart_ptr + prow, mask=used, other=float("-inf"))
            oj = tl.load(opart_ptr + prow[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
            m_new = tl.maximum(m, lj)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lj - m_safe)
            l = l * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * oj.to(tl.float32)
            m = m_new
        has = l > 0
        out = acc / tl.where(has, l, 1.0)[:, None]
        if HAS_DENSE:
            drow = tl.load(dense_row_ptr + t, mask=ok, other=-1)
            dense = drow >= 0  # such rows have no slots (l == 0)
            x = tl.load(dense_ptr + (drow.to(tl.int64) * HQ + row % HQ)[:, None] * D + d[None, :],
                        mask=dense[:, None], other=0.0)
            out = tl.where(dense[:, None], x.to(tl.float32), out)
        tl.store(o_ptr + row.to(tl.int64)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=ok[:, None])
        tl.store(lse_ptr + row, tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("inf")), mask=ok)

    @triton.jit
    def _delta(o_ptr, do_ptr, delta_ptr, NROWS, D: tl.constexpr, R: tl.constexpr):
        # delta = rowsum(dO * O) in fp32.
        row = tl.program_id(0) * R + tl.arange(0, R)
        ok = row < NROWS
        offs = row.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
        o = tl.load(o_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        do = tl.load(do_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        tl.store(delta_ptr + row, tl.sum(o * do, 1), mask=ok)

    @triton.jit
    def _bwd(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dks_ptr, dvs_ptr, ent_ptr, order_ptr, key_ptr,
             lo_ptr, hi_ptr, kstart_ptr, T, NKB, NE, qk_scale, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
             TOPK: tl.constexpr, TM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
             PREC: tl.constexpr, DQ_ATOMIC: tl.constexpr):
        half = tl.program_id(1)  # which BN keys of the 128-key block
        it, h, lo, hi, kidx, kt, vt = _item(order_ptr, key_ptr, lo_ptr, hi_ptr, kstart_ptr, k_ptr, v_ptr, T, NKB,
                                            half * BN, HKV, D, BN)
        d = tl.arange(0, D)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        for base in range(lo, hi, TM):
            ok, tok, qrow, r = _tile(ent_ptr, base, hi, h, HQ, HKV, G, TOPK, TM, BM)
            q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            do = tl.load(do_ptr + qrow[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + qrow, mask=ok, other=float("inf"))
            delta = tl.load(delta_ptr + qrow, mask=ok, other=0.0)
            # Transposed tiles [keys, rows], as the key block is the fixed operand.
            st = tl.dot(kt, tl.trans(q), input_precision=PREC) * qk_scale
            pt = tl.where((kidx[:, None] <= tok[None, :]) & ok[None, :], tl.exp2(st - lse[None, :]), 0.0)
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PREC)
            dpt = tl.dot(vt, tl.trans(do), input_precision=PREC)
            dst = (pt * (dpt - delta[None, :])).to(q.dtype)
            dk = tl.dot(dst, q, dk, input_precision=PREC)
            dq = tl.dot(tl.trans(dst), kt, input_precision=PREC)  # [rows, D], unscaled
            if DQ_ATOMIC:
                tl.atomic_add(dq_ptr + qrow[:, None] * D + d[None, :], dq, mask=ok[:, None], sem="relaxed")
            else:
                tile = dq_ptr + tl.cast(half * NE + base, tl.int64) * (G * D)
                tl.store(tile + r[:, None] * D + d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=ok[:, None])
        srow = (it.to(tl.int64) * 128 + half * BN + tl.arange(0, BN))[:, None] * D + d[None, :]
        tl.store(dks_ptr + srow, dk)
        tl.store(dvs_ptr + srow, dv)

    @triton.jit
    def _reduce_dq(dqp_ptr, pos_ptr, dq_ptr, NROWS, NE, scale, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                   TOPK: tl.constexpr, D: tl.constexpr, NH: tl.constexpr, R: tl.constexpr):
        # dQ of R rows: scale * the sum of their slots' partials (zeros for dense-prefix rows: no slots).
        row, ok, t, hk, g = _rows(NROWS, HQ, HKV, G, R)
        d = tl.arange(0, D)
        acc = tl.zeros([R, D], tl.float32)
        for j in range(TOPK):
            pos = tl.load(pos_ptr + (t * HKV + hk) * TOPK + j, mask=ok, other=-1)
            used = pos >= 0
            for half in range(NH):
                prow = (half * NE + pos.to(tl.int64)) * G + g
                acc += tl.load(dqp_ptr + prow[:, None] * D + d[None, :], mask=used[:, None], other=0.0).to(tl.float32)
        tl.store(dq_ptr + row.to(tl.int64)[:, None] * D + d[None, :], (acc * scale).to(dq_ptr.dtype.element_ty),
                 mask=ok[:, None])

    @triton.jit
    def _reduce_dkdv(dks_ptr, dvs_ptr, key_item0_ptr, kstart_ptr, kend_ptr, dk_ptr, dv_ptr, NKB, scale,
                     HKV: tl.constexpr, D: tl.constexpr):
        # dK/dV of one (KV head, key block): its items' sums in item order; zeros for a block nobody selected.
        key = tl.program_id(0)
        h = key // NKB
        kb = key - h * NKB
        r = tl.arange(0, 128)
        d = tl.arange(0, D)
        ak = tl.zeros([128, D], tl.float32)
        av = tl.zeros([128, D], tl.float32)
        for it in range(tl.load(key_item0_ptr + key), tl.load(key_item0_ptr + key + 1)):
            srow = (it * 128 + r).to(tl.int64)[:, None] * D + d[None, :]  # it: an int under the interpreter
            ak += tl.load(dks_ptr + srow)
            av += tl.load(dvs_ptr + srow)
        kidx = tl.load(kstart_ptr + kb) + r
        ok = (kidx < tl.load(kend_ptr + kb))[:, None]
        rows = (kidx[:, None] * HKV + h) * D + d[None, :]
        tl.store(dk_ptr + rows, (ak * scale).to(dk_ptr.dtype.element_ty), mask=ok)
        tl.store(dv_ptr + rows, av.to(dv_ptr.dtype.element_ty), mask=ok)


def _p2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _tokens(rows: int, g: int) -> int:
    return max(1, rows // g)


def _part_dtype(q, config):
    return torch.float32 if q.dtype == torch.float32 or config.part_dtype == "fp32" else q.dtype


class _BlockOuter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dense_out, plan: Plan, scale: float, config: Config):  # noqa: D102
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        t_count, hq, dim = q.shape
        hkv, topk = k.shape[1], plan.slot_gid.shape[2]
        g = hq // hkv
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        ne = t_count * hkv * topk
        opart = torch.empty(ne * g, dim, dtype=_part_dtype(q, config), device=q.device)
        lpart = torch.empty(ne * g, dtype=torch.float32, device=q.device)
        o = torch.empty_like(q)
        lse = torch.empty(t_count, hq, dtype=torch.float32, device=q.device)
        qk_scale = scale * math.log2(math.e)
        tm = _tokens(config.fwd_rows, g)
        if plan.n_max:
            _fwd[(plan.n_max,)](
                q, k, v, opart, lpart, plan.entries, plan.order, plan.item_key, plan.item_lo, plan.item_hi,
                plan.kstart, t_count, plan.nkb, qk_scale, HQ=hq, HKV=hkv, G=g, TOPK=topk, TM=tm, BM=_p2(tm * g), D=dim,
                PREC=prec, num_warps=config.fwd_warps, num_stages=config.fwd_stages)
        has_dense = dense_out is not None
        dense = dense_out.contiguous() if has_dense else o
        dense_row = plan.dense_row if has_dense else plan.slot_pos  # not read without a dense prefix
        rows, r = t_count * hq, config.row_tile
        if t_count:
            _merge[(triton.cdiv(rows, r),)](opart, lpart, plan.slot_pos, dense_row, dense, o, lse, rows, HQ=hq,
                                            HKV=hkv, G=g, TOPK=topk, D=dim, R=r, HAS_DENSE=has_dense)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.scale, ctx.config, ctx.has_dense = plan, scale, config, dense_out is not None
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        q, k, v, o, lse = ctx.saved_tensors
        plan, scale, config = ctx.plan, ctx.scale, ctx.config
        do = do.contiguous().to(q.dtype)
        t_count, hq, dim = q.shape
        hkv, topk = k.shape[1], plan.slot_gid.shape[2]
        g = hq // hkv
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        ne, ni = t_count * hkv * topk, plan.n_max
        bn = config.bwd_keys
        nh = BLOCK // bn
        delta = torch.empty(t_count, hq, dtype=torch.float32, device=q.device)
        rows, r = t_count * hq, config.row_tile
        if t_count:
            _delta[(triton.cdiv(rows, r),)](o, do, delta, rows, D=dim, R=r)
        atomic = config.dq == "atomic"
        dq_buf = (torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else
                  torch.empty(nh * ne * g, dim, dtype=_part_dtype(q, config), device=q.device))
        dks = torch.empty(ni * BLOCK, dim, dtype=torch.float32, device=q.device)
        dvs = torch.empty_like(dks)
        if ni:
            _bwd[(ni, nh)](q, k, v, do, lse, delta, dq_buf, dks, dvs, plan.entries, plan.order, plan.item_key,
                           plan.item_lo, plan.item_hi, plan.kstart, t_count, plan.nkb, ne, scale * math.log2(math.e),
                           HQ=hq, HKV=hkv, G=g, TOPK=topk, TM=_tokens(config.bwd_rows, g),
                           BM=_p2(_tokens(config.bwd_rows, g) * g),
                           BN=bn, D=dim, PREC=prec, DQ_ATOMIC=atomic, num_warps=config.bwd_warps,
                           num_stages=config.bwd_stages)
        if atomic:
            dq = (dq_buf * scale).to(q.dtype)
        else:
            dq = torch.empty_like(q)
            if t_count:
                _reduce_dq[(triton.cdiv(rows, r),)](dq_buf, plan.slot_pos, dq, rows, ne, scale, HQ=hq, HKV=hkv, G=g,
                                                    TOPK=topk, D=dim, NH=nh, R=r)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        if plan.nkb:
            _reduce_dkdv[(hkv * plan.nkb,)](dks, dvs, plan.key_item0, plan.kstart, plan.kend, dk, dv, plan.nkb,
                                            scale, HKV=hkv, D=dim)
        d_dense = do.index_select(0, plan.dense_idx) if ctx.has_dense else None
        return dq, dk, dv, d_dense, None, None, None


def _causal_sdpa(q, k, v, spans, scale: float):
    """Causal attention of each span [(start, length)] of q/k/v rows (SDPA; FlashAttention on CUDA), concatenated."""
    outs = []
    for start, length in spans:
        qs, ks, vs = (x[start:start + length].transpose(0, 1)[None] for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=qs.shape[1] != ks.shape[1])[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_empty(0, *q.shape[1:])


def _dense_prefix(q, k, v, plan: Plan, scale: float):
    """The dense prefixes' attention, rows in `plan.dense_idx` order."""
    if not plan.prefixes:
        return None
    qp, kp, vp = (x.index_select(0, plan.dense_idx) for x in (q, k, v))  # one gather: its backward is one scatter
    offsets = torch.tensor([0] + [n for _, n in plan.prefixes]).cumsum(0).tolist()
    return _causal_sdpa(qp, kp, vp, [(o, n) for o, (_, n) in zip(offsets, plan.prefixes)], scale)


def sparse_attention(q, k, v, block_ids, cu_seqlens, scale: float, config: Config = DEFAULT) -> torch.Tensor:
    """`rl.model.msa.sparse_attention` semantics (validated ids expected); differentiable in q, k, v."""
    bounds = seq_bounds(cu_seqlens)
    if all(e - s <= block_ids.shape[2] * BLOCK for s, e in bounds):
        # Every query sees at most topk blocks and selects them all: the batch is plain causal attention per
        # sequence, no kernels (packed batches of short sequences run as fast as dense, being dense)
        return _causal_sdpa(q, k, v, [(s, e - s) for s, e in bounds if e > s], scale)
    if triton is None:
        raise RuntimeError("rl.model.msa_block_outer needs Triton (CUDA, or TRITON_INTERPRET=1 for tests)")
    plan = build_plan(block_ids, cu_seqlens, config)
    dense_out = _dense_prefix(q, k, v, plan, scale)
    return _BlockOuter.apply(q, k, v, dense_out, plan, scale, config)
