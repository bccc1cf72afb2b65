"""The resumable data cursor: `DataCursor`, an (epoch, position) cursor over the kept rows, reshuffled per epoch
from the seed."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping

import numpy as np


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
