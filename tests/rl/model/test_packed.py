"""rl.model.packed: offsets, positions and the host->device helper the attention path relies on."""

import pytest
import torch

from rl.model.packed import host_offsets, to_device, token_positions


def test_host_offsets_and_positions():
    cu = torch.tensor([0, 3, 3, 7])  # an empty middle sequence
    assert host_offsets(cu) == host_offsets([0, 3, 3, 7]) == [0, 3, 3, 7]
    assert token_positions(cu).tolist() == token_positions([0, 3, 3, 7]).tolist() == [0, 1, 2, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="non-decreasing"):
        host_offsets([0, 5, 4])


def test_to_device_keeps_values_and_dtype():
    t = to_device([5, -1, 2 ** 40], "cpu")
    assert t.dtype == torch.int64 and t.tolist() == [5, -1, 2 ** 40]
    assert to_device([1, 2], torch.device("cpu"), torch.int32).dtype == torch.int32
