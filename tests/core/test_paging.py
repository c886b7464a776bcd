"""Paging on the pattern, not the count (docs/architecture.md §12): every rule of `classify`, its edges, and which
rule wins when several match."""

from __future__ import annotations

from datetime import timedelta

import pytest

from stayalive.core.decisions.paging import STORAGE_OUTAGE_INTERVALS, classify, over_limit, storage_outage
from stayalive.core.run.spec import FailureLimit
from stayalive.core.run.timeline import PLANNED, PLANNED_CAUSES, Cause, Interruption, PagingClass
from tests.core.runs import at, interruption

HOUR = 3600.0
LLAMA3_MTBF = 54 * 24 * HOUR / 419  # 3.1 h at 16,384 GPUs (Llama 3, arXiv:2407.21783, §3.3.4)
PRIOR_MTBF = 6 * HOUR  # CheckpointSpec.prior_mtbf's default: what the workflow passes today


def crash(hours: float, node: str, step: int, cause: Cause = Cause.CRASH, generation: int = 0) -> Interruption:
    return interruption(at(hours=hours), cause, node=node, step=step, generation=generation)


INDEPENDENT = (PagingClass.INDEPENDENT, "independent")
SAME_STEP = (PagingClass.DETERMINISTIC, "same step twice")
SAME_NODE = (PagingClass.CORRELATED, "same node twice")
RATE = (PagingClass.CORRELATED, "failure rate anomaly")
COLLAPSE = (PagingClass.CORRELATED, "goodput collapse")

