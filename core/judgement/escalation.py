"""What to do about a straggler, as ski rental: S1 nothing → S2 rebalance micro-batches → S3 re-place →
S4 evict and restart, one rung at a time (FALCON, arXiv:2410.12588; docs/architecture.md §11).

How long a slow-failure will last is unknowable when it starts (FALCON measured a mean of 72 min, and a
GPT2-100B checkpoint dump alone takes 100), so the ladder does not predict it. It reacts to cost already paid:
the straggler's "rent" is the progress it takes while the run keeps the current strategy, and the
run "buys" the next rung once the rent paid since the current one began exceeds that rung's price.
For a rung that ends the slowdown, that never costs more than twice what hindsight would have paid,
however long the slowdown lasts (deterministic ski rental's bound).

Pure: measured speeds and costs in, a strategy or a split of the batch out.
"""

from __future__ import annotations

import math
from enum import StrEnum
from fractions import Fraction

from pydantic import BaseModel, ConfigDict, Field

from stayalive.core.judgement.diagnosis import Verdict
from stayalive.core.judgement.eviction import straggler_cost


class Strategy(StrEnum):
    S1_NOTHING = "s1_nothing"  # wait: most slow-failures end on their own
    S2_REBALANCE = "s2_rebalance"  # fewer samples to the slow rank, by measured speed (compute stragglers)
    S3_REPLACE = "s3_replace"  # drain the slow node, resize onto a spare; survivors keep their processes
    S4_EVICT = "s4_evict"  # treat it as fail-stop: checkpoint, restart without the node


LADDER = tuple(Strategy)


class StrategyCosts(BaseModel):
    """The price of each rung in seconds of the whole run's progress; None where the rung does not
    apply (a communication straggler is not fixed by rebalancing; no spare, no re-place)."""

    model_config = ConfigDict(frozen=True)

    # One step at the old split while the command travels, plus the command's round trip: the
    # split changes at a step boundary every rank agrees on, with no checkpoint.
    rebalance_s: float | None = Field(ge=0)
    replace_s: float | None = Field(ge=0)  # the measured drain + resize time
    restart_s: float = Field(ge=0)  # the measured restart time R

    def of(self, strategy: Strategy) -> float | None:
        return {
            Strategy.S1_NOTHING: 0.0,
            Strategy.S2_REBALANCE: self.rebalance_s,
            Strategy.S3_REPLACE: self.replace_s,
            Strategy.S4_EVICT: self.restart_s,
        }[strategy]


def next_strategy(current: Strategy, accumulated_cost_s: float, costs: StrategyCosts) -> Strategy:
    """The strategy to be on, given the slowdown cost paid since `current` began (`slowdown_cost`):
    the next rung that applies once that cost exceeds its price, else `current`. One rung at a time,
    so each rung's price is earned by rent paid under the one before it."""
    for candidate in LADDER[LADDER.index(current) + 1 :]:
        price = costs.of(candidate)
        if price is not None:
            return candidate if accumulated_cost_s > price else current
    return current


def slowdown_cost(elapsed_s: float, ratio: float) -> float:
    """Seconds of progress lost over `elapsed_s` of wall-clock with a rank `ratio`× slower than its
    peers: the barrier runs the whole job at 1/ratio of its speed."""
    return elapsed_s * straggler_cost(ratio)


def break_even_seconds(price_s: float, ratio: float) -> float:
    """How long a slowdown of `ratio` must last before a remedy of `price_s` costs less than waiting.
    Never less than `price_s` itself: even a full stall loses only one second per second."""
    cost = straggler_cost(ratio)
    return price_s / cost if cost > 0 else math.inf


def recovered_fraction(healthy: float, slowed: float, mitigated: float) -> float:
    """The share of a slowdown's throughput loss a mitigation won back (any throughput unit)."""
    if not healthy > slowed:
        raise ValueError(f"no slowdown to recover: healthy {healthy} is not above slowed {slowed}")
    return (mitigated - slowed) / (healthy - slowed)


def rebalance(speeds: list[float], global_batch: int) -> list[int]:
    """Per-rank sample counts proportional to measured speed (samples/s): the slow rank gets fewer, so
    every rank reaches the barrier together. They sum to `global_batch` exactly and none is below 1
    (a rank with no sample would leave the collective's shapes). Largest-remainder rounding, ties to
    the lower rank, in exact arithmetic: the same speeds always give the same split."""
    if not speeds:
        raise ValueError("no ranks to split the batch over")
    if not all(math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"speeds must be positive samples/s, got {speeds}")
    if global_batch < len(speeds):
        raise ValueError(f"global batch {global_batch} cannot give each of {len(speeds)} ranks a sample")
    exact = [Fraction(s) for s in speeds]
    total = sum(exact)
    quotas = [global_batch * s / total for s in exact]
    counts = [math.floor(q) for q in quotas]
    left = global_batch - sum(counts)
    by_remainder = sorted(range(len(speeds)), key=lambda r: (counts[r] - quotas[r], r))
    for rank in by_remainder[:left]:
        counts[rank] += 1
    for rank, count in enumerate(counts):
        if count == 0:  # a rank far slower than the rest: one sample, from the most over-served rank
            donor = max((d for d in range(len(counts)) if counts[d] > 1), key=lambda d: (counts[d] - quotas[d], -d))
            counts[donor] -= 1
            counts[rank] = 1
    return counts


class Escalation(BaseModel):
    """A run's climb up the ladder for one straggler, carried in RunStatus across continue-as-new."""

    generation: int  # ranks are numbered per generation: a resize ends the climb
    rank: int
    node: str
    rack: str
    ratio: float
    verdict: Verdict | None  # the node's diagnosis (core/judgement/diagnosis.py), when it had GPU telemetry
    strategy: Strategy = Strategy.S1_NOTHING
    paid_before_s: float  # RunStatus.straggler_seconds when the current rung began: rent is paid since
    settled: str | None = None  # why the climb ended: "evicted" (outcome pending), or refused and why


COMMAND_S = 1.0  # a command's trip from the workflow to every rank


def costs(restart_s: float, step_s: float, spare_free: bool, compute_bound: bool) -> StrategyCosts:
    """This run's prices. A rebalance costs the steps run at the old split while the command travels
    (two, and the trip), and fixes only a rank slow at computing, not at communicating; a re-place
    (drain → checkpoint → resize onto a spare) keeps the survivors' processes, about half a restart;
    a restart costs R."""
    return StrategyCosts(
        rebalance_s=2 * step_s + COMMAND_S if compute_bound else None,
        replace_s=restart_s / 2 if spare_free else None,
        restart_s=restart_s,
    )
