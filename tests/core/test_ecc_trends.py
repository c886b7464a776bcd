"""Corrected ECC errors in the fleet's history: each node's trend from its agent's NVML readings, its
rate, a reboot that restarts NVML's volatile count, retries, and the bound on what the fleet carries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from stayalive.core.fleet import rules
from stayalive.core.fleet.model import KEEP_ECC_POINTS, KEEP_ECC_TRENDS, FleetState, NodeState
from stayalive.core.fleet.rules import FleetError
from tests.core.test_fleet import pool

T0 = datetime(2026, 1, 1, tzinfo=UTC)
H = 3600


def at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("readings", "points", "per_day"),
    [
        # (seconds after T0, corrected errors since the driver loaded) → the trend the fleet keeps
        ([(0, 5)], [(0, 5)], 0.0),
        ([(0, 0), (24 * H, 10)], [(0, 0), (24 * H, 10)], 10.0),
        ([(0, 100), (6 * H, 130)], [(0, 100), (6 * H, 130)], 120.0),
        # The count fell: the driver reloaded (a reboot), and the trend starts over from it.
        ([(0, 10), (H, 20), (2 * H, 3)], [(2 * H, 3)], 0.0),
        # A retry of the newest reading, and a late one older than it, change nothing.
        ([(0, 10), (H, 20), (H, 20)], [(0, 10), (H, 20)], 240.0),
        ([(0, 10), (2 * H, 20), (H, 15)], [(0, 10), (2 * H, 20)], 120.0),
        # Hourly for 20 hours: the first reading and the newest ones are kept; the rate spans them all.
        (
            [(i * H, 3 * i) for i in range(20)],
            [(0, 0)] + [(i * H, 3 * i) for i in range(21 - KEEP_ECC_POINTS, 20)],
            72.0,
        ),
    ],
)
def test_a_nodes_trend_and_rate(readings: list[tuple[int, int]], points: list[tuple[int, int]], per_day: float) -> None:
    state = pool(n1=NodeState.HEALTHY)
    for seconds, corrected in readings:
        trend = rules.record_corrected_errors(state, "n1", at(seconds), corrected)
    assert trend is not None and trend == state.ecc_trends["n1"]
    start = int(T0.timestamp())
    assert [(t - start, c) for t, c in trend.points] == points
    assert trend.per_day() == pytest.approx(per_day)


def test_the_fleet_keeps_the_nodes_with_the_most_errors() -> None:
    nodes = [f"n{i}" for i in range(KEEP_ECC_TRENDS + 1)]
    state = pool(**dict.fromkeys(nodes, NodeState.HEALTHY))
    for i, node in enumerate(nodes[:KEEP_ECC_TRENDS]):
        rules.record_corrected_errors(state, node, at(i), 10 + i)
    # One more node than the fleet keeps: with fewer errors than any, it is not kept...
    assert rules.record_corrected_errors(state, nodes[-1], at(H), 1) is None
    assert len(state.ecc_trends) == KEEP_ECC_TRENDS and nodes[-1] not in state.ecc_trends
    # ...and with more, it takes the place of the node with the fewest.
    kept = rules.record_corrected_errors(state, nodes[-1], at(2 * H), 500)
    assert kept is not None and kept.corrected == 500
    assert len(state.ecc_trends) == KEEP_ECC_TRENDS and "n0" not in state.ecc_trends


def test_a_reading_from_an_unknown_node_is_refused_and_changes_nothing() -> None:
    state = pool(n1=NodeState.HEALTHY)
    before = state.model_copy(deep=True)
    with pytest.raises(FleetError, match="'n9' is not a node of this fleet"):
        rules.record_corrected_errors(state, "n9", T0, 3)
    assert state == before


def test_trends_survive_the_fleets_continue_as_new() -> None:
    state = pool(n1=NodeState.HEALTHY)
    rules.record_corrected_errors(state, "n1", at(0), 4)
    rules.record_corrected_errors(state, "n1", at(H), 9)
    carried = FleetState.model_validate_json(state.carried().model_dump_json())
    assert carried.ecc_trends == state.ecc_trends