CASES = [
    # -- independent failures never page (3 in 12 hours is the norm at 3.1 h: docs/architecture.md §12) -
    pytest.param(
        [crash(0.5, "n1", 100), crash(6.0, "n2", 900)], crash(12.0, "n3", 1700), LLAMA3_MTBF, 0.9, INDEPENDENT,
        id="3 crashes in 12 h, different nodes and steps",
    ),
    pytest.param(
        [crash(11.5, "n1", 1600)], crash(12.0, "n2", 1700), LLAMA3_MTBF, None, INDEPENDENT,
        id="2 in an hour is 28% likely at 3.1 h: no page",
    ),
    pytest.param([], crash(0.2, "n1", 10), LLAMA3_MTBF, None, INDEPENDENT, id="the first failure"),
    # -- same node twice: quarantine did not hold it out ------------------------------------------------
    pytest.param(
        [crash(1.0, "n1", 100)], crash(20.0, "n1", 2500), PRIOR_MTBF, None, SAME_NODE, id="same node, 19 h apart"
    ),
    pytest.param(
        [crash(1.0, "n1", 100, Cause.NODE_LOST)], crash(5.0, "n1", 700, Cause.HANG), PRIOR_MTBF, None, SAME_NODE,
        id="same node, different causes",
    ),
    pytest.param(
        [interruption(at(hours=1), Cause.HANG, node=None, step=100)],
        interruption(at(hours=5), Cause.HANG, node=None, step=700),
        PRIOR_MTBF, None, INDEPENDENT,
        id="no culprit named twice is not the same node",
    ),
    # -- failure rate over the last hour > 5x the baseline -----------------------------------------------
    pytest.param(
        [crash(10.0, "n1", 100), crash(10.4, "n2", 160)], crash(10.9, "n3", 230), PRIOR_MTBF, None, RATE,
        id="3 in 54 min at a 6 h MTBF: 18x",
    ),
    pytest.param(
        [crash(10.0, "n1", 100), crash(10.4, "n2", 160)], crash(11.1, "n3", 230), PRIOR_MTBF, None, INDEPENDENT,
        id="the first fell 66 min before: outside the hour",
    ),
    pytest.param(
        [crash(10.0, "n1", 100), crash(10.4, "n2", 160)], crash(10.9, "n3", 230), 0.5 * HOUR, None, INDEPENDENT,
        id="3 in an hour at a 30 min MTBF: 1.5x",
    ),
    # -- goodput over the last hour below 0.3 ----------------------------------------------------------
    pytest.param([crash(1.0, "n1", 100)], crash(9.0, "n2", 900), PRIOR_MTBF, 0.29, COLLAPSE, id="goodput 0.29"),
    pytest.param([crash(1.0, "n1", 100)], crash(9.0, "n2", 900), PRIOR_MTBF, 0.30, INDEPENDENT, id="goodput 0.30"),
    # -- the same step twice: data or code ---------------------------------------------------------------
    pytest.param(
        [crash(1.0, "n1", 500)], crash(3.0, "n2", 500, generation=1), PRIOR_MTBF, None, SAME_STEP,
        id="crash at step 500 twice, different nodes",
    ),
    pytest.param(
        [crash(1.0, "n1", 500)], crash(3.0, "n2", 500, Cause.HANG, generation=1), PRIOR_MTBF, None, SAME_STEP,
        id="a crash then a hang at step 500",
    ),
    pytest.param(
        [crash(1.0, "n1", 500, Cause.NODE_LOST)], crash(1.2, "n2", 500, Cause.NODE_LOST), PRIOR_MTBF, None,
        INDEPENDENT,
        id="two lost nodes with no step between: their step is the last known, not where they died",
    ),
    # -- precedence: the first rule that matches decides -----------------------------------------------
    pytest.param(
        [crash(1.0, "n1", 500)], crash(1.5, "n1", 500), PRIOR_MTBF, 0.1, SAME_STEP,
        id="same step beats same node and collapse",
    ),
    pytest.param(
        [crash(10.0, "n1", 100), crash(10.4, "n2", 160)], crash(10.9, "n1", 230), PRIOR_MTBF, 0.1, SAME_NODE,
        id="same node beats rate and collapse",
    ),
    pytest.param(
        [crash(10.0, "n1", 100), crash(10.4, "n2", 160)], crash(10.9, "n3", 230), PRIOR_MTBF, 0.1, RATE,
        id="rate beats collapse",
    ),
    # -- planned interruptions count towards no rule -----------------------------------------------------
    pytest.param(
        [crash(1.0, "n1", 100, Cause.DRAIN)], crash(5.0, "n1", 700), PRIOR_MTBF, None, INDEPENDENT,
        id="drained, then crashed: one failure of n1",
    ),
    pytest.param(
        [crash(10.0, "n1", 100, Cause.PAUSE), crash(10.4, "n2", 160, Cause.DRAIN)], crash(10.9, "n3", 230),
        PRIOR_MTBF, None, INDEPENDENT,
        id="a pause and a drain are not a failure rate",
    ),
    pytest.param(
        [crash(1.0, "n1", 500, Cause.ROLLBACK)], crash(3.0, "n2", 500), PRIOR_MTBF, None, INDEPENDENT,
        id="rolled back at step 500, then crashed there",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("history", "latest", "baseline_mtbf", "goodput", "expected"), CASES)
def test_classify(
    history: list[Interruption],
    latest: Interruption,
    baseline_mtbf: float,
    goodput: float | None,
    expected: tuple[PagingClass, str],
) -> None:
    verdict = classify(history, latest, baseline_mtbf, goodput)
    assert (verdict.paging, verdict.rule) == expected, verdict.evidence


@pytest.mark.parametrize("cause", sorted(PLANNED_CAUSES))
def test_a_planned_interruption_is_planned_whatever_its_history(cause: str) -> None:
    history = [crash(1.0, "n1", 500), crash(1.2, "n2", 600), crash(1.4, "n3", 700)]
    assert classify(history, crash(1.5, "n1", 500, Cause(cause)), PRIOR_MTBF, 0.0) == PLANNED


def test_planned_causes_are_the_runs_planned_causes() -> None:
    assert {Cause.DRAIN, Cause.PAUSE, Cause.ROLLBACK} == PLANNED_CAUSES


def test_evidence_names_the_earlier_failure_at_that_step() -> None:
    history = [crash(1.0, "n1", 300, Cause.HANG, generation=0), crash(2.0, "n2", 500, Cause.CRASH, generation=1)]
    verdict = classify(history, crash(3.0, "n3", 500, Cause.HANG, generation=2), PRIOR_MTBF, None)
    assert verdict.evidence == "hang at step 500 again (also crash in generation 1)"
    assert "stop the run" in verdict.action


# -- the failure limit: a rate over a window, never the run's length ---------------------------------
def every(hours: float, count: int, cause: Cause = Cause.CRASH, start: float = 0.0) -> list[Interruption]:
    """`count` interruptions `hours` apart, on different nodes and steps."""
    return [crash(start + n * hours, f"n{n}", 100 * n + 1, cause) for n in range(count)]


DEFAULT_LIMIT = FailureLimit()  # 20 failures within 6 h

LIMIT_CASES = [
    pytest.param(
        every(LLAMA3_MTBF / HOUR, 232), DEFAULT_LIMIT, None, id="a month at 16,384 GPUs: 233 failures, 3.1 h apart"
    ),
    pytest.param(every(0.3, 20), DEFAULT_LIMIT, None, id="20 failures in 6 h is the limit itself"),
    pytest.param(every(0.28, 20), DEFAULT_LIMIT, "21 failures within 6h", id="the 21st within 6 h gives up"),
    pytest.param(
        [*every(0.01, 20), crash(6.5, "n-late", 77_777)], DEFAULT_LIMIT, None, id="20 at once, then 6 h of calm"
    ),
    pytest.param(
        every(0.01, 100, Cause.DRAIN) + every(0.01, 100, Cause.PAUSE, 1) + every(0.01, 100, Cause.ROLLBACK, 2),
        FailureLimit(failures=3),
        None,
        id="300 planned interruptions in 3 h never count",
    ),
    pytest.param(every(0.1, 3), FailureLimit(failures=3, window=3600), "4 failures within 1h", id="a tight limit"),
    pytest.param(every(0.1, 3), FailureLimit(failures=3, window=60), None, id="a 1 min window: 6 min apart is slow"),
]


@pytest.mark.parametrize(("history", "limit", "verdict"), LIMIT_CASES)
def test_the_run_gives_up_only_when_failures_come_too_fast(
    history: list[Interruption], limit: FailureLimit, verdict: str | None
) -> None:
    # The latest failure comes 0.3 h after the last of `history` (on its own node and step).
    last = max((i.at for i in history), default=at(hours=0))
    latest = interruption(last + timedelta(hours=0.3), Cause.CRASH, node="n-latest", step=999_999)
    found = over_limit(history, latest, limit)
    if verdict is None:
        assert found is None
    else:
        assert found is not None and verdict in found and "failure_limit" in found and "n-latest" in found


def test_a_planned_interruption_is_never_over_the_limit() -> None:
    history = every(0.01, 50)
    drain = interruption(at(hours=1), Cause.DRAIN, node="n1", step=5)
    assert over_limit(history, drain, FailureLimit(failures=1)) is None


# -- a storage outage: recorded at once, a person once it outlasts three checkpoint intervals ----------
STORAGE_CASES = [
    pytest.param(5.0, 780.0, PagingClass.INDEPENDENT, id="a 5 s blip at a 13 min interval"),
    pytest.param(3 * 780.0, 780.0, PagingClass.INDEPENDENT, id="exactly three intervals"),
    pytest.param(3 * 780.0 + 1, 780.0, PagingClass.CORRELATED, id="past three intervals"),
    pytest.param(4 * 3600.0, 780.0, PagingClass.CORRELATED, id="four hours"),
    pytest.param(1.0, 0.25, PagingClass.CORRELATED, id="1 s at a 0.25 s interval: four intervals of work exposed"),
    pytest.param(3600.0, 0.0, PagingClass.INDEPENDENT, id="no step time measured yet: no interval to count in"),
]


@pytest.mark.parametrize(("lasted_s", "interval_s", "expected"), STORAGE_CASES)
def test_a_storage_outage_wants_a_person_past_three_checkpoint_intervals(
    lasted_s: float, interval_s: float, expected: PagingClass
) -> None:
    verdict = storage_outage(lasted_s, interval_s, "[Errno 2] No such file or directory")
    assert (verdict.paging, verdict.rule) == (expected, "storage outage")
    assert "No such file or directory" in verdict.evidence


def test_the_storage_page_says_what_is_at_risk() -> None:
    assert STORAGE_OUTAGE_INTERVALS == 3
    verdict = storage_outage(4000.0, 780.0, "ENOSPC")
    assert "5.1 checkpoint intervals" in verdict.evidence
    assert "host memory only" in verdict.action and "rolls back" in verdict.action
