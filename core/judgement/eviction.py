"""Whether to evict a straggler's node (docs/architecture.md §11): only when the diagnosis says eviction helps,
only when it pays back before the run ends, and never faster than a person can follow.

The payback counts the chance that the replacement is healthy, measured from the fleet's past
evictions: when evictions stop resolving stragglers (a hot aisle, a shared network path), P(healthy)
falls, the payback grows past the run's remaining time, and the run stops evicting on its own.

Pure: the run's and the fleet's records in, a decision out.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict

from stayalive.core.fleet.model import EvictionOutcome, p_healthy
from stayalive.core.judgement.diagnosis import Diagnosis, Verdict

# An automatic remediation that can fire repeatedly needs a rate limit on its own authority (docs/architecture.md §16).
EVICTION_SPACING = timedelta(hours=1)


class Eviction(BaseModel):
    """One straggler eviction this run made."""

    model_config = ConfigDict(frozen=True)

    at: datetime
    node: str
    rack: str
    diagnosis: Diagnosis
    acknowledged: bool = False  # a person has looked at it: the next eviction may hit the same rack again


class EvictionDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    evict: bool
    reason: str
    payback_s: float  # inf when an eviction is not expected to pay back at all
    p_healthy: float


def straggler_cost(ratio: float) -> float:
    """The fraction of the run's throughput a rank `ratio`× slower costs: the barrier waits for it
    every step, so the run goes at 1/ratio of its speed (1.25× slower costs 20%)."""
    return max(0.0, 1.0 - 1.0 / ratio) if ratio > 0 else 0.0


def payback_seconds(restart_s: float, p_healthy: float, straggler_cost: float) -> float:
    """R / (P(healthy) · straggler_cost): how long the run must go on for an eviction that costs a
    restart of R seconds to win back its cost, when it removes the loss only with P(healthy)."""
    benefit = p_healthy * straggler_cost
    return restart_s / benefit if benefit > 0 else math.inf


def should_evict(
    verdict: Verdict,
    rack: str,
    ratio: float,
    restart_s: float,
    remaining_s: float,
    outcomes: list[EvictionOutcome],
    past: list[Eviction],
    now: datetime,
) -> EvictionDecision:
    """Decide on evicting the node of a rank `ratio`× slower than its peers, in `rack`.

    `restart_s` is the run's measured restart time R, `remaining_s` its expected remaining run time,
    `outcomes` the fleet's eviction history (for P(healthy)), `past` this run's own evictions. The
    first rule that refuses gives the reason; the payback is reported either way.
    """
    p = p_healthy(outcomes)
    payback = payback_seconds(restart_s, p, straggler_cost(ratio))

    def decision(evict: bool, reason: str) -> EvictionDecision:
        return EvictionDecision(evict=evict, reason=reason, payback_s=payback, p_healthy=p)

    if not verdict.evict:
        return decision(False, f"diagnosis {verdict.diagnosis.value} does not call for eviction: {verdict.action}")
    # UNKNOWN evicts once: if the straggle survived that eviction, guessing again is a person's call.
    unexplained_before = any(e.diagnosis == Diagnosis.UNKNOWN and not e.acknowledged for e in past)
    if verdict.diagnosis == Diagnosis.UNKNOWN and unexplained_before:
        return decision(False, "an unexplained straggler was already evicted once: ask a person before another")
    last = max(past, key=lambda e: e.at, default=None)
    if last is not None and now - last.at < EVICTION_SPACING:
        wait = (last.at + EVICTION_SPACING - now).total_seconds() / 60
        return decision(
            False, f"at most one straggler eviction per hour: the last was {last.node}; wait {wait:.0f} min"
        )
    if last is not None and last.rack == rack and not last.acknowledged:
        return decision(
            False, f"the last eviction ({last.node}) was in rack {rack} too: a person must look at the rack first"
        )
    if remaining_s <= payback:
        return decision(
            False,
            f"pays back in {_duration(payback)} (P(healthy) {p:.2f}, {straggler_cost(ratio):.0%} of throughput lost), "
            f"but the run has {_duration(remaining_s)} left",
        )
    return decision(
        True, f"pays back in {_duration(payback)} of the {_duration(remaining_s)} left (P(healthy) {p:.2f})"
    )


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
