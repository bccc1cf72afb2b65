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

    def to_matrix(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position values [T] -> ([B, Lmax] response-token values, [B, Lmax] mask), for verl's [B, L] losses."""
        rows, masks = [], []
        for s, e in zip(self.cu_seqlens[:-1].tolist(), self.cu_seqlens[1:].tolist()):
            m = self.response_mask[s:e]
            rows.append(values[s:e][m])
            masks.append(torch.ones(int(m.sum()), dtype=torch.bool))
        return (torch.nn.utils.rnn.pad_sequence(rows, batch_first=True),
                torch.nn.utils.rnn.pad_sequence(masks, batch_first=True))


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
