"""How the run monitor tells how a generation ends, from what its node agents report (core/monitor/watch.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from stayalive.agent.gpu import SimulatedTelemetry
from stayalive.core.messages.events import (
    FirstStep,
    GpuFailed,
    Hang,
    KeeperInput,
    MonitorInput,
    NodeLost,
    ProgressRefresh,
    RankFailed,
    RanksFinished,
    StorageOutage,
    ends_generation,
)
from stayalive.core.monitor.watch import WITNESS_GRACE_S, GenerationWatch
from stayalive.core.protocol.telemetry import (
    CheckpointCommitted,
    Finished,
    GpuReport,
    Held,
    NodeSteps,
    RankExited,
    RankStarted,
    Resumed,
    StorageUnavailable,
    pack_steps,
)
from stayalive.core.run.faults import GpuLost, NvlinkDegraded
from stayalive.core.run.status import Outage
from stayalive.core.run.timeline import PagingClass

NODES = ["a", "b", "c"]
SILENCE = 15.0


def watch(**overrides: object) -> GenerationWatch:
    input = MonitorInput(run_id="r/1", generation=2, nodes=NODES, ranks_per_node=2, node_silence=SILENCE)
    return GenerationWatch(input.model_copy(update=overrides), now=0.0, wall=1000.0)


def exited(rank: int, code: int, tail: str = "", generation: int = 2) -> RankExited:
    return RankExited(rank=rank, generation=generation, exit_code=code, at=1000.0, last_step=7, log_tail=tail)


PEER_LOST = "RuntimeError: [gloo] Connection closed by peer [10.0.0.2]:1234"


@pytest.mark.parametrize(
    ("exits", "culprit"),
    [
        ([("b", exited(3, 137))], (3, "b")),  # a rank killed: the culprit at once
        ([("a", exited(0, 1, PEER_LOST)), ("b", exited(3, 137))], (3, "b")),  # a witness, then the culprit
        ([("c", exited(5, 1, "ValueError: bad batch"))], (5, "c")),  # a rank's own error
    ],
)
def test_a_failed_rank_ends_the_generation_and_names_itself(
    exits: list[tuple[str, RankExited]], culprit: tuple[int, str]
) -> None:
    seen = watch()
    events = [seen.record(node, exit, now=1.0) for node, exit in exits]
    assert events[:-1] == [None] * (len(events) - 1)
    last = events[-1]
    assert isinstance(last, RankFailed) and (last.rank, last.node) == culprit


def test_a_witness_alone_ends_the_generation_once_its_wait_is_over() -> None:
    seen = watch()
    assert seen.record("a", exited(1, 1, PEER_LOST), now=1.0) is None
    for node in NODES:  # every agent keeps beating: nobody else failed
        seen.heard_from(node, 1.0 + SILENCE)
    assert seen.tick(1.0 + SILENCE + WITNESS_GRACE_S - 0.1, wall=1000.0) is None
    ended = seen.tick(1.0 + SILENCE + WITNESS_GRACE_S, wall=1000.0)
    assert isinstance(ended, RankFailed) and ended.rank == 1 and ended.peer_lost


def test_a_node_silent_for_longer_than_the_timeout_is_lost_whatever_else_waits() -> None:
    seen = watch()
    seen.record("a", exited(1, 1, PEER_LOST), now=1.0)  # its peer on b died with b's agent
    for node in ("a", "c"):
        seen.heard_from(node, SILENCE + 1)
    lost = seen.tick(SILENCE + 1, wall=1000.0)
    assert isinstance(lost, NodeLost) and lost.node == "b"


def test_every_rank_exiting_cleanly_finishes_the_generation() -> None:
    seen = watch()
    events = [seen.record(NODES[r // 2], exited(r, 0), now=1.0) for r in range(6)]
    assert events[:5] == [None] * 5 and isinstance(events[5], RanksFinished)


GRACE = 30.0


@pytest.mark.parametrize(
    ("hooks", "first"),
    [
        (False, exited(0, 0)),  # a plain script: a clean exit is all it says
        (True, Finished(rank=0, generation=2, step=40)),  # hooks: the rank says it reached the target
    ],
)
def test_ranks_that_linger_after_one_finished_are_named_once_the_exit_grace_is_over(
    hooks: bool, first: RankExited | Finished
) -> None:
    seen = watch(hooks=hooks, exit_grace=GRACE, step_timeout=5.0)
    assert seen.record("a", first, now=10.0) is None
    assert seen.record("a", exited(1, 0), now=11.0) is None
    for node in NODES:
        seen.heard_from(node, 10.0 + GRACE)
    # No hang either: the steps ended because the work did, long past the 5 s step timeout.
    assert seen.tick(10.0 + GRACE - 0.1, wall=2000.0) is None
    ended = seen.tick(10.0 + GRACE, wall=2000.0)
    assert isinstance(ended, RanksFinished)
    assert ended.lingering == ([2, 3, 4, 5] if not hooks else [0, 2, 3, 4, 5])
    assert ended.grace_s == GRACE


def test_a_rank_that_finished_and_then_aborts_at_exit_does_not_restart_the_run() -> None:
    seen = watch()
    for rank in range(6):
        seen.record(NODES[rank // 2], Finished(rank=rank, generation=2, step=40), now=1.0)
    ended = seen.record("c", exited(5, 134, "Aborted (core dumped)"), now=2.0)
    assert isinstance(ended, RanksFinished) and ended.lingering == []


def test_a_plain_scripts_generation_runs_once_every_rank_process_is_up() -> None:
    seen = watch(hooks=False, await_first_step=True, resume_step=0)
    started = [RankStarted(rank=r, generation=2, pid=100 + r, at=1000.0 + r) for r in range(6)]
    events = [seen.record(NODES[s.rank // 2], s, now=1.0) for s in started]
    assert events[:5] == [None] * 5
    first = events[5]
    assert isinstance(first, FirstStep) and first.at == 1005.0 and first.step == 0
    seen.reported(first, now=1.0)
    assert seen.record("a", RankStarted(rank=0, generation=2, pid=99, at=1010.0), now=2.0) is None


def test_a_hang_is_still_a_hang_while_no_rank_has_finished() -> None:
    seen = watch(step_timeout=5.0)
    for node in NODES:
        seen.heard_from(node, 6.0)
    assert isinstance(seen.tick(6.0, wall=1006.0), Hang)


def test_records_of_another_generation_are_no_news() -> None:
    seen = watch()
    assert seen.record("b", exited(3, 137, generation=1), now=1.0) is None


def test_every_rank_holding_at_one_step_is_told_and_is_no_hang() -> None:
    seen = watch(step_timeout=5.0)
    for rank in range(6):
        assert seen.all_held() is None
        seen.record(NODES[rank // 2], Held(rank=rank, generation=2, step=40), now=1.0)
    assert seen.all_held() == 40
    for node in NODES:
        seen.heard_from(node, 100.0)
    assert seen.tick(100.0, wall=1100.0) is None  # no step for 100 s, and none is due


def test_the_first_step_is_dated_when_it_was_done() -> None:
    seen = watch(await_first_step=True, resume_step=10)
    for step, at in ((11, 1001.0), (12, 1002.0)):
        for i in range(len(NODES)):
            frame = NodeSteps(
                generation=2,
                step=step,
                first_rank=2 * i,
                compute_s=[0.1, 0.1],
                step_s=[0.2, 0.2],
                loss=[1.0, 1.0],
                samples=[[0], [1]],
                at=at,
            )
            seen.ingest.add(pack_steps(step, frame, ranks_per_node=2))
    (first,) = [e for e in seen.steps(now=5.0) if e.kind == "first_step"]
    assert (first.step, first.at) == (11, 1001.0)


def test_a_monitor_taking_over_still_says_what_the_generation_resumed_from() -> None:
    """The ranks say it once, before their first step; a retried monitor is not told again."""
    first = watch(await_first_step=True, resume_step=10)
    first.record("a", Resumed(rank=0, generation=2, step=10, source="memory", seconds=0.1), now=1.0)
    known = first.knowledge()
    taking_over = watch(await_first_step=True, resume_step=10, restored_from=known["restored_from"])
    steps_done(taking_over, 11, 0.2, at=1001.0)
    (step,) = [e for e in taking_over.steps(now=2.0) if e.kind == "first_step"]
    assert step.restored_from == "memory"


def steps_done(seen: GenerationWatch, step: int, step_s: float, at: float) -> None:
    """Every rank of every node completed `step` in `step_s`."""
    for i in range(len(NODES)):
        frame = NodeSteps(
            generation=2, step=step, first_rank=2 * i, compute_s=[step_s] * 2, step_s=[step_s] * 2,
            loss=[1.0, 1.0], samples=[[0], [1]], at=at,
        )  # fmt: skip
        seen.ingest.add(pack_steps(step, frame, ranks_per_node=2))
    seen.steps(now=at - 1000.0)


def unavailable(rank: int, since: float) -> StorageUnavailable:
    return StorageUnavailable(rank=rank, generation=2, step=20, since=since, error="[Errno 28] No space left")


def committed(step: int, at: float) -> CheckpointCommitted:
    return CheckpointCommitted(rank=0, generation=2, step=step, path=f"/c/{step}", blocking_s=0.1, at=at)


KEEPER = KeeperInput(
    root="/c", checkpoints=[], started_at=datetime(2026, 1, 1, tzinfo=UTC), sdc_check_steps=100, checkpoint_steps=10
)


def test_a_storage_outage_is_told_when_it_begins_pages_past_three_intervals_and_ends_at_the_next_commit() -> None:
    seen = watch(keeper=KEEPER)
    steps_done(seen, 1, step_s=1.0, at=1000.0)  # a 10 s checkpoint interval: the page comes past 30 s
    began = seen.record("a", unavailable(0, since=1001.0), now=1.0)
    assert isinstance(began, StorageOutage) and began.phase == "began" and began.outage.step == 20
    assert seen.record("b", unavailable(3, since=1001.5), now=1.5) is None, "one outage, however many ranks"
    for node in NODES:
        seen.heard_from(node, 30.0)
    assert seen.tick(30.0, wall=1030.0) is None
    lasting = seen.tick(30.0, wall=1032.0)
    assert isinstance(lasting, StorageOutage) and lasting.phase == "lasting" and lasting.outage.paged
    assert lasting.paging is not None and lasting.paging.paging == PagingClass.CORRELATED
    assert seen.tick(30.0, wall=1040.0) is None, "paged once"
    over = seen.record("a", committed(160, at=1045.0), now=45.0)
    assert isinstance(over, StorageOutage) and (over.phase, over.landed_step, over.lasted_s) == ("over", 160, 44.0)
    assert seen.record("a", committed(170, at=1046.0), now=46.0) is None
    assert seen.record("c", unavailable(5, since=1040.0), now=47.0) is None, "read late: the commit ended it"


def test_an_outage_carried_into_a_generation_ends_with_its_first_commit_and_is_not_paged_again() -> None:
    carried = Outage(since=900.0, error="[Errno 2] No such file or directory", step=10, paged=True)
    seen = watch(keeper=KEEPER, storage_outage=carried)
    steps_done(seen, 1, step_s=1.0, at=1000.0)
    assert seen.record("a", unavailable(0, since=1001.0), now=1.0) is None, "it began before this generation"
    for node in NODES:
        seen.heard_from(node, 2.0)
    assert seen.tick(2.0, wall=1002.0) is None
    over = seen.record("a", committed(30, at=1010.0), now=10.0)
    assert isinstance(over, StorageOutage) and over.phase == "over" and over.lasted_s == 110.0


def test_the_live_numbers_are_reported_every_progress_s_of_steps_and_after_any_other_report() -> None:
    seen = watch(progress_s=30.0)
    refreshed = []
    for step in range(1, 100):  # a step a second: a refresh at 30 s, then 30 s after the last report
        at = 1000.0 + step
        for i in range(len(NODES)):
            frame = NodeSteps(
                generation=2, step=step, first_rank=2 * i, compute_s=[0.5] * 2, step_s=[0.5] * 2,
                loss=[2.0, 2.0], samples=[[0], [1]], at=at,
            )  # fmt: skip
            seen.ingest.add(pack_steps(step, frame, ranks_per_node=2))
        for event in seen.steps(now=float(step)):
            if isinstance(event, ProgressRefresh):
                refreshed.append((event.progress.step, event.progress.loss, event.progress.at))
                seen.reported(event, now=float(step))
    assert refreshed == [(30, 2.0, 1030.0), (60, 2.0, 1060.0), (90, 2.0, 1090.0)]


def test_a_batch_of_steps_read_together_makes_one_refresh() -> None:
    seen = watch(progress_s=30.0)
    for step in range(1, 61):  # a monitor taking over reads a minute of steps at once
        for i in range(len(NODES)):
            frame = NodeSteps(
                generation=2, step=step, first_rank=2 * i, compute_s=[0.5] * 2, step_s=[0.5] * 2,
                loss=[2.0, 2.0], samples=[[0], [1]], at=1000.0 + step,
            )  # fmt: skip
            seen.ingest.add(pack_steps(step, frame, ranks_per_node=2))
    refreshes = [e for e in seen.steps(now=60.0) if isinstance(e, ProgressRefresh)]
    assert [r.progress.step for r in refreshes] == [60]


def test_a_gpu_that_fails_without_slowing_is_reported_once_and_only_what_cannot_compute_ends_it() -> None:
    seen = watch()
    healthy = SimulatedTelemetry("b", "r1").read()
    link_down = SimulatedTelemetry("b", "r1", faults=lambda: [NvlinkDegraded(node="b", gpu=1)]).read()
    lost = SimulatedTelemetry("b", "r1", faults=lambda: [GpuLost(node="b", gpu=6)]).read()
    assert seen.record("b", GpuReport(node="b", readings=healthy, at=1000.0), 1.0) is None
    drained = seen.record("b", GpuReport(node="b", readings=link_down, at=1002.0), 3.0)
    assert isinstance(drained, GpuFailed) and drained.node == "b" and drained.steps_on
    assert not ends_generation(drained), "a GPU that still computes is drained at a step, not restarted"
    assert seen.record("b", GpuReport(node="b", readings=link_down, at=1004.0), 5.0) is None, "news once"
    ended = seen.record("b", GpuReport(node="b", readings=lost, at=1006.0), 7.0)
    assert isinstance(ended, GpuFailed) and [f.kind for f in ended.faults] == ["gpu_lost"]
    assert ends_generation(ended) and "b GPU 6: fell off the bus" in ended.detail()
