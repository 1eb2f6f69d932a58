"""Numerical comparisons shared by the tests."""

from __future__ import annotations

import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (L2 over all elements), computed in float64."""
    return float((got.double() - want.double()).norm() / want.double().norm())
