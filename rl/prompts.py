"""Training prompts tokenized when the cursor draws them, not all up front: a 1M-row file holds no 1M token lists.

`DataCursor`: a resumable (epoch, position) cursor over the kept rows, reshuffled per epoch from the seed.

`TrainPrompts.draw(cursor, k)` takes indices from the `DataCursor` until it has `k` prompts that fit
`data.max_prompt_length`; a row found too long is remembered (one bit a row), counted in `n_too_long`, logged, and
skipped without tokenizing it again in later epochs. The cursor runs over all kept rows, so its (epoch, position)
state alone still reproduces the draws after a resume: which rows are too long is a function of the file and the
tokenizer. `first_fit()` is the up-front check: it tokenizes rows in file order until one fits (usually the first),
so a max_prompt_length no prompt fits fails before any model or engine starts, with the error rl.session always gave.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping

import numpy as np

from rl.data import PromptTooLong, prompt_token_ids, row_id
from rl.rows import Rows

_SCAN_BATCH = 256  # rows read per gather while scanning for a prompt that fits
_IDS_IN_LOG = 5


class DataCursor:
    """Yields row indices epoch after epoch. Each epoch is a permutation derived from (seed, epoch) alone,
    so saving (epoch, position) is enough to resume mid-epoch on another machine or process."""

    VERSION = 1

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True):
        if n <= 0:
            raise ValueError(f"DataCursor needs n > 0, got {n}")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            # random.Random(int).shuffle is stable across Python versions; numpy Generator streams are not
            # promised to be.
            seed = int.from_bytes(hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()[:8], "little")
            random.Random(seed).shuffle(order)
        return order

    def _current(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            # held as int64 (8 B a row), not as the list of int objects the shuffle needs (~36 B a row)
            self._order, self._order_epoch = np.array(self.epoch_order(self.epoch), dtype=np.int64), self.epoch
        return self._order

    def next_batch(self, k: int) -> list[int]:
        """The next ``k`` indices; a batch may run into the next epoch, so no row is ever skipped."""
        out: list[int] = []
        while len(out) < k:
            take = min(k - len(out), self.n - self.position)
            out.extend(self._current()[self.position:self.position + take].tolist())
            self.position += take
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"version": self.VERSION, "n": self.n, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping) -> None:
        for key in ("version", "n", "seed", "shuffle"):
            mine = self.VERSION if key == "version" else getattr(self, key)
            if state.get(key) != mine:
                raise ValueError(f"cursor state {key}={state.get(key)!r} does not match this cursor's {mine!r}: "
                                 f"resuming would replay a different order")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.n:
            raise ValueError(f"cursor state epoch={epoch}, position={position} out of range for n={self.n}")
        self.epoch, self.position = epoch, position

    @classmethod
    def from_state(cls, state: Mapping) -> DataCursor:
        cursor = cls(int(state["n"]), int(state["seed"]), bool(state["shuffle"]))
        cursor.load_state_dict(state)
        return cursor


class NoPromptFits(ValueError):
    pass


class TrainPrompts:
    def __init__(self, rows: Rows, tokenizer, max_length: int | None, log=None):
        self.rows, self.tokenizer, self.max_length, self.log = rows, tokenizer, max_length, log
        self.too_long = np.zeros(len(rows), dtype=bool)
        self.n_too_long = 0

    def _no_fit(self) -> NoPromptFits:
        return NoPromptFits(f"data.max_prompt_length={self.max_length}: no train prompt fits (all longer)")

    def _tokens(self, i: int, row: dict, dropped: list[str]) -> list[int] | None:
        """Row i's token ids; None when too long (marked and counted the first time, its id added to `dropped`)."""
        try:
            return prompt_token_ids(self.tokenizer, row["prompt"], self.max_length)
        except PromptTooLong as e:
            if not self.too_long[i]:
                self.too_long[i] = True
                self.n_too_long += 1
                dropped.append(f"{row_id(row, i)} ({e})")
            return None

    def _log_dropped(self, dropped: list[str]) -> None:
        if dropped and self.log is not None:
            more = f" and {len(dropped) - _IDS_IN_LOG} more" if len(dropped) > _IDS_IN_LOG else ""
            self.log(f"data.max_prompt_length={self.max_length}: dropped {'; '.join(dropped[:_IDS_IN_LOG])}{more} "
                     f"({self.n_too_long} train prompts too long so far)")

    def first_fit(self) -> int:
        """The first row (file order) whose prompt fits; NoPromptFits when none does."""
        dropped = []
        try:
            for start in range(0, len(self.rows), _SCAN_BATCH):
                indices = range(start, min(start + _SCAN_BATCH, len(self.rows)))
                for i, row in zip(indices, self.rows.take(indices)):  # one prompt at a time: usually just the first
                    if not self.too_long[i] and self._tokens(i, row, dropped) is not None:
                        return i
            raise self._no_fit()
        finally:
            self._log_dropped(dropped)

    def draw(self, cursor: DataCursor, k: int) -> tuple[list[int], list[list[int]]]:
        """The next `k` row indices whose prompts fit, and their token ids, in cursor order."""
        if cursor.n != len(self.rows):
            raise ValueError(f"cursor over {cursor.n} rows, prompts over {len(self.rows)}")
        idx, ids = [], []
        while len(idx) < k:
            if self.n_too_long == len(self.rows):  # every row seen and too long: no draw can succeed
                raise self._no_fit()
            drawn, dropped = [i for i in cursor.next_batch(k - len(idx)) if not self.too_long[i]], []
            for i, row in zip(drawn, self.rows.take(drawn)):
                tokens = self._tokens(i, row, dropped)
                if tokens is not None:
                    idx.append(i)
                    ids.append(tokens)
            self._log_dropped(dropped)
        return idx, ids


def prompt_lengths(rows, tokenizer) -> np.ndarray:
    """Every row's prompt length in tokens (the dry run's statistics): one int32 a row, rows read in batches."""
    out = np.empty(len(rows), dtype=np.int32)
    for i, row in enumerate(rows):
        out[i] = len(prompt_token_ids(tokenizer, row["prompt"]))
    return out
