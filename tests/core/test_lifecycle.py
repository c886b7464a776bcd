"""The run's state machine: the moves DESIGN §4 draws are in the table, the book refuses the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.lifecycle import TRANSITIONS, RunState, why
from core.run import RunStatus
from core.runbook import RunBook
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


@pytest.mark.parametrize(
    ("current", "to"),
    [
        (S.PENDING, S.RUNNING),  # nothing runs before a launch
        (S.COMPLETED, S.RESUMING),  # the end is the end
        (S.FAILED, S.RUNNING),
        (S.CANCELLED, S.STOPPED),
        (S.STOPPED, S.RUNNING),  # a stopped run resumes through a launch
        (S.DIAGNOSING, S.RUNNING),  # a hang always restarts
        (S.RESIZING, S.RUNNING),
    ],
)
def test_moves_outside_the_table_are_refused_and_reported(current: RunState, to: RunState) -> None:
    refused: list[tuple[RunState, RunState]] = []
    book = RunBook(
        RunStatus(spec=tiny_spec(Path("/ckpt")), state=current), on_refused=lambda a, b, _: refused.append((a, b))
    )
    assert not book.move(to)
    assert book.state == current
    assert refused == [(current, to)]


def test_only_the_ends_are_dead_ends() -> None:
    for state, moves in TRANSITIONS.items():
        assert (not moves) == state.terminal, state
