"""The run's state machine: the moves docs/architecture.md §5 draws are in the table; the book makes each
of them, raises on any other, and reaches every one of them from the findings the workflow hands it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from stayalive.core.book.findings import (
    Cancelled,
    CheckpointAsked,
    Diagnosing,
    Draining,
    Failed,
    Finding,
    Finished,
    Held,
    HoldOver,
    Interrupted,
    Joined,
    Judged,
    Launching,
    LaunchRefused,
    Observed,
    Paused,
    Resumed,
    RolledBack,
    ShortOfNodes,
)
from stayalive.core.book.runbook import IllegalMove, RunBook
from stayalive.core.messages.events import CheckpointJudged, FirstStep
from stayalive.core.run.launch import Membership
from stayalive.core.run.lifecycle import TRANSITIONS, Ask, RunState, takes, why
from stayalive.core.run.status import Progress, RunStatus
from stayalive.core.run.timeline import Cause, PagingClass
from tests.core.runs import at, checkpoint, interruption
from tests.helpers import tiny_spec

S = RunState


@pytest.mark.parametrize(
    ("current", "to"),
    [
        (S.PENDING, S.LAUNCHING),  # the fleet granted the nodes
        (S.LAUNCHING, S.RUNNING),  # the first step
        (S.RUNNING, S.CHECKPOINTING),  # force_checkpoint
        (S.CHECKPOINTING, S.RUNNING),  # its verdict
        (S.RUNNING, S.DRAINING),  # auto-cordon: drain
        (S.DRAINING, S.CHECKPOINTING),  # wait, checkpoint
        (S.DRAINING, S.RESIZING),  # held, its verdict already in
        (S.CHECKPOINTING, S.RESIZING),  # resize
        (S.RESIZING, S.RESUMING),  # resume
        (S.RUNNING, S.DIAGNOSING),  # a hang: dump stacks
        (S.DIAGNOSING, S.RESUMING),
        (S.RUNNING, S.RESUMING),  # a crash, a lost node, SDC, a rollback
        (S.RESUMING, S.RESUMING),  # a failure before the first step of the new generation
        (S.RESUMING, S.RUNNING),
        (S.CHECKPOINTING, S.STOPPED),  # paused
        (S.STOPPED, S.RESUMING),  # resumed
        (S.RUNNING, S.COMPLETED),
        (S.RUNNING, S.FAILED),  # too many restarts, from anywhere alive
        (S.DIAGNOSING, S.CANCELLED),
        (S.LAUNCHING, S.STOPPED),  # the same step twice, from anywhere alive
    ],
)
def test_every_move_of_the_design_is_in_the_table_with_why(current: RunState, to: RunState) -> None:
    reason = why(current, to)
    assert reason is not None and len(reason) > 20, f"{current} → {to}"


EDGES = [(current, to) for current, moves in TRANSITIONS.items() for to in moves]
NOT_EDGES = [(current, to) for current in S for to in S if current != to and to not in TRANSITIONS[current]]


def book_in(state: RunState, shown: list[RunState] | None = None) -> RunBook:
    """A two-node run (min_nodes 2, spare n3) in `state`, showing each state it moves to in `shown`."""
    spec = tiny_spec(Path("/ckpt"), spare_nodes=["n3"], min_nodes=2)
    status = RunStatus(spec=spec, state=state, nodes=["n1", "n2"], generation=1)
    return RunBook(status, on_move=lambda s, _: shown.append(s.state) if shown is not None else None)


@pytest.mark.parametrize(("current", "to"), EDGES, ids=[f"{a}-{b}" for a, b in EDGES])
def test_the_book_makes_every_move_of_the_table(current: RunState, to: RunState) -> None:
    shown: list[RunState] = []
    book = book_in(current, shown)
    book._move(to, "why")
    assert book.state == to and shown == [to]


@pytest.mark.parametrize(("current", "to"), NOT_EDGES, ids=[f"{a}-{b}" for a, b in NOT_EDGES])
def test_a_move_outside_the_table_raises_and_changes_nothing(current: RunState, to: RunState) -> None:
    shown: list[RunState] = []
    book = book_in(current, shown)
    with pytest.raises(IllegalMove, match=f"no move from {current} to {to}"):
        book._move(to)
    assert book.state == current and shown == []


def every_finding() -> list[Finding]:
    """One of each finding the workflow hands a book (fresh: applying one may change its records)."""
    verdict = CheckpointJudged(
        generation=1, checkpoint=checkpoint(at(), step=10).model_copy(update={"generation": 1}), deleted=[]
    )
    first_step = FirstStep(step=11, at=at(seconds=5).timestamp(), progress=Progress(step=11))
    return [
        Launching(),
        LaunchRefused("n1: backend nccl needs CUDA"),
        ShortOfNodes("the fleet has 1 usable node of the 2 this run needs"),
        Observed(first_step),
        Judged([verdict]),
        CheckpointAsked(),
        Draining("drain n2"),
        Held(step=10, generation=1, judged=None, why="drain n2"),  # its checkpoint not judged yet
        Held(step=10, generation=1, judged=verdict, why="pause"),
        Paused("maintenance"),
        HoldOver(Membership(nodes=["n1", "n3"]), "drained n2", Interrupted(interruption(at(), Cause.DRAIN, "n2", 10))),
        HoldOver(Membership(nodes=["n1", "n2"]), "resumed", Interrupted(interruption(at(), Cause.PAUSE, None, 10))),
        HoldOver(
            Membership(nodes=["n1", "n3"]), "drained n2", Failed(interruption(at(), Cause.GPU_FAULT), 6 * 3600, None)
        ),
        Diagnosing("no step for 60s: dumping stacks"),
        Failed(interruption(at(), step=10, generation=1), baseline_mtbf_s=6 * 3600, recent_goodput=None),
        Interrupted(interruption(at(), Cause.CHECKPOINT_INVALID, step=1000, generation=1)),
        RolledBack(step=0, at=at()),
        Resumed("resumed by an operator"),
        Joined("n3"),
        Finished(step=None, at=at()),
        Finished(step=1000, at=at()),
        Cancelled(),
    ]


def test_every_finding_in_every_state_moves_along_the_table_or_raises() -> None:
    """The book, fed each finding in each state, makes only moves the table has, raises on any other
    (showing nothing), and between them makes every move of the table: none is unreachable."""
    made: set[tuple[RunState, RunState]] = set()
    for state in S:
        for index, finding in enumerate(every_finding()):
            shown: list[RunState] = []
            book = book_in(state, shown)
            try:
                after = book.apply(finding)
            except IllegalMove:
                assert book.state == state and shown == [], f"{finding} in {state} raised, but moved first"
                continue
            path = [state, *shown]
            moves = set(itertools.pairwise(path))  # the same state again is news for the web UI, always allowed
            assert {(a, b) for a, b in moves if a != b} <= set(EDGES), f"{finding} in {state} moved {path}"
            assert after.state == book.state == path[-1], (state, index)
            made |= moves
    assert not set(EDGES) - made, f"no finding makes these moves of the table: {sorted(set(EDGES) - made)}"


@pytest.mark.parametrize(
    ("state", "finding", "after"),
    [
        (S.PENDING, Launching(), S.LAUNCHING),  # the first generation
        (S.RUNNING, Launching(), S.RESUMING),  # after a failure
        (S.RUNNING, CheckpointAsked(), S.CHECKPOINTING),
        (S.DRAINING, Held(step=10, generation=1, judged=None, why="drain n2"), S.CHECKPOINTING),
        (S.DRAINING, Paused("maintenance"), S.STOPPED),
        (S.STOPPED, RolledBack(step=0, at=at()), S.RESUMING),
        (S.RUNNING, RolledBack(step=0, at=at()), S.RUNNING),  # the loop launches from the checkpoint next
        (S.RUNNING, Finished(step=1000, at=at()), S.COMPLETED),
        (S.LAUNCHING, LaunchRefused("n1: backend nccl needs CUDA"), S.FAILED),
    ],
)
def test_the_book_picks_the_next_state_from_what_it_found(state: RunState, finding: Finding, after: RunState) -> None:
    assert book_in(state).apply(finding).state == after


def test_a_held_step_without_a_verdict_is_judged_before_the_group_changes() -> None:
    book = book_in(S.DRAINING)
    assert book.apply(Held(step=10, generation=1, judged=None, why="drain n2")).judge_held
    verdict = CheckpointJudged(
        generation=1, checkpoint=checkpoint(at(), step=10).model_copy(update={"generation": 1}), deleted=[]
    )
    held = book_in(S.DRAINING).apply(Held(step=10, generation=1, judged=verdict, why="drain n2"))
    assert not held.judge_held and held.state == S.DRAINING


def test_a_failure_comes_back_with_its_page_and_the_same_step_twice_stops_the_run() -> None:
    book = book_in(S.RUNNING)
    first = book.apply(Failed(interruption(at(), step=10, generation=1), 6 * 3600, None))
    assert first.page is not None and first.state == S.RUNNING
    again = book.apply(Failed(interruption(at(minutes=5), node="n2", step=10, generation=2), 6 * 3600, None))
    assert again.page is not None and again.page.paging == PagingClass.DETERMINISTIC and again.state == S.STOPPED


def test_the_table_refuses_what_the_design_forbids() -> None:
    forbidden = [
        (S.PENDING, S.RUNNING),  # nothing runs before a launch
        (S.COMPLETED, S.RESUMING),  # the end is the end
        (S.FAILED, S.RUNNING),
        (S.CANCELLED, S.STOPPED),
        (S.STOPPED, S.RUNNING),  # a stopped run resumes through a launch
        (S.DIAGNOSING, S.RUNNING),  # a hang always restarts
        (S.RESIZING, S.RUNNING),
    ]
    assert set(forbidden) <= set(NOT_EDGES)
    assert len(EDGES) + len(NOT_EDGES) == len(S) * (len(S) - 1) + sum(1 for s in S if s in TRANSITIONS[s])


def test_only_the_ends_are_dead_ends() -> None:
    for state, moves in TRANSITIONS.items():
        assert (not moves) == state.terminal, state


def wide_book(nodes: list[str], spares: list[str], min_nodes: int) -> RunBook:
    spec = tiny_spec(
        Path("/ckpt"), world_size=len(nodes), ranks_per_node=1, nodes=nodes, spare_nodes=spares, min_nodes=min_nodes
    )
    return RunBook(RunStatus(spec=spec, nodes=list(nodes)))


@pytest.mark.parametrize(
    ("spare", "min_nodes", "nodes_after", "action"),
    [
        ("s1", 3, ["a", "s1", "c"], "replaced b with spare s1"),  # the spare takes b's place and ranks
        (None, 2, ["a", "c"], "no spare free: continuing on 2 nodes"),  # shrink, survivors renumbered
        (None, 3, ["a", "c"], "no spare free and 2 nodes < min 3"),  # the run must wait for a node
    ],
)
def test_a_quarantined_node_is_replaced_or_the_group_shrinks(
    spare: str | None, min_nodes: int, nodes_after: list[str], action: str
) -> None:
    book = wide_book(["a", "b", "c"], ["s1"], min_nodes)
    lost = interruption(at(), node="b")
    membership = book.replaced(lost, "b", spare)
    assert membership.nodes == nodes_after == book.status.nodes
    assert lost.actions == ["quarantined b in the fleet (self-test running)", action]
    assert book.status.spares_used == ([spare] if spare else [])


def test_spares_come_first_then_the_runs_own_nodes_back_from_a_self_test() -> None:
    book = wide_book(["a", "b", "c"], ["s1", "s2"], 2)
    book.replaced(interruption(at(), node="b"), "b", "s1")
    assert book.spare_candidates() == ["s2", "b"]


@pytest.mark.parametrize(
    ("state", "ask", "taken"),
    [
        (S.RUNNING, "checkpoint", True),
        (S.CHECKPOINTING, "checkpoint", True),  # one asked while another is taken: taken again
        (S.LAUNCHING, "checkpoint", False),  # waits for the first step
        (S.DRAINING, "checkpoint", False),  # waits for the end of the hold
        (S.STOPPED, "checkpoint", False),  # a paused run checkpoints once it runs again
        (S.RUNNING, "pause", True),
        (S.RESUMING, "pause", False),  # a hold is asked of ranks that train
        (S.CHECKPOINTING, "drain", False),
        (S.RUNNING, "drain", True),
        (S.LAUNCHING, "rollback", True),  # a rollback does not need the ranks
        (S.CHECKPOINTING, "rollback", True),
    ],
)
def test_what_a_person_asks_waits_for_a_state_that_can_act_on_it(state: RunState, ask: Ask, taken: bool) -> None:
    assert takes(state, ask) == taken
