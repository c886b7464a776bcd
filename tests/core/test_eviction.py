"""Straggler eviction (docs/architecture.md §11): the payback with its confidence term, and every guard on the
run's authority to evict."""

from __future__ import annotations

import math
from datetime import datetime

import pytest

from stayalive.core.fleet.model import EvictionOutcome
from stayalive.core.judgement.diagnosis import RULES, UNKNOWN_ACTION, Diagnosis, Verdict
from stayalive.core.judgement.eviction import Eviction, EvictionDecision, payback_seconds, should_evict, straggler_cost
from tests.core.runs import at

R = 600.0  # restart seconds, as assumed at 16,384 GPUs (docs/architecture.md §16)
HOUR = 3600.0


def verdict(diagnosis: Diagnosis) -> Verdict:
    """A verdict as core.judgement.diagnosis gives it: whether it evicts comes from its rule table."""
    rule = next((r for r in RULES if r.diagnosis == diagnosis), None)
    evict, action = (rule.evict, rule.action) if rule else (True, UNKNOWN_ACTION)
    return Verdict(diagnosis=diagnosis, evidence="test", evict=evict, action=action)


def outcomes(resolved: int, unresolved: int = 0) -> list[EvictionOutcome]:
    flags = [True] * resolved + [False] * unresolved
    return [EvictionOutcome(node=f"n{k}", run_id="r0", at=at(hours=k), resolved=ok) for k, ok in enumerate(flags)]


def evicted(
    hours_ago: float, rack: str = "rack-b", diagnosis: Diagnosis = Diagnosis.NODE_THERMAL, **kw: bool
) -> Eviction:
    return Eviction(at=at(hours=NOW_H - hours_ago), node="n9", rack=rack, diagnosis=diagnosis, **kw)


NOW_H = 48.0
NOW: datetime = at(hours=NOW_H)


def decide(
    diagnosis: Diagnosis = Diagnosis.NODE_THERMAL,
    past: list[Eviction] | None = None,
    ratio: float = 1.25,
    remaining_s: float = 24 * HOUR,
    fleet: list[EvictionOutcome] | None = None,
) -> EvictionDecision:
    return should_evict(
        verdict(diagnosis),
        rack="rack-a",
        ratio=ratio,
        restart_s=R,
        remaining_s=remaining_s,
        outcomes=outcomes(8) if fleet is None else fleet,
        past=past or [],
        now=NOW,
    )


@pytest.mark.parametrize(("ratio", "cost"), [(1.25, 0.2), (2.0, 0.5), (1.0, 0.0), (0.9, 0.0), (1.0 / 0.88, 0.12)])
def test_straggler_cost_is_the_throughput_lost_to_the_barrier(ratio: float, cost: float) -> None:
    """A GPU at 88% of its peers' speed slows every step by 12%, not 1/256 of the steps: the barrier
    waits for it every step (docs/architecture.md §11)."""
    assert straggler_cost(ratio) == pytest.approx(cost)


@pytest.mark.parametrize(
    ("p", "cost", "minutes"),
    [
        (1.0, 0.2, 50.0),  # R / 0.2 ≈ 50 min: the payback without a confidence term, a healthy replacement
        (0.5, 0.2, 100.0),  # no eviction history yet: P(healthy) = 0.5
        (0.0, 0.2, math.inf),  # evictions never help: never pays back
        (1.0, 0.0, math.inf),  # nothing to win back
    ],
)
def test_payback(p: float, cost: float, minutes: float) -> None:
    assert payback_seconds(R, p, cost) / 60 == pytest.approx(minutes)


@pytest.mark.parametrize(
    ("diagnosis", "past", "evicts", "reason"),
    [
        (Diagnosis.NODE_THERMAL, [], True, "pays back"),
        (Diagnosis.NODE_LINK, [], True, "pays back"),
        (Diagnosis.NETWORK_CONTENTION, [], True, "pays back"),
        (Diagnosis.ENVIRONMENTAL, [], False, "diagnosis environmental"),  # never: the rack shares the air
        (Diagnosis.UNKNOWN, [], True, "pays back"),  # unexplained: evict once ...
        (Diagnosis.UNKNOWN, [evicted(5, diagnosis=Diagnosis.UNKNOWN)], False, "already evicted once"),  # ... only
        (Diagnosis.UNKNOWN, [evicted(5, diagnosis=Diagnosis.UNKNOWN, acknowledged=True)], True, "pays back"),
        (Diagnosis.UNKNOWN, [evicted(5)], True, "pays back"),  # an explained eviction is not the once
        (Diagnosis.NODE_THERMAL, [evicted(0.5)], False, "one straggler eviction per hour"),
        (Diagnosis.NODE_THERMAL, [evicted(0.99, acknowledged=True)], False, "one straggler eviction per hour"),
        (Diagnosis.NODE_THERMAL, [evicted(1.01)], True, "pays back"),
        (Diagnosis.NODE_THERMAL, [evicted(5, rack="rack-a")], False, "in rack rack-a too"),
        (Diagnosis.NODE_THERMAL, [evicted(5, rack="rack-a", acknowledged=True)], True, "pays back"),
        # consecutive only: a rack-b eviction came between the two in rack-a
        (Diagnosis.NODE_THERMAL, [evicted(9, rack="rack-a"), evicted(5)], True, "pays back"),
    ],
)
def test_guards(diagnosis: Diagnosis, past: list[Eviction], evicts: bool, reason: str) -> None:
    decision = decide(diagnosis, past)
    assert decision.evict is evicts
    assert reason in decision.reason


def test_an_eviction_that_cannot_pay_back_before_the_run_ends_is_refused() -> None:
    # 8 of 8 past evictions resolved: P(healthy) = 9/10, payback 600 / (0.9 · 0.2) = 55.6 min
    assert decide(remaining_s=57 * 60).evict
    refused = decide(remaining_s=55 * 60)
    assert not refused.evict and refused.payback_s / 60 == pytest.approx(55.6, abs=0.1)
    assert "the run has 55 min left" in refused.reason
    assert not decide(ratio=1.005).evict  # 0.5% slower pays back in 37 h, not within the day left


def test_a_fleet_whose_evictions_stopped_resolving_stragglers_stops_evicting() -> None:
    """The replacements are slow too (a hot aisle). Each unresolved eviction lowers
    P(healthy), the payback grows, and once it passes the run's remaining 2 h the run stops."""
    decisions = [decide(remaining_s=2 * HOUR, fleet=outcomes(8, unresolved=k)) for k in range(20)]
    p = [d.p_healthy for d in decisions]
    assert p == sorted(p, reverse=True) and p[0] == pytest.approx(0.9)
    # 600 / (P · 0.2) > 7200 once P < 5/12, i.e. 9 / (10 + k) < 5/12: from the 12th unresolved outcome on
    assert [d.evict for d in decisions] == [True] * 12 + [False] * 8
    assert "but the run has 2.0 h left" in decisions[12].reason


def test_the_payback_is_reported_even_when_a_guard_refuses() -> None:
    decision = decide(Diagnosis.ENVIRONMENTAL)
    assert decision.payback_s == pytest.approx(600 / (0.9 * 0.2))
