"""The S1→S4 ladder as ski rental (docs/architecture.md §11), and the micro-batch split S2 applies."""

from __future__ import annotations

import math

import pytest

from stayalive.core.judgement.escalation import (
    LADDER,
    Strategy,
    StrategyCosts,
    break_even_seconds,
    costs,
    next_strategy,
    rebalance,
    recovered_fraction,
    slowdown_cost,
)

S1, S2, S3, S4 = LADDER
# FALCON's overheads (arXiv:2410.12588): S2 ~30 s even at 512 groups, S3 ~1 min; S4 the 100-minute
# GPT2-100B dump.
FALCON_COSTS = StrategyCosts(rebalance_s=30.0, replace_s=60.0, restart_s=100 * 60.0)
RESTART_ONLY = StrategyCosts(rebalance_s=None, replace_s=None, restart_s=100 * 60.0)
MEAN_SLOW_FAILURE_S = 72 * 60.0


@pytest.mark.parametrize(
    ("current", "paid", "costs", "expected"),
    [
        (S1, 0.0, FALCON_COSTS, S1),
        (S1, 30.0, FALCON_COSTS, S1),  # exactly the price: not yet
        (S1, 30.1, FALCON_COSTS, S2),
        (S1, 1e9, FALCON_COSTS, S2),  # one rung at a time, however much was paid
        (S2, 59.0, FALCON_COSTS, S2),
        (S2, 61.0, FALCON_COSTS, S3),
        (S3, 6000.0, FALCON_COSTS, S3),
        (S3, 6001.0, FALCON_COSTS, S4),
        (S4, 1e9, FALCON_COSTS, S4),  # the top rung
        # a communication straggler: rebalancing does not apply, so S1 goes to S3 at S3's price
        (S1, 45.0, StrategyCosts(rebalance_s=None, replace_s=60.0, restart_s=600.0), S1),
        (S1, 61.0, StrategyCosts(rebalance_s=None, replace_s=60.0, restart_s=600.0), S3),
        (S1, 6001.0, RESTART_ONLY, S4),
    ],
)
def test_next_strategy(current: Strategy, paid: float, costs: StrategyCosts, expected: Strategy) -> None:
    assert next_strategy(current, paid, costs) == expected


def run_ladder(duration_s: float, ratio: float, costs: StrategyCosts, fixed_by: Strategy, tick_s: float = 1.0) -> float:
    """A slowdown of `ratio` lasting `duration_s`, handled by the ladder second by second, where
    `fixed_by` and every rung above it end it. Returns the run's total cost: rent plus prices."""
    strategy, paid, total, t = S1, 0.0, 0.0, 0.0
    while t < duration_s and LADDER.index(strategy) < LADDER.index(fixed_by):
        rent = slowdown_cost(tick_s, ratio)
        paid, total, t = paid + rent, total + rent, t + tick_s
        chosen = next_strategy(strategy, paid, costs)
        if chosen != strategy:
            strategy, paid = chosen, 0.0
            total += costs.of(chosen) or 0.0
    return total


def test_a_72_minute_slow_failure_never_reaches_a_100_minute_restart() -> None:
    """FALCON: the mean slow-failure (72 min) ends before checkpoint-and-restart (100 min) would
    pay; even a full stall loses only 72 min of progress, so the ladder waits it out."""
    for ratio in (1.1, 1.5, 3.0, 1000.0):
        assert break_even_seconds(RESTART_ONLY.restart_s, ratio) > MEAN_SLOW_FAILURE_S
        waited = run_ladder(MEAN_SLOW_FAILURE_S, ratio, RESTART_ONLY, fixed_by=S4)
        assert waited == pytest.approx(slowdown_cost(MEAN_SLOW_FAILURE_S, ratio), abs=1.0)  # no restart bought
        assert waited < RESTART_ONLY.restart_s


def test_the_ladder_climbs_at_each_rungs_break_even() -> None:
    # A rank 1.2× slower costs 1/6 of a second per second: S2 after 180 s; if S2 does not fix it,
    # S3 after 360 s more; the straggle ends there.
    ratio = 1.2
    assert break_even_seconds(FALCON_COSTS.of(S2) or 0, ratio) == pytest.approx(180.0)
    assert run_ladder(3600, ratio, FALCON_COSTS, fixed_by=S2) == pytest.approx(30 + 30, abs=1.0)  # 180 s of rent + 30
    assert run_ladder(3600, ratio, FALCON_COSTS, fixed_by=S3) == pytest.approx(30 + 30 + 60 + 60, abs=1.0)


@pytest.mark.parametrize("ratio", [1.05, 1.5, 10.0])
def test_reacting_to_cost_paid_is_never_worse_than_twice_hindsight(ratio: float) -> None:
    """Ski rental: with one remedy that ends the slowdown, the break-even rule pays at most twice
    what knowing the duration in advance would have (wait it out, or restart at once)."""
    price, tick = 600.0, 5.0
    costs = StrategyCosts(rebalance_s=None, replace_s=None, restart_s=price)
    longest = 5 * break_even_seconds(price, ratio)
    for duration in (tick * 1.2**k for k in range(100) if tick * 1.2**k < longest):
        hindsight = min(slowdown_cost(duration, ratio), price)
        paid = run_ladder(duration, ratio, costs, fixed_by=S4, tick_s=tick)
        assert paid <= 2 * hindsight + slowdown_cost(tick, ratio)  # plus one tick of rent: decisions per tick


