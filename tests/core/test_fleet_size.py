"""FleetState rides along every continue-as-new of the fleet: at 2,048 nodes with every cap full, as
the data converter writes it, it stays well under a payload's 256 KiB."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic_core import to_json, to_jsonable_python

from stayalive.core.fleet import rules
from stayalive.core.fleet.model import (
    BASELINE_WINDOW,
    KEEP_ANSWERS,
    KEEP_BASELINES,
    KEEP_CLOSED_QUARANTINES,
    KEEP_ECC_POINTS,
    KEEP_ECC_TRENDS,
    KEEP_EVICTIONS,
    KEEP_RUNS_PER_QUARANTINE,
    KEEP_SELF_TESTS_PER_QUARANTINE,
    TEXT_LIMIT,
    FleetAnswer,
    FleetState,
    SelfTestResult,
)

NODES = 2048
OPEN_QUARANTINES = 8  # a rack out, every record at its largest
BOUND = 192 * 1024  # bytes: three quarters of the 256 KiB at which a payload is too big
T0 = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "gpt-405b-pretrain/1a2b3c4d"  # a RunWorkflow run id: workflow id / first run id


def failed(node: str, at: datetime) -> SelfTestResult:
    return SelfTestResult(
        node=node,
        passed=False,
        checks={"gemm": False, "repeatability": True, "collective": True},
        detail="x" * 999,
        at=at,
    )


def worst_case() -> FleetState:
    """Every node its own registration time and hub, in a run; the largest records of every kind."""
    state = FleetState()
    for i in range(NODES):
        hub = f"10.{128 + i // 256}.{i % 256}.17:29400"
        rules.register(
            state, f"node-{i:04d}", f"rack-{i // 8:03d}", hub, spare=i % 64 == 0, now=T0 + timedelta(seconds=i)
        )
    later = T0 + timedelta(days=1)
    rules.acquire(state, RUN, list(state.nodes), later)
    for i in range(KEEP_CLOSED_QUARANTINES + 3 + OPEN_QUARANTINES):
        node, now = f"node-{i:04d}", later + timedelta(minutes=i)
        for run in range(KEEP_RUNS_PER_QUARANTINE + 3):
            rules.quarantine(state, node, "hang in all_reduce " * 50, f"{RUN[:-2]}{run:02d}", now)
        for _ in range(KEEP_SELF_TESTS_PER_QUARANTINE + 2):
            rules.start_self_test(state, node, now)
            rules.finish_self_test(state, failed(node, now), now)
        if i < KEEP_CLOSED_QUARANTINES + 3:
            rules.start_self_test(state, node, now)
            rules.finish_self_test(state, failed(node, now).model_copy(update={"passed": True}), now)
        rules.mark_suspect(state, f"node-{NODES - 1 - i:04d}", "straggler: compute 2.3σ above the median " * 9, now)
    for i in range(KEEP_EVICTIONS + 10):
        rules.record_eviction(state, f"node-{i:04d}", f"{RUN[:-3]}{i:03d}", resolved=i % 2 == 0, now=later)
    for digest in range(KEEP_BASELINES + 2):
        windows = [0.123456789 + w / 7 for w in range(BASELINE_WINDOW + 10)]
        rules.record_baseline(state, f"{digest:064x}", windows)
    for i in range(KEEP_ECC_TRENDS + 10):  # hourly readings, the counts of a GPU wearing out fast
        for hour in range(KEEP_ECC_POINTS + 3):
            count = 10**12 + i * 10**8 + hour
            rules.record_corrected_errors(state, f"node-{i:04d}", later + timedelta(hours=hour), count)
    for i in range(KEEP_ANSWERS + 10):  # registrations' answers, as a run's activity names its requests
        registered = to_jsonable_python(state.nodes[f"node-{i % NODES:04d}"])
        state.keep_answer(f"{RUN}/{RUN[-8:]}-0000-0000-0000-000000000000/{i}", FleetAnswer[Any](result=registered))
    return state


def test_the_worst_case_fleet_is_carried_well_under_a_payloads_limit() -> None:
    state = worst_case()
    assert len(state.released) == KEEP_CLOSED_QUARANTINES
    assert len(state.quarantined) == OPEN_QUARANTINES
    assert len(state.answers) == KEEP_ANSWERS
    assert len(state.ecc_trends) == KEEP_ECC_TRENDS
    assert all(len(t.points) == KEEP_ECC_POINTS for t in state.ecc_trends.values())
    carried = state.carried()
    size = len(to_json(carried))
    parts = {name: len(to_json(getattr(carried, name))) for name in FleetState.model_fields}
    parts["nodes"] = len(to_json(carried.model_dump(include={"nodes"})))
    print(f"FleetState at {NODES} nodes, carried: {size:,} bytes; {parts}")
    assert size < BOUND
    assert FleetState.model_validate_json(to_json(carried)) == carried


def test_a_record_stays_bounded_however_long_its_node_stays_out() -> None:
    state = worst_case()
    record = state.quarantined[f"node-{KEEP_CLOSED_QUARANTINES + 3:04d}"]
    assert len(record.run_ids_affected) == KEEP_RUNS_PER_QUARANTINE
    assert record.earlier_runs == 4  # 3 more runs than it lists, and the one holding the node
    assert (len(record.self_tests), record.earlier_self_tests) == (KEEP_SELF_TESTS_PER_QUARANTINE, 2)
    assert len(record.reason) == len(record.self_tests[0].detail) == TEXT_LIMIT
    assert record.cause().endswith(f"{RUN[:-2]}10 and 4 earlier)")
    assert len(to_json(record)) < 2048
