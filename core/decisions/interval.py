"""The checkpoint interval: Young's and Daly's optimum from the blocking cost C and the MTBF M."""

from __future__ import annotations

import math
import statistics
from datetime import datetime
from typing import TYPE_CHECKING

from stayalive.core.run.status import IntervalChoice

if TYPE_CHECKING:
    from stayalive.core.run.status import RunStatus

# A new interval reaches running ranks only when it moves by more than this: C jitters from one
# checkpoint to the next, and the overhead is flat near Daly's optimum (5% off T* raises C/T + T/2M
# by 0.12%).
RETUNE_BY = 0.05
DEFAULT_PRIOR_MTBF = 6 * 3600.0
COST_OF = 5  # C is the median blocking time of the newest validated checkpoints: one slow write moves nothing


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
    """Fraction of wall-clock lost: checkpointing C/T, lost work (T/2)/M, restarts R/M (docs/architecture.md §14)."""
    return c / t + (t / 2) / m + r / m


def mtbf(observed_seconds: float, interruptions: int, prior_mtbf: float, prior_weight: float = 1.0) -> float:
    """This run's MTBF with the fleet's as a prior worth `prior_weight` interruptions (Gamma-Poisson mean)."""
    return (prior_weight * prior_mtbf + observed_seconds) / (prior_weight + interruptions)


def interval(c: float, m: float, low: float, high: float) -> float:
    """Daly's interval, clamped to [low, high]: the spec's bounds win over the formula."""
    return min(max(daly(c, m), low), high)


def checkpoint_seconds(status: RunStatus) -> float | None:
    """The interval ranks keep, in seconds (None: the spec fixes it in steps): the spec's, or for
    `auto` the one in force (choose_interval's newest; before any, `min_interval`)."""
    cfg = status.spec.checkpoint
    if cfg.interval.kind == "seconds":
        return cfg.interval.value
    if cfg.interval.kind != "auto":
        return None
    return status.intervals[-1].seconds if status.intervals else cfg.min_interval


def choose_interval(status: RunStatus, now: datetime) -> IntervalChoice | None:
    """`auto`: the interval ranks should keep now, with why, when it differs from the one in force by
    more than RETUNE_BY (None: keep it, or the spec fixes the interval). The first checkpoint comes at
    `min_interval`, to measure C; from then on it is Daly's for the C measured (COST_OF) and the
    run's M so far, within the spec's bounds."""
    cfg = status.spec.checkpoint
    if cfg.interval.kind != "auto":
        return None
    m, c = run_mtbf(status, now), measured_cost(status)
    if c is None or status.started_at is None:
        why = "min_interval: the first checkpoint comes early, to measure its cost C"
        choice = IntervalChoice(at=now, seconds=cfg.min_interval, mtbf_s=m, why=why)
    else:
        optimum = daly(c, m)
        seconds = interval(c, m, cfg.min_interval, cfg.max_interval)
        bound = "" if seconds == optimum else f", held to {'min' if seconds > optimum else 'max'}_interval"
        why = f"Daly's optimum {optimum:.4g}s for C = {c:.3g}s, M = {m / 3600:.3g}h{bound}"
        choice = IntervalChoice(at=now, seconds=seconds, cost_s=c, mtbf_s=m, optimum_s=optimum, why=why)
    in_force = status.intervals[-1] if status.intervals else None
    if in_force is not None and abs(choice.seconds - in_force.seconds) <= RETUNE_BY * in_force.seconds:
        return None
    return choice


def measured_cost(status: RunStatus) -> float | None:
    """C: the median blocking seconds of the newest COST_OF validated checkpoints (None: none yet)."""
    measured = [c.blocking_seconds for c in status.checkpoints if c.validated][-COST_OF:]
    return statistics.median(measured) if measured else None


def prior_mtbf(status: RunStatus) -> float:
    """The MTBF a run assumes before its own: the spec's `prior_mtbf`, else the fleet's measured one
    at the run's width, else (no fleet has answered yet) DEFAULT_PRIOR_MTBF."""
    return status.spec.checkpoint.prior_mtbf or status.fleet_mtbf_s or DEFAULT_PRIOR_MTBF


def run_mtbf(status: RunStatus, now: datetime) -> float:
    """M: the run's MTBF so far, its failures over the time it could fail (wall-clock less the time it
    sat idle), with the prior (prior_mtbf) weighing as one failure."""
    if status.started_at is None:
        return prior_mtbf(status)
    exposed = max(0.0, (now - status.started_at).total_seconds() - status.idle_seconds())
    return mtbf(exposed, status.failure_count(), prior_mtbf(status))


def checkpoint_steps(status: RunStatus) -> float:
    """The checkpoint interval in steps (time-based intervals convert at the p50 step time)."""
    cfg = status.spec.checkpoint
    if cfg.interval.kind == "steps":
        return cfg.interval.value or 1.0
    seconds = checkpoint_seconds(status) or cfg.min_interval
    return seconds / max(status.progress.step_seconds_p50, 1e-3)
