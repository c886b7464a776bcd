"""The checkpoint interval: Young's and Daly's optimum from the blocking cost C and the MTBF M."""

from __future__ import annotations

import math
from datetime import datetime
from typing import TYPE_CHECKING

from core.paging import failures

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
    """Daly's interval, clamped to [low, high]: the spec's bounds win over the formula."""
    return min(max(daly(c, m), low), high)


def checkpoint_seconds(status: RunStatus, now: datetime) -> float | None:
    """The interval ranks should checkpoint at, in seconds (None: the spec fixes it in steps).
    `auto` recomputes Daly's interval from the newest measured C and the run's MTBF so far.

    The MTBF counts failures only (a drain, a pause or a rollback was asked for, not suffered) over
    the time the run could fail: wall-clock less the time it sat idle waiting for a person or nodes."""
    cfg = status.spec.checkpoint
    if cfg.interval.kind == "seconds":
        return cfg.interval.value
    if cfg.interval.kind != "auto":
        return None
    measured = [c.blocking_seconds for c in status.checkpoints if c.validated]
    if not measured or status.started_at is None:
        return cfg.min_interval  # the first checkpoint comes early: it measures C
    return interval(measured[-1], run_mtbf(status, now), cfg.min_interval, cfg.max_interval)


def run_mtbf(status: RunStatus, now: datetime) -> float:
    """M: the run's MTBF so far, its failures over the time it could fail (wall-clock less the time it
    sat idle), with the spec's `prior_mtbf` weighing as one failure."""
    if status.started_at is None:
        return status.spec.checkpoint.prior_mtbf
    idle = sum(i.idle_seconds for i in status.interruptions)
    exposed = max(0.0, (now - status.started_at).total_seconds() - idle)
    return mtbf(exposed, len(failures(status.interruptions)), status.spec.checkpoint.prior_mtbf)


def checkpoint_steps(status: RunStatus, now: datetime) -> float:
    """The checkpoint interval in steps (time-based intervals convert at the p50 step time)."""
    cfg = status.spec.checkpoint
    if cfg.interval.kind == "steps":
        return cfg.interval.value or 1.0
    seconds = checkpoint_seconds(status, now) or cfg.min_interval
    return seconds / max(status.progress.step_seconds_p50, 1e-3)
