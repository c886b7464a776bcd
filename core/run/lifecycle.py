"""The run's state machine (docs/architecture.md §5) as a table: every move a run may make, each with why.

RunBook.move (core/book/runbook.py) checks every change of state against it; a move that is not here is
a bug, and raises. The table is what the web UI's RunState column
can show, in the order a run lives it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class RunState(StrEnum):
    PENDING = "PENDING"
    LAUNCHING = "LAUNCHING"
    RUNNING = "RUNNING"
    CHECKPOINTING = "CHECKPOINTING"
    DIAGNOSING = "DIAGNOSING"
    DRAINING = "DRAINING"
    RESIZING = "RESIZING"
    RESUMING = "RESUMING"
    STOPPED = "STOPPED"  # needs a human: paused, a deterministic failure, or too few nodes to go on
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED)


S = RunState
# Moves that any live run may make, whatever it is doing.
_ANYWHERE = {
    S.STOPPED: "a failure a person must look at (the same step twice), or fewer nodes than min_nodes",
    S.FAILED: "failures came faster than the spec's failure_limit allows (restarts would eat the run), "
    "or a node refused the launch (a backend its host cannot run)",
    S.CANCELLED: "a person cancelled the workflow",
}

TRANSITIONS: dict[RunState, dict[RunState, str]] = {
    S.PENDING: {
        S.LAUNCHING: "the fleet granted the nodes: the first generation starts",
    },
    S.LAUNCHING: {
        S.RUNNING: "the first generation's first step",
        S.DIAGNOSING: "no step within the watchdog's timeout before the first one: dumping stacks",
        S.RESUMING: "a rank or node failed before the first step: the next generation starts",
        S.COMPLETED: "a plain script (no hooks) finished without telling us its steps",
    },
    S.RUNNING: {
        S.CHECKPOINTING: "a person asked for a checkpoint: the ranks take one at the next agreed step",
        S.DIAGNOSING: "no step within the watchdog's timeout, every rank alive: dumping stacks",
        S.DRAINING: "a drain or a pause: every rank finishes the in-flight step, checkpoints it and holds",
        S.RESUMING: "a rank or node failed, a check found corruption, or a person rolled the run back",
        S.COMPLETED: "every rank reached the target step and its checkpoint is valid",
    },
    S.CHECKPOINTING: {
        S.RUNNING: "the checkpoint is judged (a forced one, or the held step's)",
        S.RESIZING: "drain: the held step's checkpoint is judged; the group is rebuilt without the node",
        S.STOPPED: "pause: the held step's checkpoint is judged; the ranks hold until a person resumes",
        S.RESUMING: "a failure while the checkpoint was taken: the next generation starts",
        S.DIAGNOSING: "no step within the watchdog's timeout while checkpointing: dumping stacks",
        S.COMPLETED: "every rank reached the target step and its checkpoint is valid",
    },
    S.DRAINING: {
        S.CHECKPOINTING: "every rank holds at the same step; its checkpoint is being judged",
        S.RESIZING: "drain: every rank holds and the held step's checkpoint is judged; the group is rebuilt",
        S.STOPPED: "pause: every rank holds and the held step's checkpoint is judged; a person resumes it",
        S.RESUMING: "a rank or node failed before every rank held: restart from a checkpoint instead",
        S.DIAGNOSING: "no step within the watchdog's timeout before every rank held: dumping stacks",
        S.COMPLETED: "every rank reached the target step before it held, and its checkpoint is valid",
    },
    S.DIAGNOSING: {
        S.RESUMING: "the stacks are in and the culprit's node is out: the next generation starts",
    },
    S.RESIZING: {
        S.RESUMING: "the group without the node is launched: survivors rejoin in place",
    },
    S.RESUMING: {
        S.RUNNING: "the new generation's first step",
        S.RESUMING: "a failure before the first step of the new generation: another one starts",
        S.DIAGNOSING: "no step within the watchdog's timeout after the restart: dumping stacks",
        S.COMPLETED: "a plain script (no hooks) finished without telling us its steps",
    },
    S.STOPPED: {
        S.RESUMING: "a person resumed or rolled back, or enough nodes are free again",
    },
    S.COMPLETED: {},
    S.FAILED: {},
    S.CANCELLED: {},
}
for _state, _moves in TRANSITIONS.items():
    if not _state.terminal:
        _moves.update({to: why for to, why in _ANYWHERE.items() if to not in _moves and to != _state})


def why(current: RunState, to: RunState) -> str | None:
    """Why a run may move from `current` to `to`; None if it may not."""
    return TRANSITIONS[current].get(to)


# What a person asks is taken in the states that can act on it: a checkpoint and a hold (drain,
# pause) are asked of ranks that train, so they wait for a launch's first step or the end of a hold
# (a run already checkpointing takes another checkpoint); a rollback is taken whenever it comes.
Ask = Literal["checkpoint", "drain", "pause", "rollback"]
_TAKEN_IN: dict[Ask, tuple[RunState, ...]] = {
    "checkpoint": (S.RUNNING, S.CHECKPOINTING),
    "drain": (S.RUNNING,),
    "pause": (S.RUNNING,),
}


def takes(state: RunState, ask: Ask) -> bool:
    """Whether a run in `state` carries out `ask` now (else it waits in the inbox)."""
    return ask == "rollback" or state in _TAKEN_IN[ask]
