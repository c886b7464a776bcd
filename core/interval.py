"""The checkpoint interval: Young's and Daly's optimum from the blocking cost C and the MTBF M."""

from __future__ import annotations

import math
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.run import RunStatus


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


def checkpoint_seconds(status: RunStatus, now: datetime) -> float | None:
    """The interval ranks should checkpoint at, in seconds (None: the spec fixes it in steps).
    `auto` recomputes Daly's interval from the newest measured C and the run's MTBF so far."""
    cfg = status.spec.checkpoint
    if cfg.interval.kind == "seconds":
        return cfg.interval.value
    if cfg.interval.kind != "auto":
        return None
    measured = [c.blocking_seconds for c in status.checkpoints if c.validated]
    if not measured or status.started_at is None:
        return cfg.min_interval  # the first checkpoint comes early: it measures C
    m = mtbf((now - status.started_at).total_seconds(), len(status.interruptions), cfg.prior_mtbf)
    return interval(measured[-1], m, cfg.min_interval, cfg.max_interval)


def checkpoint_steps(status: RunStatus, now: datetime) -> float:
    """The checkpoint interval in steps (time-based intervals convert at the p50 step time)."""
    cfg = status.spec.checkpoint
    if cfg.interval.kind == "steps":
        return cfg.interval.value or 1.0
    seconds = checkpoint_seconds(status, now) or cfg.min_interval
    return seconds / max(status.progress.step_seconds_p50, 1e-3)
