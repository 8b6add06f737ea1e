"""Checks on figures a bench printed rounded: a ratio against the rounded figures it came from."""

from __future__ import annotations


def ratio_of_rounded(
    reported: float, num: float, den: float, *, step: float = 0.1, ratio_step: float = 0.001
) -> bool:
    """True when ``reported`` (rounded to ``ratio_step``) can be the ratio of the unrounded figures that
    ``num`` and ``den`` are roundings of (to ``step``). At low rates the rounding of the figures alone
    moves their ratio by more than any fixed share."""
    half = step / 2
    low = max(num - half, 0.0) / (den + half)
    high = (num + half) / max(den - half, 1e-12)
    slack = ratio_step / 2 + 1e-9
    return low - slack <= reported <= high + slack
