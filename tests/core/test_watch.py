"""How the run monitor tells how a generation ends, from what its node agents report (core/watch.py)."""

from __future__ import annotations

import pytest

from core.events import FirstStep, Hang, MonitorInput, NodeLost, RankFailed, RanksFinished
from core.telemetry import Finished, Held, NodeSteps, RankExited, RankStarted, pack_steps
from core.watch import WITNESS_GRACE_S, GenerationWatch

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
