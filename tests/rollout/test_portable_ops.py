"""portable_ops against straightforward per-query loops written from the kernels' contracts (vLLM Triton/CUDA).

The engine test covers these ops end to end against transformers; this covers what transformers cannot: init
blocks, -1 padding, padded cache slots, GQA groups > 1."""

import math

import pytest
import torch

from rollout.plugin import portable_ops as P

B = P.MSA_BLOCK


def naive_topk(q, keys, pos, topk, init, local):
    """Per (head, query): block score = max_{p in block, p<=pos} q.k; force init then local; sort; -1 pad."""
    heads = q.shape[1]
    out = torch.full((heads, len(pos), topk), -1, dtype=torch.int32)
    for h in range(heads):
        for t, p in enumerate(pos.tolist()):
            valid = p // B + 1
            scores = {}
            for b in range(valid):
                s = max(float(q[t, h].float() @ keys[k].float()) for k in range(b * B, min((b + 1) * B, p + 1)))
                if b < init:
                    s = 1e30
                if b >= valid - local:
                    s = 1e29
                scores[b] = s
            best = sorted(scores, key=lambda b: -scores[b])[:topk]
            out[h, t, : len(best)] = torch.tensor(best, dtype=torch.int32)
    return out


@pytest.mark.parametrize("init,local,topk", [(0, 1, 2), (1, 1, 3), (2, 1, 2), (0, 2, 4)])
def test_index_block_topk_matches_per_query_loop(init, local, topk):
    g = torch.Generator().manual_seed(init * 10 + local)
    length, heads, d = 5 * B + 17, 2, 16
    keys = torch.randn(length, d, generator=g).bfloat16()
    pos = torch.tensor([0, 5, B - 1, B, 2 * B + 3, 3 * B + 64, length - 1])
    q = torch.randn(len(pos), heads, d, generator=g).bfloat16()
    got = P.index_block_topk(q, keys, pos, topk, init, local)
    want = naive_topk(q, keys, pos, topk, init, local)
    for h in range(heads):
        for t in range(len(pos)):  # the order among forced (equal-score) blocks is not part of the contract
            assert set(got[h, t].tolist()) == set(want[h, t].tolist()), (h, t, got[h, t], want[h, t])
    assert (got[:, 0, 1:] == -1).all()  # position 0 sees one block: the rest is -1 padding


def test_block_sparse_attention_matches_per_query_loop():
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, length = 4, 2, 8, 3 * B + 10
    keys, values = torch.randn(2, hkv, length, d, generator=g)
    pos = torch.tensor([3, B + 7, length - 1])
    q = torch.randn(len(pos), hq, d, generator=g)
    ids = torch.tensor([[[0, -1], [1, 0], [3, 1]], [[0, -1], [0, -1], [3, 2]]], dtype=torch.int32)
    got = P.block_sparse_attention(q, keys, values, ids, pos, scale=d ** -0.5)
    for t, p in enumerate(pos.tolist()):
        for h in range(hq):
            kv = h // (hq // hkv)
            allowed = [k for b in ids[kv, t].tolist() if b >= 0 for k in range(b * B, min((b + 1) * B, p + 1))]
            s = torch.stack([q[t, h] @ keys[kv, k] for k in allowed]) * d ** -0.5
            want = torch.softmax(s, 0) @ values[kv, allowed]
            torch.testing.assert_close(got[t, h], want, rtol=1e-5, atol=1e-6)


