"""The run's state machine: the moves docs/architecture.md §5 draws are in the table, the book makes each
of them and raises on any other."""

from __future__ import annotations

from pathlib import Path

import pytest

from stayalive.core.book.runbook import IllegalMove, RunBook
from stayalive.core.run.lifecycle import TRANSITIONS, Ask, RunState, takes, why
from stayalive.core.run.status import RunStatus
from tests.core.runs import at, interruption
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


@pytest.mark.parametrize(("current", "to"), EDGES, ids=[f"{a}-{b}" for a, b in EDGES])
def test_the_book_makes_every_move_of_the_table(current: RunState, to: RunState) -> None:
    shown: list[RunState] = []
    book = RunBook(RunStatus(spec=tiny_spec(Path("/ckpt")), state=current), on_move=lambda s, _: shown.append(s.state))
    book.move(to, "why")
    assert book.state == to and shown == [to]


@pytest.mark.parametrize(("current", "to"), NOT_EDGES, ids=[f"{a}-{b}" for a, b in NOT_EDGES])
def test_a_move_outside_the_table_raises_and_changes_nothing(current: RunState, to: RunState) -> None:
    shown: list[RunState] = []
    book = RunBook(RunStatus(spec=tiny_spec(Path("/ckpt")), state=current), on_move=lambda s, _: shown.append(s.state))
    with pytest.raises(IllegalMove, match=f"no move from {current} to {to}"):
        book.move(to)
    assert book.state == current and shown == []


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
