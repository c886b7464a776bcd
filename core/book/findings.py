"""What the run workflow finds out, as it hands it to RunBook.apply: the one door to the run's state.

Workflow helpers gather evidence through activities (a launch's answers, the stacks of a hang, the
checkpoint a hold left) and return one of these; the book decides where the run goes next from the
lifecycle table (core/run/lifecycle.py), records it, and answers with `Next`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from stayalive.core.messages.events import CheckpointJudged, MonitorEvent
from stayalive.core.run.launch import Membership
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Classification, Interruption


@dataclass(frozen=True)
class Launching:
    """The next generation is being launched: the first (from PENDING), or a restart or a rejoin."""


@dataclass(frozen=True)
class LaunchRefused:
    """A node refused the launch (a backend its host cannot run): no restart will do better."""

    refusals: str


@dataclass(frozen=True)
class ShortOfNodes:
    """The fleet cannot give the run min_nodes usable nodes: it waits for a person or a free node."""

    reason: str


@dataclass(frozen=True)
class Observed:
    """What the run monitor reported: live numbers, and a generation's first step."""

    event: MonitorEvent


@dataclass(frozen=True)
class Judged:
    """The keeper's verdicts on checkpoints the ranks committed."""

    verdicts: list[CheckpointJudged]


@dataclass(frozen=True)
class CheckpointAsked:
    """A person asked for a checkpoint and the ranks were told to take one at the next agreed step."""


@dataclass(frozen=True)
class Draining:
    """Every rank was told to finish the in-flight step, checkpoint it and hold (a drain or a pause)."""

    why: str


@dataclass(frozen=True)
class Held:
    """Every rank holds at `step`, with the monitor's verdict on its checkpoint if it had one."""

    step: int
    generation: int
    judged: CheckpointJudged | None
    why: str


@dataclass(frozen=True)
class Paused:
    """A pause's hold is in: the ranks hold until a person resumes the run."""

    reason: str


@dataclass(frozen=True)
class Diagnosing:
    """No step within the watchdog's timeout, every rank alive: the stacks are being dumped."""

    note: str


@dataclass(frozen=True)
class Failed:
    """A crash, a lost node, a hang, SDC, a failed GPU or an unanswered launch: recorded with its
    paging class, judged against the run's MTBF (`baseline_mtbf_s`) and last hour's goodput."""

    interruption: Interruption
    baseline_mtbf_s: float
    recent_goodput: float | None


@dataclass(frozen=True)
class Interrupted:
    """An interruption recorded as it is, paged about by nobody: a drain, a pause, or every rank
    finished but the final checkpoint is not valid."""

    interruption: Interruption


@dataclass(frozen=True)
class HoldOver:
    """A drain resized the group (`membership` without the node) or a paused run was resumed: the next
    generation keeps the survivors' processes. `entry` is the hold's timeline entry: planned
    (`Interrupted`), or a failure (`Failed`: a GPU that still computed, drained)."""

    membership: Membership
    note: str
    entry: Interrupted | Failed


@dataclass(frozen=True)
class RolledBack:
    """A person sent the run back to the checkpoint of `step` (resume_from)."""

    step: int
    at: datetime


@dataclass(frozen=True)
class Resumed:
    """A person resumed a stopped run."""

    note: str


@dataclass(frozen=True)
class Joined:
    """A free node joined a run that was waiting for one."""

    spare: str


@dataclass(frozen=True)
class Finished:
    """Every rank reached the target `step` and its checkpoint is valid (None: a plain script, which
    does not say its steps, exited cleanly)."""

    step: int | None
    at: datetime


@dataclass(frozen=True)
class Cancelled:
    """A person cancelled the workflow."""


Finding = (
    Launching
    | LaunchRefused
    | ShortOfNodes
    | Observed
    | Judged
    | CheckpointAsked
    | Draining
    | Held
    | Paused
    | HoldOver
    | Diagnosing
    | Failed
    | Interrupted
    | RolledBack
    | Resumed
    | Joined
    | Finished
    | Cancelled
)


@dataclass(frozen=True)
class Next:
    """What the workflow does once the book has applied a finding."""

    state: RunState
    page: Classification | None = None  # a failure's paging class: page once the next generation is launched
    judge_held: bool = False  # the held step's checkpoint is on storage, unjudged: judge it before the group changes
    said: str = ""  # what the book did, in words (a request's answer)
