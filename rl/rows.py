"""The kept rows of a data set as a view: its memory-mapped Arrow table (a `datasets.Dataset`) and an int64 array of
the kept rows' positions in it. A row becomes a Python dict only when it is read, through the loader's `to_row`
(per-row normalisation: canonical integer answers, DAPO's prompt for flat AIME layouts), so a 1M-row file costs
8 bytes per kept row in Python memory instead of a dict per row.

Supports what the callers of the loaders use: len(), rows[i], rows[a:b] (a view), iteration (batched reads) and
`take(indices)` (one gather for a batch the cursor drew).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Callable

import numpy as np

ToRow = Callable[[dict, int], dict]  # (record as stored, its position in the file) -> the row callers see
_READ_BATCH = 1024  # rows per gather when iterating: a batch of dicts at a time, never all of them


def _as_stored(record: dict, position: int) -> dict:
    return record


def records(batch: dict) -> Iterator[dict]:
    """A batch in `datasets`' python format ({column: [values]}) as one dict per record."""
    names = list(batch)
    return (dict(zip(names, values)) for values in zip(*batch.values()))


class Rows(Sequence):
    def __init__(self, dataset, positions, to_row: ToRow = _as_stored):
        self.dataset = dataset
        self.positions = np.asarray(positions, dtype=np.int64)
        if self.positions.ndim != 1:
            raise ValueError(f"Rows: positions must be one-dimensional, got shape {self.positions.shape}")
        self._to_row = to_row

    @classmethod
    def from_list(cls, rows: list[dict]) -> Rows:
        """Rows already in memory (the built-in task), as an in-memory Arrow table, so every caller sees one type."""
        import datasets

        return cls(datasets.Dataset.from_list(list(rows)) if rows else None, np.arange(len(rows)))

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Rows(self.dataset, self.positions[i], self._to_row)
        if isinstance(i, (int, np.integer)):
            position = int(self.positions[range(len(self))[i]])  # range: IndexError and negative indices as a list
            return self._to_row(self.dataset[position], position)
        raise TypeError(f"Rows indices must be integers or slices, not {type(i).__name__}")

    def select(self, indices) -> Rows:
        """A view of the rows at `indices` (of this view), in that order."""
        return Rows(self.dataset, self.positions[self._checked(indices)], self._to_row)

    def take(self, indices) -> list[dict]:
        """The rows at `indices` as dicts, read in one gather from the Arrow table."""
        positions = self.positions[self._checked(indices)]
        if not len(positions):
            return []
        batch = self.dataset[positions.tolist()]  # one gather
        return [self._to_row(record, int(p)) for record, p in zip(records(batch), positions)]

    def __iter__(self):
        for start in range(0, len(self), _READ_BATCH):
            yield from self.take(range(start, min(start + _READ_BATCH, len(self))))

    def _checked(self, indices) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"Rows: index out of range for {len(self)} rows")
        return idx

    def __repr__(self) -> str:
        return f"Rows({len(self)} of {0 if self.dataset is None else len(self.dataset)} stored rows)"
