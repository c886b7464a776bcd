"""The fleet's decisions: who gets which node, why a node is refused, what a quarantine and a
self-test do to a node and its record, and the statistics the fleet keeps."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from pydantic_core import to_json

from stayalive.core.fleet import rules
from stayalive.core.fleet.model import (
    BASELINE_WINDOW,
    CARRIED_ANSWER_BYTES,
    KEEP_ANSWERS,
    KEEP_BASELINES,
    KEEP_CLOSED_QUARANTINES,
    KEEP_EVICTIONS,
    KEEP_RUNS_PER_QUARANTINE,
    KEEP_SELF_TESTS_PER_QUARANTINE,
    PUBLISHED_FAILURES_PER_GPU_HOUR,
    TEXT_LIMIT,
    Baseline,
    EvictionOutcome,
    FailureRate,
    FleetAnswer,
    FleetNode,
    FleetState,
    NodeState,
    Quarantine,
    SelfTestResult,
    p_healthy,
)
from stayalive.core.fleet.rules import FleetError

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LATER = T0 + timedelta(minutes=5)


def pool(**states: NodeState) -> FleetState:
    """A fleet of the given nodes in the given states, none assigned."""
    return FleetState(nodes={n: node(n, s) for n, s in states.items()})


def node(id: str, state: NodeState = NodeState.HEALTHY) -> FleetNode:
    return FleetNode(id=id, rack="r1", hub=hub(id), state=state, since=T0)


def hub(node: str) -> str:
    return f"{node}.example:7000"


def passed(node: str, ok: bool = True) -> SelfTestResult:
    checks = {"gemm": ok, "repeatability": True, "collective": True}
    return SelfTestResult(node=node, passed=ok, checks=checks, detail="gemm ok" if ok else "gemm wrong", at=LATER)


# -- acquire ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "assigned_to", "granted", "reason"),
    [
        (NodeState.HEALTHY, None, True, None),
        (NodeState.SPARE, None, True, None),
        (NodeState.SUSPECT, None, True, None),
        (NodeState.HEALTHY, "r1", True, None),  # already this run's: a retried request
        (NodeState.HEALTHY, "r7", False, "n2 is running r7"),
        (NodeState.SUSPECT, "r7", False, "n2 is running r7"),
    ],
)
def test_acquire_grants_usable_free_nodes(
    state: NodeState, assigned_to: str | None, granted: bool, reason: str | None
) -> None:
    fleet_state = pool(n2=state)
    fleet_state.nodes["n2"].run_id = assigned_to
    got, refused = rules.acquire(fleet_state, "r1", ["n2"], LATER)
    assert got == (["n2"] if granted else [])
    assert refused == ({"n2": reason} if reason else {})
    assert fleet_state.nodes["n2"].run_id == ("r1" if granted else assigned_to)


def test_acquire_refuses_quarantined_and_tested_nodes_with_the_reason() -> None:
    state = pool(n1=NodeState.HEALTHY, n2=NodeState.HEALTHY, n3=NodeState.HEALTHY)
    rules.quarantine(state, "n2", "crash in rank 3", "r1", T0)
    rules.quarantine(state, "n3", "wrong loss", "r1", T0)
    rules.quarantine(state, "n3", "wrong loss", "r2", T0)
    rules.start_self_test(state, "n3", T0)
    granted, refused = rules.acquire(state, "r9", ["n1", "n2", "n3", "n9"], LATER)
    assert granted == ["n1"]
    assert refused == {
        "n2": "n2 is quarantined: crash in rank 3 (run r1)",
        "n3": "n3 is under self-test after quarantine: wrong loss (runs r1, r2)",
        "n9": "n9 is not registered: its node agent has not started",
    }


def test_a_spare_lent_to_a_run_comes_back_a_spare() -> None:
    state = FleetState()
    rules.register(state, "n1", "r1", hub("n1"), spare=False, now=T0)
    rules.register(state, "n3", "r2", hub("n3"), spare=True, now=T0)
    assert state.nodes["n3"].state == NodeState.SPARE
    assert rules.acquire(state, "r1", ["n1", "n3"], LATER) == (["n1", "n3"], {})
    assert state.nodes["n3"].state == NodeState.HEALTHY  # in the group now, no longer idle
    assert rules.release(state, "r1", LATER) == ["n1", "n3"]
    assert {n.id: (n.state, n.run_id) for n in state.nodes.values()} == {
        "n1": (NodeState.HEALTHY, None),
        "n3": (NodeState.SPARE, None),
    }


def test_take_spare_takes_the_first_idle_candidate() -> None:
    state = pool(n1=NodeState.HEALTHY, n2=NodeState.QUARANTINED, n3=NodeState.SPARE, n4=NodeState.SPARE)
    state.nodes["n1"].run_id = "r7"
    assert rules.take_spare(state, "r1", ["n9", "n1", "n2", "n3", "n4"], LATER) == "n3"
    assert (state.nodes["n3"].state, state.nodes["n3"].run_id) == (NodeState.HEALTHY, "r1")
    assert rules.take_spare(state, "r1", ["n1", "n2"], LATER) is None


def test_take_spare_asked_again_gives_the_same_spare() -> None:
    """A local activity that quarantines and takes a spare runs again when its workflow task fails:
    the second attempt must find the spare the first one took, not leave the run short of a node."""
    state = pool(n3=NodeState.SPARE, n4=NodeState.SPARE)
    assert rules.take_spare(state, "r1", ["n3", "n4"], LATER) == "n3"
    assert rules.take_spare(state, "r1", ["n3", "n4"], LATER) == "n3"
    assert rules.take_spare(state, "r2", ["n3", "n4"], LATER) == "n4"  # another run's request is not a retry
    assert {n: state.nodes[n].run_id for n in ("n3", "n4")} == {"n3": "r1", "n4": "r2"}


def test_registering_again_keeps_a_node_out_of_the_pool_and_in_its_run() -> None:
    state = pool(n1=NodeState.HEALTHY, n2=NodeState.HEALTHY)
    rules.acquire(state, "r1", ["n1"], T0)
    rules.quarantine(state, "n2", "crash in rank 3", "r1", T0)
    rules.register(state, "n1", "r1", hub("n1"), spare=True, now=LATER)
    rules.register(state, "n2", "r1", hub("n2"), spare=False, now=LATER)
    assert (state.nodes["n1"].state, state.nodes["n1"].run_id) == (NodeState.HEALTHY, "r1")
    assert state.nodes["n2"].state == NodeState.QUARANTINED


# -- quarantine and self-test ----------------------------------------------------------------------


def test_quarantine_takes_the_node_from_its_run_and_one_record_collects_every_run() -> None:
    state = pool(n2=NodeState.HEALTHY)
    rules.acquire(state, "r1", ["n2"], T0)
    first = rules.quarantine(state, "n2", "crash in rank 3", None, T0)  # an operator's call
    again = rules.quarantine(state, "n2", "hang", "r2", LATER)
    assert again is first
    assert len(state.quarantines()) == 1
    assert first.reason == "crash in rank 3"
    assert first.run_ids_affected == ["r1", "r2"]  # r1 held the node, r2 reported it later
    assert (state.nodes["n2"].state, state.nodes["n2"].run_id) == (NodeState.QUARANTINED, None)
    assert rules.release(state, "r1", LATER) == []


@pytest.mark.parametrize(("spare", "back_as"), [(False, NodeState.HEALTHY), (True, NodeState.SPARE)])
def test_a_passed_self_test_returns_the_node_and_closes_its_record(spare: bool, back_as: NodeState) -> None:
    state = FleetState()
    rules.register(state, "n2", "r1", hub("n2"), spare=spare, now=T0)
    record = rules.quarantine(state, "n2", "crash in rank 3", "r1", T0)
    rules.start_self_test(state, "n2", T0)
    assert state.nodes["n2"].state == NodeState.TESTING
    rules.finish_self_test(state, passed("n2"), LATER)
    assert state.nodes["n2"].state == back_as
    assert record.released_at == LATER
    assert [t.passed for t in record.self_tests] == [True]
    assert rules.acquire(state, "r2", ["n2"], LATER) == (["n2"], {})


def test_a_failed_self_test_keeps_the_node_out_and_the_record_open() -> None:
    state = pool(n2=NodeState.HEALTHY)
    record = rules.quarantine(state, "n2", "wrong loss", "r1", T0)
    rules.start_self_test(state, "n2", T0)
    rules.finish_self_test(state, passed("n2", ok=False), LATER)
    assert state.nodes["n2"].state == NodeState.QUARANTINED
    assert record.open
    assert record.self_tests[-1].detail == "gemm wrong"
    assert rules.acquire(state, "r2", ["n2"], LATER)[1] == {"n2": "n2 is quarantined: wrong loss (run r1)"}
    # After a repair the retest passes; the second quarantine of the same node opens a new record.
    rules.start_self_test(state, "n2", LATER)
    rules.finish_self_test(state, passed("n2"), LATER)
    assert not record.open
    rules.quarantine(state, "n2", "hang", "r3", LATER)
    assert [q.reason for q in state.quarantines()] == ["wrong loss", "hang"]


def test_suspect_nodes_stay_usable_and_a_quarantined_one_stays_out() -> None:
    state = pool(n1=NodeState.HEALTHY, n2=NodeState.QUARANTINED)
    rules.mark_suspect(state, "n1", "slow steps", T0)
    rules.mark_suspect(state, "n2", "slow steps", T0)
    assert (state.nodes["n1"].state, state.nodes["n1"].note) == (NodeState.SUSPECT, "slow steps")
    assert state.nodes["n2"].state == NodeState.QUARANTINED
    assert rules.acquire(state, "r1", ["n1"], LATER) == (["n1"], {})


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (lambda s: rules.quarantine(s, "n9", "crash", "r1", T0), "'n9' is not a node of this fleet"),
        (lambda s: rules.quarantine(s, "n1", " ", "r1", T0), "quarantine reason is empty"),
        (lambda s: rules.quarantine(s, "n1", "crash", "", T0), "run_id is empty"),
        (lambda s: rules.start_self_test(s, "n1", T0), "n1 is healthy: only a quarantined node is self-tested"),
        (lambda s: rules.start_self_test(s, "n3", T0), "n3 is already being self-tested"),
        (lambda s: rules.finish_self_test(s, passed("n1"), T0), "n1 is healthy, not under test"),
        (lambda s: rules.acquire(s, "", ["n1"], T0), "run_id is empty"),
        (lambda s: rules.acquire(s, "r1", [], T0), "no nodes wanted"),
        (lambda s: rules.register(s, "N 1", "r1", hub("n1"), False, T0), "node id 'N 1' must be lowercase"),
        (lambda s: rules.register(s, "n4", "", hub("n4"), False, T0), "rack is empty"),
        (lambda s: rules.register(s, "n4", "r1", "n4", False, T0), "hub 'n4' is not host:port"),
        (lambda s: rules.record_eviction(s, "n9", "r1", True, T0), "'n9' is not a node"),
        (lambda s: rules.record_baseline(s, "abc", [1.0, 0.0]), "not a step time"),
        (lambda s: rules.record_baseline(s, "abc", [float("nan")]), "not a step time"),
        (lambda s: rules.record_baseline(s, "abc", []), "no step times"),
    ],
)
def test_impossible_requests_are_refused_with_the_reason(
    request_: Callable[[FleetState], object], message: str
) -> None:
    state = pool(n1=NodeState.HEALTHY, n2=NodeState.QUARANTINED, n3=NodeState.TESTING)
    before = state.model_copy(deep=True)
    with pytest.raises(FleetError, match=message):
        request_(state)
    assert state == before  # refused means nothing changed


# -- what the fleet learns -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resolved", "total", "expected"),
    [(0, 0, 0.5), (1, 1, 2 / 3), (0, 1, 1 / 3), (9, 10, 10 / 12), (0, 10, 1 / 12)],
)
def test_p_healthy_starts_at_even_odds_and_follows_the_history(resolved: int, total: int, expected: float) -> None:
    outcomes = [EvictionOutcome(node="n1", run_id="r1", at=T0, resolved=i < resolved) for i in range(total)]
    assert p_healthy(outcomes) == pytest.approx(expected)


def test_p_healthy_without_a_prior_is_the_plain_fraction() -> None:
    outcomes = [EvictionOutcome(node="n1", run_id="r1", at=T0, resolved=r) for r in (True, True, False, True)]
    assert p_healthy(outcomes, prior_resolved=0, prior_total=0) == 0.75


def test_recorded_evictions_feed_p_healthy() -> None:
    state = pool(n1=NodeState.HEALTHY)
    rules.record_eviction(state, "n1", "r1", resolved=True, now=T0)
    rules.record_eviction(state, "n1", "r2", resolved=True, now=LATER)
    assert p_healthy(state.evictions) == pytest.approx(3 / 4)


def test_baseline_median_and_mad_ignore_one_slow_window() -> None:
    baseline = Baseline(config_digest="abc", step_seconds=[1.0, 1.1, 0.9, 1.0, 9.0])
    assert baseline.median == 1.0
    # |x - 1.0| = 0, 0.1, 0.1, 0, 8 → median 0.1, scaled to σ by 1.4826
    assert baseline.mad == pytest.approx(0.14826)


def test_record_baseline_keeps_the_newest_window_medians_per_config() -> None:
    state = FleetState()
    rules.record_baseline(state, "abc", [1.0 + i for i in range(BASELINE_WINDOW)])
    for i in range(BASELINE_WINDOW, BASELINE_WINDOW + 50):
        rules.record_baseline(state, "abc", [1.0 + i])
    rules.record_baseline(state, "other", [2.0])
    kept = state.baselines["abc"].step_seconds
    assert len(kept) == BASELINE_WINDOW
    assert (kept[0], kept[-1]) == (51.0, 250.0)
    assert state.baselines["other"].step_seconds == [2.0]


def test_history_that_rides_along_continue_as_new_is_capped() -> None:
    state = pool(n1=NodeState.HEALTHY)
    for i in range(KEEP_EVICTIONS + 5):
        rules.record_eviction(state, "n1", f"r{i}", resolved=True, now=T0)
    assert len(state.evictions) == KEEP_EVICTIONS
    assert state.evictions[0].run_id == "r5"
    rules.quarantine(state, "n1", "still broken", "r0", T0)  # an open record is never dropped
    state.nodes["n2"] = node("n2")
    for i in range(KEEP_CLOSED_QUARANTINES + 3):
        rules.quarantine(state, "n2", f"fault {i}", None, T0)
        rules.start_self_test(state, "n2", T0)
        rules.finish_self_test(state, passed("n2"), LATER)
    reasons = [q.reason for q in state.quarantines()]  # closed records first, then open ones
    assert len(reasons) == KEEP_CLOSED_QUARANTINES + 1
    assert (reasons[0], reasons[-1]) == ("fault 3", "still broken")


def test_empty_baseline_cannot_exist() -> None:
    with pytest.raises(ValueError, match="at least 1 item"):
        Baseline(config_digest="abc", step_seconds=[])


@pytest.mark.parametrize(
    ("runs", "earlier", "cause"),
    [
        ([], 0, "crash"),
        (["r1"], 0, "crash (run r1)"),
        (["r1", "r2"], 0, "crash (runs r1, r2)"),
        (["r9"], 3, "crash (runs r9 and 3 earlier)"),
    ],
)
def test_a_records_cause_names_the_runs_it_hurt(runs: list[str], earlier: int, cause: str) -> None:
    record = Quarantine(node="n1", reason="crash", since=T0, run_ids_affected=runs, earlier_runs=earlier)
    assert record.cause() == cause


def test_a_record_keeps_the_newest_runs_and_self_tests_and_counts_the_rest() -> None:
    state = pool(n1=NodeState.HEALTHY)
    for run in range(KEEP_RUNS_PER_QUARANTINE + 2):
        rules.quarantine(state, "n1", "crash", f"r{run}", T0)
    for _ in range(KEEP_SELF_TESTS_PER_QUARANTINE + 1):
        rules.start_self_test(state, "n1", T0)
        rules.finish_self_test(state, passed("n1", ok=False), LATER)
    record = state.quarantined["n1"]
    assert (record.run_ids_affected[0], record.run_ids_affected[-1], record.earlier_runs) == ("r2", "r9", 2)
    assert (len(record.self_tests), record.earlier_self_tests) == (KEEP_SELF_TESTS_PER_QUARANTINE, 1)


def test_free_text_is_kept_short() -> None:
    state = pool(n1=NodeState.HEALTHY, n2=NodeState.HEALTHY)
    record = rules.quarantine(state, "n1", "x" * 1000, None, T0)
    rules.mark_suspect(state, "n2", "slow " * 100, T0)
    rules.start_self_test(state, "n1", T0)
    rules.finish_self_test(state, passed("n1", ok=False).model_copy(update={"detail": "y" * 1000}), T0)
    kept = (record.reason, state.nodes["n2"].note, record.self_tests[0].detail)
    assert [len(text) for text in kept] == [TEXT_LIMIT] * 3
    assert all(text.endswith("…") for text in kept)


def test_an_agent_back_on_another_port_is_found_there() -> None:
    state = FleetState()
    rules.register(state, "n1", "r1", "10.0.0.1:7000", spare=False, now=T0)
    rules.register(state, "n1", "r1", "10.0.0.1:7001", spare=False, now=LATER)
    assert state.nodes["n1"].hub == "10.0.0.1:7001"


def test_an_unknown_node_is_refused_with_a_few_of_the_known_ones() -> None:
    state = pool(**{f"n{i}": NodeState.HEALTHY for i in range(20)})
    with pytest.raises(FleetError, match=r"registered: n0, n1, n2, n3, n4, n5, n6, n7, … 12 more\)$"):
        rules.mark_suspect(state, "n99", "slow", T0)


def test_baselines_are_kept_for_the_configurations_taught_most_recently() -> None:
    state = FleetState()
    for digest in range(KEEP_BASELINES + 1):
        rules.record_baseline(state, f"d{digest}", [1.0])
    rules.record_baseline(state, "d1", [1.1234567891])  # taught again: now the newest
    assert list(state.baselines) == [f"d{d}" for d in (2, 3, 4, 5, 6, 7, 8, 1)]
    assert state.baselines["d1"].step_seconds == [1.0, 1.123457]  # to the microsecond


# -- how the state is carried ----------------------------------------------------------------------


def test_the_state_comes_back_whole_from_its_compact_form() -> None:
    state = pool(n1=NodeState.HEALTHY, n2=NodeState.SPARE, n3=NodeState.HEALTHY, n4=NodeState.HEALTHY)
    state.nodes["n2"].spare = True
    rules.acquire(state, "r1", ["n1", "n3"], LATER)
    rules.mark_suspect(state, "n3", "slow steps", LATER)
    rules.quarantine(state, "n4", "crash", "r2", LATER)
    rules.record_eviction(state, "n1", "r0", resolved=True, now=T0)
    rules.record_baseline(state, "abc", [1.0, 1.5])
    state.keep_answer("req-1", FleetAnswer(result=["n1"]))
    state.keep_answer("req-2", FleetAnswer(error="run_id is empty"))
    carried = to_json(state)
    assert b'"rows":[["n1","r1","n1.example:7000",1767225900]' in carried  # a row per node, since in seconds
    assert FleetState.model_validate_json(carried) == state


def test_answers_are_kept_newest_and_the_newest_few_carried() -> None:
    state = FleetState()
    for i in range(KEEP_ANSWERS + 2):
        state.keep_answer(f"req-{i}", FleetAnswer(result=i))
    assert (len(state.answers), next(iter(state.answers))) == (KEEP_ANSWERS, "req-2")
    carried = state.carried().answers
    assert 0 < len(carried) < KEEP_ANSWERS
    assert list(carried) == list(state.answers)[-len(carried) :]
    assert len(to_json(carried)) <= CARRIED_ANSWER_BYTES


# -- the fleet's failure rate: the baseline paging compares a run with ----------------------------

HOUR = 3600.0
PRIOR_GPU_HOURS = 5 / PUBLISHED_FAILURES_PER_GPU_HOUR  # the published rate weighs as five failures


@pytest.mark.parametrize(
    ("gpu_hours", "failures", "gpus", "mtbf_hours"),
    [
        (0.0, 0, 16_384, 54 * 24 / 419),  # a new fleet pages by Llama 3's 3.09 h at its width ...
        (0.0, 0, 1_024, 54 * 24 / 419 * 16),  # ... and 49.5 h at 1,024 GPUs (the rate scales with GPUs)
        (PRIOR_GPU_HOURS, 5, 1_024, 54 * 24 / 419 * 16),  # its own history agrees: nothing moves
        (PRIOR_GPU_HOURS, 15, 1_024, 54 * 24 / 419 * 16 / 2),  # twice the published rate, weighed with it
        (1e9, 0, 1_024, (1e9 + PRIOR_GPU_HOURS) / 5 / 1_024),  # a billion quiet GPU-hours: only the prior fails
    ],
)
def test_the_fleet_rate_starts_from_the_published_one_and_learns(
    gpu_hours: float, failures: int, gpus: int, mtbf_hours: float
) -> None:
    rate = FailureRate(gpu_hours=gpu_hours, failures=failures)
    assert rate.mtbf_s(gpus) / HOUR == pytest.approx(mtbf_hours, rel=1e-9)


def test_exposure_adds_up_in_the_fleet() -> None:
    fleet = FleetState()
    rules.record_exposure(fleet, 1_000.0, 1)
    rate = rules.record_exposure(fleet, 500.0, 0)
    assert (rate.gpu_hours, rate.failures) == (1_500.0, 1) and fleet.failure_rate is rate
