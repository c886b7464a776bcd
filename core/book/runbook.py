"""The run's book: its state (RunStatus) and every change to it, in one place.

RunWorkflow is a thin shell over a RunBook, as FleetWorkflow is over core/fleet/rules.py: the
workflow waits and calls activities, and hands what it found (core/book/findings.py) to `apply`,
the one door to the run's state. `apply` picks the next state by the finding and the state it meets,
checks the move against core/run/lifecycle.py's table, records it, and says what comes next. A move
the table does not have is a bug, not a decision: it raises (IllegalMove), and the workflow task
fails and is retried until a fixed worker takes it, the run untouched meanwhile. Pure: the time
comes in with the findings.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import assert_never

from stayalive.core.book import records
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
    Next,
    Observed,
    Paused,
    Resumed,
    RolledBack,
    ShortOfNodes,
)
from stayalive.core.decisions.fencing import PartitionReport, amend
from stayalive.core.decisions.paging import classify, over_limit
from stayalive.core.fleet.model import FailureRate
from stayalive.core.judgement.escalation import Escalation
from stayalive.core.judgement.eviction import Eviction
from stayalive.core.messages.events import (
    CheckpointJudged,
    FirstStep,
    GpuFailed,
    MonitorEvent,
    SlowdownFound,
    StorageOutage,
    StragglerFound,
)
from stayalive.core.protocol.telemetry import Command, CommandKind, SdcCheck
from stayalive.core.run.launch import Membership, without_node
from stayalive.core.run.lifecycle import RunState, why
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import CheckpointRecord, IntervalChoice, RunStatus, append_bounded
from stayalive.core.run.timeline import (
    INTERRUPTIONS_KEPT,
    PLANNED,
    Cause,
    Classification,
    Detection,
    Interruption,
    PagingClass,
)


def _ignore(*_: object) -> None:
    pass


class IllegalMove(Exception):
    """A change of state that core/run/lifecycle.py's table does not have."""


S = RunState