def test_falcon_recovered_about_60_percent_of_the_slowdown() -> None:
    """FALCON: 17.1 it/min healthy, 14.8 slowed, 16.2 mitigated, "a 60.1% reduction". From the
    rounded figures it is 60.9%; 60.1% lies within what figures rounded to 0.1 allow."""
    assert recovered_fraction(17.1, 14.8, 16.2) == pytest.approx(1.4 / 2.3)
    low = recovered_fraction(17.15, 14.85, 16.15)
    high = recovered_fraction(17.05, 14.75, 16.25)
    assert low < 0.601 < high
    with pytest.raises(ValueError, match="no slowdown"):
        recovered_fraction(14.8, 14.8, 16.2)


def step_seconds(counts: list[int], speeds: list[float]) -> float:
    """A synchronous step takes as long as its slowest rank's share."""
    return max(c / s for c, s in zip(counts, speeds, strict=True))


def test_rebalancing_a_compute_straggler_recovers_what_the_barrier_wasted() -> None:
    """8 ranks, one at 80% speed. An equal split runs all at 6.4 of 8 ranks' throughput; splitting
    by speed could reach 7.8 (the slow GPU's own missing 0.2 no split can recover), 87.5% of the
    loss; whole samples reach 7.76 (the step waits for a 66-sample rank), 84.8%."""
    speeds, batch = [1.0] * 7 + [0.8], 512
    counts = rebalance(speeds, batch)
    assert counts == [66, 66, 66, 66, 66, 65, 65, 52]  # quotas 65.64 and 52.51
    healthy, slowed = batch / step_seconds([64] * 8, [1.0] * 8), batch / step_seconds([64] * 8, speeds)
    mitigated = batch / step_seconds(counts, speeds)
    assert (healthy, slowed) == (8.0, 6.4)
    assert recovered_fraction(healthy, slowed, mitigated) == pytest.approx(0.848, abs=0.001)


@pytest.mark.parametrize(
    ("speeds", "batch", "expected"),
    [
        ([1.0, 1.0, 1.0], 3, [1, 1, 1]),
        ([1.0, 1.0, 1.0], 4, [2, 1, 1]),  # ties go to the lower rank
        ([1.0, 1.0, 1.0], 5, [2, 2, 1]),
        ([3.0, 1.0], 8, [6, 2]),
        ([2.0, 1.0, 1.0], 10, [5, 3, 2]),  # quotas 5, 2.5, 2.5: the tie to rank 1
        ([1000.0, 1000.0, 0.001], 10, [4, 5, 1]),  # every rank at least 1, taken from the most over-served
        ([1.0, 1.0, 1.0, 1.0], 4, [1, 1, 1, 1]),
        ([0.1] * 10, 10, [1] * 10),  # 0.1 is not exact in binary: still a tie everywhere
    ],
)
def test_rebalance(speeds: list[float], batch: int, expected: list[int]) -> None:
    assert rebalance(speeds, batch) == expected


@pytest.mark.parametrize("n", [2, 7, 64, 513])
def test_rebalance_is_exact_proportional_and_deterministic(n: int) -> None:
    speeds = [1.0 + 0.37 * math.sin(rank * 1.7) for rank in range(n)]
    batch = 4 * n + 3
    counts = rebalance(speeds, batch)
    assert sum(counts) == batch and min(counts) >= 1
    quotas = [batch * s / sum(speeds) for s in speeds]
    assert all(abs(c - q) < 1 for c, q in zip(counts, quotas, strict=True))
    assert rebalance(list(speeds), batch) == counts


@pytest.mark.parametrize(
    ("speeds", "batch", "message"),
    [([], 8, "no ranks"), ([1.0, 0.0], 8, "positive"), ([1.0, math.nan], 8, "positive"), ([1.0] * 4, 3, "cannot")],
)
def test_rebalance_refuses_what_it_cannot_split(speeds: list[float], batch: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rebalance(speeds, batch)


@pytest.mark.parametrize(
    ("current", "spare_free", "compute_bound", "paid", "expected"),
    [
        (S1, True, True, 1.9, S1),  # a rebalance costs two 0.5 s steps and the command's 1 s trip
        (S1, True, True, 2.1, S2),
        (S1, True, False, 2.1, S1),  # a communication straggler: no rebalance; a re-place costs R/2
        (S1, True, False, 301.0, S3),
        (S2, True, True, 301.0, S3),
        (S1, False, False, 301.0, S1),  # no spare, no re-place: the next rung is a restart at R
        (S1, False, False, 601.0, S4),
    ],
)
def test_a_run_prices_its_rungs_from_its_step_and_restart_times(
    current: Strategy, spare_free: bool, compute_bound: bool, paid: float, expected: Strategy
) -> None:
    prices = costs(restart_s=600.0, step_s=0.5, spare_free=spare_free, compute_bound=compute_bound)
    assert next_strategy(current, paid, prices) == expected
