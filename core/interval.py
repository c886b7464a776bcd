"""The checkpoint interval: Young's and Daly's optimum from the blocking cost C and the MTBF M."""

from __future__ import annotations

import math


def young(c: float, m: float) -> float:
    """T* = sqrt(2CM): minimises C/T + (T/2)/M (Young, 1974)."""
    return math.sqrt(2 * c * m)


def daly(c: float, m: float) -> float:
    """Daly's higher-order estimate (2006), for when C is not negligible against M."""
    if c >= 2 * m:
        return m
    ratio = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - c


def overhead(c: float, t: float, m: float, r: float) -> float:
    """Fraction of wall-clock lost: checkpointing C/T, lost work (T/2)/M, restarts R/M (seed 003 §6)."""
    return c / t + (t / 2) / m + r / m


def mtbf(observed_seconds: float, interruptions: int, prior_mtbf: float, prior_weight: float = 1.0) -> float:
    """This run's MTBF with the fleet's as a prior worth `prior_weight` interruptions (Gamma-Poisson mean)."""
    return (prior_weight * prior_mtbf + observed_seconds) / (prior_weight + interruptions)


def interval(c: float, m: float, low: float, high: float) -> float:
    return min(max(daly(c, m), low), high)
