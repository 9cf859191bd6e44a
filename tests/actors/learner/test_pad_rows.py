"""core.pad_rows: rows of unequal length as one right-padded tensor (in-process, no model)."""

from __future__ import annotations

import pytest
import torch

from otray.actors.learner.core import pad_rows


def test_rows_are_right_padded_and_a_row_too_long_is_refused_by_name():
    got = pad_rows([[1, 2, 3], [4], []], 4, 0, torch.long)
    assert got.dtype == torch.long and got.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0], [0, 0, 0, 0]]
    floats = pad_rows([(0.5, 1.5)], 3, -1.0, torch.float32)
    assert floats.tolist() == [[0.5, 1.5, -1.0]]
    assert pad_rows([], 5, 0.0, torch.float32).shape == (0, 5)
    with pytest.raises(ValueError, match="a row of 3 values does not fit a width of 2"):
        pad_rows([[1, 2, 3]], 2, 0, torch.long)
