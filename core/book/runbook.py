"""The run's book: its state (RunStatus) and every change to it, in one place.

RunWorkflow is a thin shell over a RunBook, as FleetWorkflow is over core/fleet/model.py: the workflow
waits and calls activities, the book records what came of it. Pure: the time comes in as an argument,
and a change of state is checked against core/run/lifecycle.py's table. A move the table does not have
is a bug, not a decision: it raises (IllegalMove), and the workflow task fails and is retried until
a fixed worker takes it, the run untouched meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from stayalive.core.decisions.fencing import PartitionReport, amend
from stayalive.core.decisions.paging import classify, over_limit
from stayalive.core.decisions.recovery import file_judged, mark_suspect, supersede
from stayalive.core.fleet.model import FailureRate
from stayalive.core.judgement.escalation import Escalation
from stayalive.core.judgement.eviction import Eviction
from stayalive.core.messages.events import (
    CheckpointJudged,
    FirstStep,
    MonitorEvent,
    RanksFinished,
    SlowdownFound,
    StorageOutage,
    StragglerFound,
)
from stayalive.core.protocol.telemetry import Command, CommandKind, SdcCheck
from stayalive.core.run.launch import Membership, node_of, without_node
from stayalive.core.run.lifecycle import RunState, why
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import REJECTED_KEPT, CheckpointRecord, IntervalChoice, RunStatus, Sample, append_bounded
from stayalive.core.run.timeline import (
    DETECTIONS_KEPT,
    INTERRUPTIONS_KEPT,
    PLANNED,
    Cause,
    Classification,
    Detection,
    Interruption,
    PagingClass,
    is_planned,
)


def _ignore(*_: object) -> None:
    pass


class IllegalMove(Exception):
    """A change of state that core/run/lifecycle.py's table does not have."""


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
        self.held_at: int | None = None  # the step every rank holds at, while a drain or a pause is judged

    @property
    def spec(self) -> RunSpec:
        return self.status.spec

    @property
    def state(self) -> RunState:
        return self.status.state

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

    def complete(self, step: int, now: datetime) -> None:
        """Every rank reached the target step and its checkpoint is valid: on storage, so storage that
        was away is back (its last ranks may exit before the monitor reads the commit that said so)."""
        self.status.progress.step = step
        self._storage_back(step, now.timestamp())
        self.move(RunState.COMPLETED)

    def finish(self, now: datetime) -> None:
        self.status.finished_at = now

    # -- state ---------------------------------------------------------------------------------

    def move(self, to: RunState, note: str = "") -> None:
        """Change state as the lifecycle allows (the same state again: news for the web UI's details)."""
        current = self.status.state
        if current != to and why(current, to) is None:
            raise IllegalMove(f"the run's lifecycle has no move from {current} to {to} ({note or 'no note'})")
        self.status.state = to
        self.on_move(self.status, note)

    def fail(self, reason: str) -> None:
        """The run cannot go on, whoever tries: nothing will resume it."""
        self.status.failure = reason
        self.move(RunState.FAILED, reason)

    def stop(self, reason: str) -> None:
        """Nobody trains until a person (or, below min_nodes, a free node) lets the run go on."""
        self.status.failure = reason
        self.move(RunState.STOPPED, reason)

    # -- the timeline --------------------------------------------------------------------------

    def record(self, interruption: Interruption) -> None:
        """The one place a timeline row is written. The next generation fills in where it resumed."""
        status = self.status
        verdict = over_limit(status.interruptions, interruption, self.spec.failure_limit)
        status.interruptions.append(interruption)
        while len(status.interruptions) > INTERRUPTIONS_KEPT:
            self._fold(status.interruptions.pop(0))
        status.generation += 1
        if verdict is not None:
            interruption.actions.append(verdict)
            self.fail(verdict)
        elif len(status.nodes) < self.spec.min_nodes:
            self.stop(f"waiting for nodes: {len(status.nodes)} of the {self.spec.min_nodes} needed")

    def _fold(self, interruption: Interruption) -> None:
        """An old interruption leaves the timeline for the totals (long since restarted from)."""
        earlier = self.status.earlier_interruptions
        earlier.count += 1
        earlier.failures += not is_planned(interruption)
        earlier.by_cause[interruption.cause.value] = earlier.by_cause.get(interruption.cause.value, 0) + 1
        earlier.lost_seconds += (interruption.lost_steps or 0) * self.status.progress.step_seconds_p50
        earlier.idle_seconds += interruption.idle_seconds
        earlier.recovery_seconds += interruption.restart_seconds or 0.0
        if is_planned(interruption):
            earlier.planned_recovery_seconds += interruption.restart_seconds or 0.0
        earlier.newest_at = interruption.at

    def failed(
        self, interruption: Interruption, baseline_mtbf_s: float, recent_goodput: float | None
    ) -> Classification:
        """Record a failure with its paging class (docs/architecture.md §12), judged against the timeline before it; the
        same step failing twice stops the run for a person (data or code, not hardware)."""
        paging = classify(self.status.interruptions, interruption, baseline_mtbf_s, recent_goodput)
        interruption.paging = paging
        self.record(interruption)
        if paging.paging == PagingClass.DETERMINISTIC and not self.state.terminal:
            self.stop(f"{paging.rule}: {paging.evidence}. {paging.action}")
            interruption.actions.append("stopped the run for a person")
        return paging

    def detect(self, detection: Detection) -> None:
        """Something that stopped nothing (a straggler, a slowdown, a skipped update). The newest
        DETECTIONS_KEPT stay listed; every one is counted."""
        status = self.status
        status.detection_counts[detection.kind] = status.detection_counts.get(detection.kind, 0) + 1
        status.detections.append(detection)
        del status.detections[:-DETECTIONS_KEPT]

    def lingered(self, finished: RanksFinished, now: datetime) -> None:
        """Ranks still running an exit grace after another finished: the run's release stops them."""
        ranks = finished.lingering
        shown = ", ".join(str(r) for r in ranks[:16]) + (f", … ({len(ranks)} ranks)" if len(ranks) > 16 else "")
        self.detect(
            Detection(
                at=now,
                generation=finished.generation,
                kind="lingered",
                step=finished.progress.step,
                rank=ranks[0],
                node=node_of(self.status.nodes, self.spec.ranks_per_node, ranks[0]),
                evidence=f"rank {shown} still running {finished.grace_s:g}s after the first rank finished",
                actions=["stopped them and completed the run (health.exit_grace)"],
            )
        )

    def storage(self, event: StorageOutage) -> Classification | None:
        """Checkpoint storage went away, stayed away, or came back: one detection per outage, however
        many generations it spans. Returns the page to send when it has outlasted paging's bound."""
        status = self.status
        if event.phase == "began":
            if status.storage_outage is None:
                status.storage_outage = event.outage
                self.detect(
                    Detection(
                        at=datetime.fromtimestamp(event.outage.since, UTC),
                        generation=status.generation,
                        kind="storage_outage",
                        step=event.outage.step,
                        evidence=event.outage.error,
                        actions=["training goes on: checkpoints stay in host memory (this node's and a replica's)"],
                    )
                )
            return None
        if event.phase == "lasting":
            if status.storage_outage is None or status.storage_outage.paged:
                return None  # over already, or a monitor restarted from an older place found it again
            status.storage_outage = event.outage
            if (ongoing := self._storage_detection()) is not None:
                ongoing.paging = event.paging
                ongoing.actions.append(f"paged after {event.lasted_s:.0f}s")
            return event.paging
        self._storage_back(event.landed_step, event.at)
        return None

    def _storage_back(self, landed_step: int | None, at: float) -> None:
        """A checkpoint landed on storage: the outage, if one is open, is over."""
        status = self.status
        if (outage := status.storage_outage) is None:
            return
        status.storage_outage = None
        if (ongoing := self._storage_detection()) is not None:
            lasted = max(0.0, at - outage.since)
            ongoing.actions.append(f"storage back after {lasted:.0f}s: the checkpoint of step {landed_step} landed")

    def _storage_detection(self) -> Detection | None:
        """The open outage's detection (None once the newest detections have pushed it out)."""
        return next((d for d in reversed(self.status.detections) if d.kind == "storage_outage"), None)

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

    # -- what the monitor reports --------------------------------------------------------------

    def known(self, event: MonitorEvent) -> bool:
        """Already recorded: a monitor restarted from an older place found it again."""
        if isinstance(event, StragglerFound):
            return event.rank in self.status.known_stragglers()
        return isinstance(event, SlowdownFound) and self.status.slowdown_known()

    def observe(self, event: MonitorEvent) -> None:
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
        if status.state in (RunState.LAUNCHING, RunState.RESUMING):
            self.move(RunState.RUNNING)

    # -- checkpoints ---------------------------------------------------------------------------

    def file_verdicts(self, verdicts: list[CheckpointJudged]) -> None:
        """The keeper's verdicts on the current generation's checkpoints. One that arrives after its
        generation ended counts only for what retention deleted: the restart judged storage itself."""
        status = self.status
        for judged in verdicts:
            self._deleted(judged.deleted)
            if judged.generation != status.generation:
                continue
            if any(c.path == judged.checkpoint.path for c in status.checkpoints):
                continue  # a keeper restarted from an older place judged it again
            checkpoint = judged.checkpoint
            status.verified_step = file_judged(status.checkpoints, status.verified_step, checkpoint)
            status.progress.step = max(status.progress.step, checkpoint.step)
            sample = Sample(
                at=checkpoint.written_at, step=checkpoint.step, step_seconds_p50=status.progress.step_seconds_p50
            )
            append_bounded(status.samples, sample)
            if status.state == RunState.CHECKPOINTING and self.held_at is None:
                self.move(RunState.RUNNING)
            self.on_progress(status)

    def file_leftovers(self, found: list[CheckpointRecord]) -> None:
        """What the last generation committed that nobody had judged, judged before a restart: what
        ranks halted by an SDC check or sent back by a rollback left is marked as such."""
        status = self.status
        status.checkpoints.extend(found)
        for interruption in status.interruptions:
            earlier = [c for c in found if c.generation <= interruption.generation]
            if (check := interruption.sdc_check) is not None:
                mark_suspect(earlier, interruption.generation, check.last_verified)
            if interruption.cause == Cause.ROLLBACK and interruption.resumed_from is not None:
                supersede(earlier, interruption.resumed_from)

    def corrupted(self, check: SdcCheck) -> list[CheckpointRecord]:
        """A failed SDC check: what was written after the last passing check may hold corrupted state and
        becomes suspect; the timeline that restarts is verified up to where it starts."""
        status = self.status
        suspect = mark_suspect(status.checkpoints, status.generation, check.last_verified)
        resume = status.latest_valid_checkpoint()
        status.verified_step = resume.step if resume else 0
        return suspect

    def judged(self, step: int, generation: int) -> bool:
        return any(c.step == step and c.generation == generation for c in self.status.checkpoints)

    def _deleted(self, paths: list[str]) -> None:
        """Retention deleted these: their records leave the state, their totals stay, and so does
        the record of one refused (invalid or suspect), among the newest REJECTED_KEPT."""
        if not paths:
            return
        status, gone = self.status, set(paths)
        summary = status.deleted_checkpoints
        for record in status.checkpoints:
            if record.path in gone:
                summary.count += 1
                summary.blocking_seconds += record.blocking_seconds
                summary.newest_step = max(summary.newest_step or 0, record.step)
                if record.validated is False or record.suspect:
                    status.rejected_checkpoints.append(record)
        del status.rejected_checkpoints[:-REJECTED_KEPT]
        status.checkpoints = [c for c in status.checkpoints if c.path not in gone]

    # -- requests ------------------------------------------------------------------------------

    def rollback(self, step: int, now: datetime) -> str:
        """Everything after `step` is abandoned; the next generation restarts from its checkpoint."""
        status = self.status
        superseded = supersede(status.checkpoints, step)
        status.verified_step = min(status.verified_step, step)
        interruption = Interruption(
            at=now,
            generation=status.generation,
            detected_by="operator",
            cause=Cause.ROLLBACK,
            step=status.progress.step,
            detail=f"resume_from step {step}",
            actions=[f"marked {len(superseded)} later checkpoints superseded"],
            paging=PLANNED,
        )
        interruption.resumed_at(step)  # also what a checkpoint judged only later is measured against
        self.record(interruption)
        return f"{len(superseded)} later checkpoints superseded"

    def idled(self, seconds: float) -> None:
        """The run waited `seconds` for a person or for nodes after its last interruption."""
        if self.status.interruptions:
            self.status.interruptions[-1].idle_seconds += seconds

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

    def keep_survivors(self, membership: Membership | None) -> None:
        """After a hold, the next generation keeps the survivors' processes (newcomers start fresh)."""
        self.status.membership = membership

    def joined(self, spare: str) -> None:
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