class RunBook:
    def __init__(
        self,
        status: RunStatus,
        on_move: Callable[[RunStatus, str], None] = _ignore,
        on_progress: Callable[[RunStatus], None] = _ignore,
    ) -> None:
        self.status = status
        self.on_move = on_move  # the workflow shows the new state (web UI details, search attributes)
        # New live numbers or a checkpoint: the workflow refreshes its details and, now and then, its listing.
        self.on_progress = on_progress
        self._held_at: int | None = None  # the step every rank holds at, while a drain or a pause is judged

    @property
    def spec(self) -> RunSpec:
        return self.status.spec

    @property
    def state(self) -> RunState:
        return self.status.state

    # -- the one door to the run's state -------------------------------------------------------

    def apply(self, finding: Finding) -> Next:
        """Take in what the workflow found: move as the lifecycle allows, record it, say what next."""
        status, page, judge_held, said = self.status, None, False, ""
        match finding:
            case Observed(event):
                self._observe(event)
            case Judged(verdicts):
                self._file_verdicts(verdicts)
            case Launching():
                self._move(S.LAUNCHING if self.state == S.PENDING else S.RESUMING)
            case LaunchRefused(refusals):
                self._fail(f"the launch was refused: {refusals}")
            case ShortOfNodes(reason):
                self._stop(reason)
            case CheckpointAsked():
                self._move(S.CHECKPOINTING, "a checkpoint was asked for")
            case Draining(why_):
                self._move(S.DRAINING, why_)
            case Held(step, generation, judged, why_):
                self._held_at = step
                self._file_verdicts([judged] if judged is not None else [])
                if judge_held := not self.judged(step, generation):  # storage has it: judge it there
                    self._move(S.CHECKPOINTING, f"{why_}: validating the checkpoint of step {step}")
            case Paused(reason):
                self._held_at = None
                self._move(S.STOPPED, f"paused: {reason}")
            case HoldOver(membership, note, entry):
                self._held_at = None
                self._move(S.RESUMING if entry.interruption.cause == Cause.PAUSE else S.RESIZING, note)
                status.membership = membership  # survivors rejoin in place; newcomers start fresh
                page = self.apply(entry).page
            case Diagnosing(note):
                self._move(S.DIAGNOSING, note)
            case Failed(interruption, baseline_mtbf_s, recent_goodput):
                page = self._failed(interruption, baseline_mtbf_s, recent_goodput)
            case Interrupted(interruption):
                self._record(interruption)
            case RolledBack(step, at):
                said = self._rollback(step, at)
                if self.state == S.STOPPED:
                    self._move(S.RESUMING, f"resume_from step {step}")
            case Resumed(note):
                self._move(S.RESUMING, note)
            case Joined(spare):
                self._joined(spare)
                if len(status.nodes) >= self.spec.min_nodes:
                    self._move(S.RESUMING, f"{spare} joined: {len(status.nodes)} nodes")
            case Finished(step, at):
                if step is not None:
                    status.progress.step = step
                    # on storage, so storage that was away is back (its last ranks may exit before
                    # the monitor reads the commit that said so)
                    records.storage_back(status, step, at.timestamp())
                self._move(S.COMPLETED)
            case Cancelled():
                self._move(S.CANCELLED)
            case _:
                assert_never(finding)
        return Next(state=self.state, page=page, judge_held=judge_held, said=said)

    def _move(self, to: RunState, note: str = "") -> None:
        """Change state as the lifecycle allows (the same state again: news for the web UI's details)."""
        current = self.status.state
        if current != to and why(current, to) is None:
            raise IllegalMove(f"the run's lifecycle has no move from {current} to {to} ({note or 'no note'})")
        self.status.state = to
        self.on_move(self.status, note)

    def _fail(self, reason: str) -> None:
        """The run cannot go on, whoever tries: nothing will resume it."""
        self.status.failure = reason
        self._move(S.FAILED, reason)

    def _stop(self, reason: str) -> None:
        """Nobody trains until a person (or, below min_nodes, a free node) lets the run go on."""
        self.status.failure = reason
        self._move(S.STOPPED, reason)

    # -- the run's life ------------------------------------------------------------------------

    def begin(self, now: datetime, baseline: list[float]) -> None:
        """The run starts, with the fleet's healthy step times of its configuration."""
        self.status.started_at, self.status.baseline = now, baseline

    def refused(self, node: str, spare: str | None) -> None:
        """The fleet would not give the run `node`: a spare takes its place, or the run goes without it."""
        status = self.status
        status.nodes = (
            [spare if n == node else n for n in status.nodes] if spare else [n for n in status.nodes if n != node]
        )
        if spare:
            status.spares_used.append(spare)

    def exposure(self, now: datetime) -> float:
        """GPU-hours the run could fail in since it last told the fleet (wall-clock less the time it
        sat idle); they count as told from now on."""
        status = self.status
        since = status.exposure_reported_at or status.started_at or now
        idle = status.idle_seconds()
        running_s = max(0.0, (now - since).total_seconds() - (idle - status.idle_reported_s))
        status.exposure_reported_at, status.idle_reported_s = now, idle
        return running_s / 3600 * status.world_size

    def learned(self, rate: FailureRate) -> None:
        """The fleet's failure rate, as of now: the prior this run's MTBF and paging start from."""
        self.status.fleet_mtbf_s = rate.mtbf_s(self.status.world_size)

    def launched(self) -> None:
        """The next generation is running (or re-attached to): what was carried for it is spent."""
        self.status.membership, self.status.reattach = None, False

    def reattach(self) -> None:
        """The next workflow segment watches the ranks that are running, without launching."""
        self.status.reattach = True

    def finish(self, now: datetime) -> None:
        self.status.finished_at = now

    # -- the timeline --------------------------------------------------------------------------

    def _record(self, interruption: Interruption) -> None:
        """The one place a timeline row is written. The next generation fills in where it resumed."""
        status = self.status
        verdict = over_limit(status.interruptions, interruption, self.spec.failure_limit)
        status.interruptions.append(interruption)
        while len(status.interruptions) > INTERRUPTIONS_KEPT:
            records.fold(status, status.interruptions.pop(0))
        status.generation += 1
        if verdict is not None:
            interruption.actions.append(verdict)
            self._fail(verdict)
        elif len(status.nodes) < self.spec.min_nodes:
            self._stop(f"waiting for nodes: {len(status.nodes)} of the {self.spec.min_nodes} needed")

    def _failed(
        self, interruption: Interruption, baseline_mtbf_s: float, recent_goodput: float | None
    ) -> Classification:
        """Record a failure with its paging class (docs/architecture.md §12), judged against the timeline
        before it; the same step failing twice stops the run for a person (data or code, not hardware)."""
        paging = classify(self.status.interruptions, interruption, baseline_mtbf_s, recent_goodput)
        interruption.paging = paging
        self._record(interruption)
        if paging.paging == PagingClass.DETERMINISTIC and not self.state.terminal:
            self._stop(f"{paging.rule}: {paging.evidence}. {paging.action}")
            interruption.actions.append("stopped the run for a person")
        return paging

    def _rollback(self, step: int, at: datetime) -> str:
        """Everything after `step` is abandoned; the next generation restarts from its checkpoint."""
        status = self.status
        superseded = records.supersede_after(status, step)
        interruption = Interruption(
            at=at,
            generation=status.generation,
            detected_by="operator",
            cause=Cause.ROLLBACK,
            step=status.progress.step,
            detail=f"resume_from step {step}",
            actions=[f"marked {superseded} later checkpoints superseded"],
            paging=PLANNED,
        )
        interruption.resumed_at(step)  # also what a checkpoint judged only later is measured against
        self._record(interruption)
        return f"{superseded} later checkpoints superseded"

    def detect(self, detection: Detection) -> None:
        """Something that stopped nothing (a straggler, a slowdown, a skipped update)."""
        records.detect(self.status, detection)

    def storage(self, event: StorageOutage) -> Classification | None:
        """Checkpoint storage went away, stayed away, or came back (core/book/records.py). Returns the
        page to send when it has outlasted paging's bound."""
        return records.storage(self.status, event)

    def partitioned(self, report: PartitionReport) -> Interruption | None:
        """A node agent fenced itself out of a generation it was cut off from: that generation's
        node-lost entry was a partition. The amended entry (None: the run never took the node for lost,
        or the entry has left the timeline)."""
        return amend(self.status.interruptions, report)

    def resumed(self, step: int) -> None:
        """The generation starting now resumes from `step`: the last interruption learns its cost."""
        last = self.status.interruptions[-1] if self.status.interruptions else None
        if last is not None and last.resumed_from is None:
            last.resumed_at(step)

    def idled(self, seconds: float) -> None:
        """The run waited `seconds` for a person or for nodes after its last interruption."""
        if self.status.interruptions:
            self.status.interruptions[-1].idle_seconds += seconds

    # -- what the monitor reports --------------------------------------------------------------

    def known(self, event: MonitorEvent) -> bool:
        """Already recorded: a monitor restarted from an older place found it again."""
        if isinstance(event, StragglerFound):
            return event.rank in self.status.known_stragglers()
        if isinstance(event, GpuFailed):
            return event.node not in self.status.nodes  # cordoned already

        return isinstance(event, SlowdownFound) and self.status.slowdown_known()

    def _observe(self, event: MonitorEvent) -> None:
        status = self.status
        status.progress = event.progress
        status.straggler_seconds += event.progress.straggler_s  # the monitor counts afresh after each report
        self.on_progress(status)
        if not isinstance(event, FirstStep):
            return
        at = datetime.fromtimestamp(event.at, UTC)
        status.first_step_at = status.first_step_at or at
        last = status.interruptions[-1] if status.interruptions else None
        if last is not None and last.generation == status.generation - 1 and last.restart_seconds is None:
            last.restart_seconds = max(0.0, (at - last.at).total_seconds() - last.idle_seconds)
            last.restored_from = last.restored_from or event.restored_from
        if status.state in (S.LAUNCHING, S.RESUMING):
            self._move(S.RUNNING)

    # -- checkpoints ---------------------------------------------------------------------------

    def _file_verdicts(self, verdicts: list[CheckpointJudged]) -> None:
        """The keeper's verdicts (core/book/records.py): a forced checkpoint's ends CHECKPOINTING, a
        held step's does not (the hold goes on to a resize or a pause)."""
        for judged in verdicts:
            if records.file_verdict(self.status, judged):
                if self.state == S.CHECKPOINTING and self._held_at is None:
                    self._move(S.RUNNING)
                self.on_progress(self.status)

    def file_leftovers(self, found: list[CheckpointRecord]) -> None:
        """What the last generation committed that nobody had judged, judged before a restart."""
        records.file_leftovers(self.status, found)

    def corrupted(self, check: SdcCheck) -> list[CheckpointRecord]:
        """A failed SDC check: the checkpoints written after the last passing one become suspect."""
        return records.corrupted(self.status, check)

    def judged(self, step: int, generation: int) -> bool:
        return any(c.step == step and c.generation == generation for c in self.status.checkpoints)

    # -- membership ----------------------------------------------------------------------------

    def spare_candidates(self) -> list[str]:
        """Spares first, then the run's own nodes that are out of the group (back after a self-test)."""
        group = set(self.status.nodes)
        return [n for n in [*self.spec.spare_nodes, *self.spec.nodes] if n not in group]

    def replaced(self, interruption: Interruption, node: str, spare: str | None) -> Membership:
        """`node` is quarantined: a spare takes its place, or the group goes on without it."""
        status, spec = self.status, self.spec
        membership = without_node(status.nodes, node, spare)
        interruption.actions.append(f"quarantined {node} in the fleet (self-test running)")
        if spare:
            status.spares_used.append(spare)
            interruption.actions.append(f"replaced {node} with spare {spare}")
        elif len(membership.nodes) >= spec.min_nodes:
            interruption.actions.append(f"no spare free: continuing on {len(membership.nodes)} nodes")
        else:
            interruption.actions.append(f"no spare free and {len(membership.nodes)} nodes < min {spec.min_nodes}")
        status.nodes = list(membership.nodes)
        return membership

    def start_afresh(self) -> None:
        """The next generation starts every rank anew (held survivors may have been told to rejoin)."""
        self.status.membership = None

    def _joined(self, spare: str) -> None:
        """A free node joins a run that was waiting for one."""
        status = self.status
        status.nodes.append(spare)
        status.spares_used.append(spare)
        if status.membership is not None:  # survivors are holding: the newcomer loads the held checkpoint
            status.membership.nodes = list(status.nodes)
            status.membership.newcomers.append(spare)

    # -- slowness ------------------------------------------------------------------------------

    def escalate(self, ladder: Escalation | None) -> None:
        """A straggler starts up the S1 → S4 ladder (None: the climb is over)."""
        self.status.escalation = ladder

    def evicted(self, eviction: Eviction) -> None:
        self.status.evictions.append(eviction)

    # -- commands ------------------------------------------------------------------------------

    def command(self, kind: CommandKind, speeds: list[float] | None = None, seconds: float | None = None) -> Command:
        self.status.command_seq += 1
        return Command(seq=self.status.command_seq, kind=kind, speeds=speeds or [], seconds=seconds)

    def keep_interval(self, choice: IntervalChoice) -> None:
        """The ranks keep this checkpoint interval from now on (`auto`: at launch, or by a command)."""
        append_bounded(self.status.intervals, choice)
