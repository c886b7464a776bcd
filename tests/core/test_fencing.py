"""A partition told from a dead node after the fact, and the generation number as a fencing token."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from stayalive.core.decisions.fencing import PartitionReport, amend, cut_off, fenced_out, raised
from stayalive.core.run.timeline import Cause, Interruption

AT = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("fence", "generation", "out"),
    [(None, 0, False), (None, 3, False), (2, 1, True), (2, 2, False), (2, 3, False), (5, 0, True)],
)
def test_a_writer_older_than_the_fence_is_fenced_out(fence: int | None, generation: int, out: bool) -> None:
    assert fenced_out(fence, generation) is out


@pytest.mark.parametrize(("fence", "generation", "after"), [(None, 0, 0), (None, 4, 4), (3, 4, 4), (4, 2, 4)])
def test_the_fence_never_goes_down(fence: int | None, generation: int, after: int) -> None:
    assert raised(fence, generation) == after


@pytest.mark.parametrize(
    ("last_read", "now", "cut"), [(100.0, 100.5, False), (100.0, 160.0, False), (100.0, 160.1, True)]
)
def test_unread_past_the_bound_is_cut_off(last_read: float, now: float, cut: bool) -> None:
    assert cut_off(last_read, now, bound=60.0) is cut


def lost(node: str, generation: int, cause: Cause = Cause.NODE_LOST) -> Interruption:
    return Interruption(
        at=AT, generation=generation, detected_by="node agent heartbeat timeout", cause=cause, node=node
    )


def report(node: str, generation: int) -> PartitionReport:
    return PartitionReport(node=node, run_id="r/1", generation=generation, since=0.0, fenced_at=60.0, stopped=2)


@pytest.mark.parametrize(
    ("timeline", "reported", "amended"),
    [
        ([lost("n2", 0)], report("n2", 0), 0),
        ([lost("n1", 0), lost("n2", 1)], report("n2", 1), 1),
        ([lost("n2", 0)], report("n2", 1), None),  # another generation: nothing of it was lost
        ([lost("n2", 0)], report("n1", 0), None),  # another node
        ([lost("n2", 0, Cause.CRASH)], report("n2", 0), None),  # a crash stays a crash
    ],
)
def test_the_reported_generations_lost_node_becomes_a_partition(
    timeline: list[Interruption], reported: PartitionReport, amended: int | None
) -> None:
    causes = [i.cause for i in timeline]
    found = amend(timeline, reported)
    if amended is None:
        assert found is None and [i.cause for i in timeline] == causes
    else:
        assert found is timeline[amended] and found.cause == Cause.PARTITION
        assert "fenced itself out of generation" in found.actions[-1]
        assert [i.cause for i in timeline if i is not found] == [c for i, c in enumerate(causes) if i != amended]


def test_a_second_report_changes_nothing() -> None:
    timeline = [lost("n2", 0)]
    amend(timeline, report("n2", 0))
    assert amend(timeline, report("n2", 0)) is None and len(timeline[0].actions) == 1