def test_qknorm_rope_insert_writes_caches_and_skips_padding_slots(monkeypatch):
    monkeypatch.setitem(P.NVFP4_EMULATION, "kv", False)  # an engine built earlier in this process may have set it
    monkeypatch.setitem(P.NVFP4_EMULATION, "index_k", False)
    torch.manual_seed(0)
    n, nh, nkv, hd, rot = 3, 2, 1, 128, 64
    qkv = torch.randn(n, (nh + 2 * nkv + 1 + 1) * hd)  # one index head + the shared index key
    w = [torch.randn(hd) * 0.1 for _ in range(4)]
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    ang = torch.arange(16).float()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1)
    positions = torch.tensor([4, 5, 6])
    kv_cache = torch.zeros(2, nkv, B, 2 * hd)
    index_cache = torch.zeros(2, B, hd, dtype=torch.bfloat16)
    slots = torch.tensor([B + 1, -1, 3])
    q_out = torch.empty(n, nh * hd)
    iq_out = torch.empty(n, hd, dtype=torch.bfloat16)
    original = qkv.clone()
    P.qknorm_rope_kv_insert(qkv, w[0], w[1], cos_sin, positions, nh, nkv, rot, 1e-6, w[2], w[3], 1, slots, None,
                            kv_cache, index_cache, B, q_out, iq_out)

    def norm_rope(x, weight):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight)
        c, s = cos_sin[positions, None, : rot // 2], cos_sin[positions, None, rot // 2:]
        x1, x2 = x[..., : rot // 2], x[..., rot // 2: rot]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot:]], -1)

    heads = original.view(n, -1, hd)
    torch.testing.assert_close(q_out.view(n, nh, hd), norm_rope(heads[:, :nh], w[0]))
    k = norm_rope(heads[:, nh:nh + 1], w[1])[:, 0]
    ik = norm_rope(heads[:, -1:], w[3])[:, 0]
    torch.testing.assert_close(iq_out.float(), norm_rope(heads[:, -2:-1], w[2])[:, 0].bfloat16().float())
    torch.testing.assert_close(kv_cache[1, 0, 1, :hd], k[0])
    torch.testing.assert_close(kv_cache[1, 0, 1, hd:], heads[0, nh + 1])
    torch.testing.assert_close(kv_cache[0, 0, 3, :hd], k[2])
    torch.testing.assert_close(index_cache[0, 3].float(), ik[2].bfloat16().float())
    assert kv_cache.count_nonzero() == 2 * 2 * hd and index_cache.count_nonzero() == 2 * hd  # slot -1 skipped


def test_sigmoid_bias_topk_selects_by_biased_score_weights_by_unbiased():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    bias = torch.tensor([3.0, 0.0, 0.0, 0.0])
    w, ids = P.sigmoid_bias_topk(logits, 2, bias, routed_scaling_factor=2.0)
    assert set(ids[0].tolist()) == {0, 2}
    s = torch.sigmoid(logits[0])
    expected = {0: s[0] / (s[0] + s[2]) * 2, 2: s[2] / (s[0] + s[2]) * 2}
    for weight, i in zip(w[0].tolist(), ids[0].tolist()):
        assert math.isclose(weight, float(expected[i]), rel_tol=1e-6)


def test_swigluoai_uninterleave_clamps_gate_above_and_up_both_ways():
    x = torch.tensor([[10.0, -10.0, 10.0, -10.0]])  # gate [10, -10], up [10, -10]
    y = P.swigluoai_uninterleave(x, alpha=1.702, limit=7.0, beta=1.0)
    g = torch.tensor([7.0, -10.0])
    u = torch.tensor([7.0, -7.0])
    torch.testing.assert_close(y[0], g * torch.sigmoid(1.702 * g) * (u + 1))


def test_batched_decode_matches_per_request():
    """The decode path (all requests' tokens in one call, keys gathered from a paged cache with NaN in the unused
    slots) gives exactly the per-request results, for requests of different lengths across several blocks."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([3 * B + 5, 40, 2 * B])
    hkv, group, d, idim = 2, 3, 16, 8
    blocks = 12
    kv_cache = torch.full((blocks, B, hkv, 2 * d), float("nan"))
    index_cache = torch.full((blocks, B, idim), float("nan"))
    table = torch.tensor([[4, 0, 7, 9], [2, 11, 11, 11], [5, 1, 11, 11]])
    for r, n in enumerate(lengths.tolist()):
        rows = torch.randn(n, hkv, 2 * d, generator=g)
        irows = torch.randn(n, idim, generator=g)
        for p in range(n):
            kv_cache[table[r, p // B], p % B] = rows[p]
            index_cache[table[r, p // B], p % B] = irows[p]
    positions = lengths - 1
    q = torch.randn(3, hkv * group, d, generator=g)
    iq = torch.randn(3, 2, idim, generator=g)
    kv = P.gather_batch_rows(kv_cache, table, lengths).transpose(1, 2)  # [T, Hkv, L, 2d]
    ikeys = P.gather_batch_rows(index_cache, table, lengths)
    assert torch.isfinite(kv).all() and torch.isfinite(ikeys).all()
    ids = P.index_block_topk(iq, ikeys, positions, 3, 1, 1)
    out = P.block_sparse_attention(q, kv[..., :d], kv[..., d:], ids[:hkv], positions, 0.25)
    for r, n in enumerate(lengths.tolist()):
        keys_r = P.gather_request_rows(index_cache, table[r], n)
        ids_r = P.index_block_topk(iq[r:r + 1], keys_r, positions[r:r + 1], 3, 1, 1)
        assert torch.equal(ids[:, r:r + 1], ids_r)
        kv_r = P.gather_request_rows(kv_cache, table[r], n).transpose(0, 1)
        out_r = P.block_sparse_attention(q[r:r + 1], kv_r[..., :d], kv_r[..., d:], ids_r[:hkv], positions[r:r + 1],
                                         0.25)
        torch.testing.assert_close(out[r:r + 1], out_r, rtol=1e-6, atol=1e-6)
