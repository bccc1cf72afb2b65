"""Rollouts -> the packed trainer batch: sequences concatenated without padding (MSA blocks are per sequence)."""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] prompt + response[:-1] of every sequence, concatenated
    targets: torch.Tensor  # [T] the next token at each position
    cu_seqlens: torch.Tensor  # [B+1]
    response_mask: torch.Tensor  # [T] True where the target is a response token
    rollout_logprobs: torch.Tensor  # [T] the engine's logprob of each response target (0 elsewhere)
    routing: np.ndarray | None  # [T, layers, topk] engine routing (rows = fed tokens)
    blocks: np.ndarray | None  # [T, sparse layers, kv heads, topk]

    def to_matrix(self, values: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position values [T] -> ([B, L] response-token values, [B, L] mask), for verl's [B, L] losses; L is the
        longest response, or `width` (a micro-batch padded as its whole batch: losses that divide by L agree)."""
        rows, masks = [], []
        for s, e in zip(self.cu_seqlens[:-1].tolist(), self.cu_seqlens[1:].tolist()):
            m = self.response_mask[s:e]
            rows.append(values[s:e][m])
            masks.append(torch.ones(int(m.sum()), dtype=torch.bool))
        vals = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
        if width is None or width == vals.shape[1]:
            return vals, mask
        if width < vals.shape[1]:
            raise ValueError(f"to_matrix: width {width} < the longest response ({vals.shape[1]} tokens)")
        wide = vals.new_zeros(vals.shape[0], width), mask.new_zeros(mask.shape[0], width)
        wide[0][:, :vals.shape[1]], wide[1][:, :mask.shape[1]] = vals, mask
        return wide

    def select(self, a: int, b: int) -> "PackedBatch":
        """Sequences a..b-1 as a batch of their own (a micro-batch)."""
        cu = self.cu_seqlens[a:b + 1]
        s, e = int(cu[0]), int(cu[-1])
        return PackedBatch(self.input_ids[s:e], self.targets[s:e], cu - s, self.response_mask[s:e],
                           self.rollout_logprobs[s:e], None if self.routing is None else self.routing[s:e],
                           None if self.blocks is None else self.blocks[s:e])


def pack_rollouts(rollouts) -> PackedBatch:
    ids, targets, mask, lps, cu, routing, blocks = [], [], [], [], [0], [], []
    for r in rollouts:
        seq = r.prompt_ids + r.token_ids
        n_prompt = len(r.prompt_ids)
        ids.append(torch.tensor(seq[:-1]))
        targets.append(torch.tensor(seq[1:]))
        m = torch.zeros(len(seq) - 1, dtype=torch.bool)
        m[n_prompt - 1:] = True
        mask.append(m)
        lp = torch.zeros(len(seq) - 1)
        lp[n_prompt - 1:] = torch.from_numpy(np.asarray(r.logprobs, dtype=np.float32))
        lps.append(lp)
        cu.append(cu[-1] + len(seq) - 1)
        routing.append(r.routed_experts)
        blocks.append(r.block_ids)
    return PackedBatch(torch.cat(ids), torch.cat(targets), torch.tensor(cu), torch.cat(mask), torch.cat(lps),
                       _concat("routing", routing), _concat("blocks", blocks))


def _concat(what: str, arrays: list) -> np.ndarray | None:
    """The rollouts' captures as one array; None only when no rollout has one (capture off), never for some."""
    missing = [i for i, a in enumerate(arrays) if a is None]
    if len(missing) == len(arrays):
        return None
    if missing:
        raise ValueError(f"{what} capture missing for rollouts {missing[:10]} of {len(arrays)}: replaying the others "
                         "would misalign the batch")
    return np.concatenate(arrays)
