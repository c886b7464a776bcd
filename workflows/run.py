"""RunWorkflow: carries one training run to its target step, through every interruption.

A run is a sequence of generations (workflows/generation.py). Between them the workflow decides:
after a crash, quarantine the node and restart from the newest valid checkpoint on a spare or at
reduced width; for a drain, the auto-cordon sequence (drain → wait → checkpoint → resize → resume)
with the survivors kept alive; for a pause, a hold until a person resumes. Workflow code decides;
every side effect is an activity (workflows/calls.py).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from pydantic import Discriminator, Tag, ValidationError
from temporalio import workflow
from temporalio.common import SearchAttributeKey, SearchAttributeUpdate
from temporalio.exceptions import ActivityError

from workflows import calls, checkpoints, generation, incidents, requests, stragglers
from workflows.generation import Generation
from workflows.requests import Request

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from core.events import (
        CHECKPOINT_JUDGED,
        MONITOR_REPORT,
        AnomalyFound,
        CheckpointJudged,
        FirstStep,
        Hang,
        HealthyWindows,
        MonitorEvent,
        MonitorReport,
        NodeLost,
        NodeOutcome,
        RanksFinished,
        SdcDetected,
        SlowdownFound,
        SlownessTally,
        StragglerFound,
    )
    from core.goodput import ledger
    from core.health import Health, health_table
    from core.interval import checkpoint_seconds, checkpoint_steps
    from core.run import Cause, CheckpointRecord, Detection, Interruption, RunResult, RunState, RunStatus
    from core.spec import RunSpec
    from core.telemetry import Command

TASK_QUEUE = "stayalive"
# Every rank has finished, so the final checkpoint is on storage; its verdict is one validation away.
FINAL_VERDICT_WITHIN = timedelta(minutes=2)
# Continue-as-new waits for the next generation boundary, where there is nothing to re-attach to; in
# the middle of a generation only once the server's suggestion is this old (a long healthy stretch).
REATTACH_AFTER = timedelta(minutes=10)
# Step and Goodput are for listing and filtering runs: refreshed with every state change, and between
# changes at a checkpoint at most this often (each refresh is a history event; `health` is live).
LISTING_REFRESH = timedelta(minutes=5)
CommandKind = Literal["checkpoint", "hold", "exit", "rebalance"]
RUN_STATE = SearchAttributeKey.for_keyword("RunState")
STEP = SearchAttributeKey.for_int("Step")
GOODPUT = SearchAttributeKey.for_float("Goodput")


class CarriedRun(BaseModel):
    """What continue-as-new hands to the next segment of the same run."""

    status: RunStatus
    # Verdicts signalled while the segment was closing: the next one re-attaches to the same
    # generation and records them (a duplicate of one its monitor judges again is ignored).
    verdicts: list[CheckpointJudged] = []


RunInput = Annotated[
    Annotated[RunSpec, Tag("spec")] | Annotated[CarriedRun, Tag("carried")],
    Discriminator(
        lambda v: "carried" if isinstance(v, CarriedRun) or (isinstance(v, dict) and "status" in v) else "spec"
    ),
]


class DrainNode(BaseModel):
    node: str
    reason: str


class ResumeFrom(BaseModel):
    step: int


@workflow.defn(failure_exception_types=[ValidationError])
class RunWorkflow:
    @workflow.init
    def __init__(self, input: RunInput) -> None:
        self.verdicts: list[CheckpointJudged] = []  # from the run monitor's keeper, in the order it sent them
        if isinstance(input, CarriedRun):
            self.status, self.verdicts = input.status, input.verdicts
        else:
            info = workflow.info()
            self.status = RunStatus(
                spec=input, run_id=f"{info.workflow_id}/{info.first_execution_run_id[:8]}", nodes=list(input.nodes)
            )
        self.run_id = self.status.run_id
        self.requests: list[Request] = []
        self.reports: list[MonitorReport] = []  # from the run monitor, in the order it sent them
        self.resumed = False
        self.suggested_at: datetime | None = None  # when this segment first saw continue-as-new suggested
        self.listed_at: datetime | None = None  # when Step and Goodput were last upserted

    @property
    def spec(self) -> RunSpec:
        return self.status.spec

    @workflow.run
    async def run(self, input: RunInput) -> RunResult:
        status = self.status
        if status.started_at is None:
            status.started_at = workflow.now()
            await self._acquire()
            if self.spec.hooks:
                status.baseline = await calls.baseline(self.spec.config_digest)
        try:
            while not status.state.terminal:
                if status.state == RunState.STOPPED:
                    await requests.stopped(self)
                    continue
                await self._supervise(await self._start())
                if self._continue_as_new_due(between_generations=True):
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    workflow.continue_as_new(CarriedRun(status=status, verdicts=self.verdicts))
        except asyncio.CancelledError:
            await self._release()
            self.set_state(RunState.CANCELLED)
            raise
        await self._release()
        status.finished_at = workflow.now()
        return RunResult(
            run_id=self.run_id,
            state=status.state,
            final_step=status.progress.step,
            interruptions=status.interruptions,
            ledger=ledger(status, workflow.now()),
            failure=status.failure,
        )

    # -- what a person can ask ------------------------------------------------------------------

    @workflow.query
    def status_query(self) -> RunStatus:
        return self.status

    @workflow.query
    def health(self) -> Health:
        return Health.of(self.status, workflow.now(), self._checkpoint_seconds())

    @workflow.query
    def timeline(self) -> list[Interruption]:
        return self.status.interruptions

    @workflow.query
    def detections(self) -> list[Detection]:
        """Stragglers, slowdowns and skipped updates: nothing stopped, so not interruptions."""
        return self.status.detections

    @workflow.query
    def checkpoints(self) -> list[CheckpointRecord]:
        """Every checkpoint the run wrote: validated or not, and why; SDC-verified, unverified or
        suspect; deleted by retention or kept."""
        return self.status.checkpoints

    @workflow.signal
    async def force_checkpoint(self) -> None:
        """Checkpoint at the next step every rank agrees on (before maintenance, say)."""
        self.set_state(RunState.CHECKPOINTING)
        await self.command("checkpoint", "checkpoint at the next step all ranks agree on")

    @workflow.signal(name=MONITOR_REPORT)
    def monitor_report(self, report: MonitorReport) -> None:
        """What the run monitor found (activities/monitor.py); handled by the main loop."""
        self.reports.append(report)

    @workflow.signal(name=CHECKPOINT_JUDGED)
    def checkpoint_judged(self, judged: CheckpointJudged) -> None:
        """A checkpoint the ranks committed, with the keeper's verdict; recorded by the main loop."""
        self.verdicts.append(judged)

    @workflow.signal
    def pause(self, reason: str = "paused by an operator") -> None:
        self.requests.append(Request(kind="pause", reason=reason))

    @workflow.signal
    def resume(self) -> None:
        self.resumed = True

    @workflow.update
    async def drain_node(self, request: DrainNode) -> str:
        """Take a node out of the run: drain, wait, checkpoint, resize (spare or fewer nodes), resume."""
        return await self._carry_out(Request(kind="drain", node=request.node, reason=request.reason))

    @drain_node.validator
    def _check_drain(self, request: DrainNode) -> None:
        if not self.spec.hooks:
            raise ValueError("drain_node needs a run with hooks: a plain script cannot hold at a step")
        if request.node not in self.status.nodes:
            raise ValueError(f"{request.node} is not in this run; its nodes are {', '.join(self.status.nodes)}")
        if self.status.state != RunState.RUNNING:
            raise ValueError(f"the run is {self.status.state.value}; drain a node once it is RUNNING")

    @workflow.update
    async def resume_from(self, request: ResumeFrom) -> str:
        """Roll the run back to the validated checkpoint of `step` and continue from there."""
        return await self._carry_out(Request(kind="rollback", step=request.step))

    @resume_from.validator
    def _check_resume_from(self, request: ResumeFrom) -> None:
        if not any(c.step == request.step and c.resumable for c in self.status.checkpoints):
            valid = ", ".join(str(s) for s in sorted({c.step for c in self.status.checkpoints if c.resumable}))
            raise ValueError(
                f"no resumable checkpoint at step {request.step} (validated and not suspect of SDC); "
                f"resume_from one of the resumable steps: {valid or 'none yet'}"
            )

    async def _carry_out(self, request: Request) -> str:
        self.requests.append(request)
        await workflow.wait_condition(lambda: request.outcome is not None)
        return request.outcome or ""

    # -- generations ----------------------------------------------------------------------------

    async def _acquire(self) -> None:
        """Ask the fleet for the spec's nodes; a refused one is replaced by a spare or left out."""
        grant = await calls.acquire(self.run_id, self.spec.nodes)
        nodes = list(self.status.nodes)
        for node, why in grant.refused.items():
            workflow.logger.warning("fleet refused %s: %s", node, why)
            spare = await calls.take_spare(self.run_id, self.spare_candidates())
            nodes = [spare if n == node else n for n in nodes] if spare else [n for n in nodes if n != node]
            if spare:
                self.status.spares_used.append(spare)
        self.status.nodes = nodes
        if len(nodes) < self.spec.min_nodes:
            self.stop(f"the fleet has {len(nodes)} usable nodes of the {self.spec.min_nodes} this run needs")

    async def _start(self) -> Generation:
        status = self.status
        fresh = status.membership is None and not status.reattach
        if not status.reattach:
            self.set_state(RunState.LAUNCHING if status.generation == 0 else RunState.RESUMING)
        # Judging what the last generation left and preparing the nodes do not wait for each other.
        asked = generation.endpoints(status, fresh_store=not status.reattach)
        if fresh and status.generation > 0:
            status.endpoints, _ = await asyncio.gather(asked, checkpoints.judge_leftovers(self))
        else:
            status.endpoints = await asked
        if status.interruptions and status.interruptions[-1].resumed_from is None:
            resume = status.latest_valid_checkpoint()
            status.interruptions[-1].resumed_at(resume.step if resume else 0)
        started = generation.start(status, self._checkpoint_seconds(), self.checkpoint_steps())
        status.membership, status.reattach = None, False
        return started

    async def _supervise(self, gen: Generation) -> None:
        """Handle this generation's events until it ends (interruption, completion, a request, continue-as-new)."""
        while True:
            ask = asyncio.ensure_future(
                workflow.wait_condition(lambda: bool(self.requests or self.reports or self.verdicts))
            )
            done, _ = await workflow.wait([*gen.waiting(), ask], return_when=asyncio.FIRST_COMPLETED)
            if not ask.done():
                ask.cancel()
            while self.reports:
                report = self.reports.pop(0)
                if report.generation == gen.number and await self._on_report(gen, report.event):
                    return
            checkpoints.take_verdicts(self, gen)
            for node, task in gen.nodes.items():
                if task in done:
                    outcome = await self.outcome(node, task)
                    if isinstance(outcome, RanksFinished):
                        gen.finished.add(node)
                    else:
                        await incidents.failure(self, gen, outcome)
                        return
            if len(gen.finished) == len(gen.nodes):
                await self._finish(gen)
                return
            if self.requests:
                await requests.carry_out(self, self.requests.pop(0), gen)
                return
            if self._continue_as_new_due(between_generations=False):
                self.status.reattach = True
                await gen.cancel()
                return

    async def _on_report(self, gen: Generation, event: MonitorEvent) -> bool:
        """Act on one of the monitor's findings; True when it ended the generation (a hang, SDC)."""
        if self._known(event):
            return False  # a monitor restarted from an older heartbeat found it again
        self._on_monitor_event(event)
        if isinstance(event, Hang):
            await incidents.hang(self, gen, event)
            return True
        if isinstance(event, SdcDetected):
            await incidents.sdc(self, gen, event)
            return True
        if isinstance(event, AnomalyFound):
            incidents.anomaly(self, event)
        elif isinstance(event, StragglerFound):
            await stragglers.settle(self, resolved=False)
            await stragglers.straggler(self, event)
        elif isinstance(event, SlowdownFound):
            await stragglers.slowdown(self, event)
        elif isinstance(event, SlownessTally):
            await stragglers.climb(self)
        elif isinstance(event, HealthyWindows):
            await stragglers.settle(self, resolved=True)
            await calls.record_baseline(self.spec.config_digest, event.medians)
        return False

    def _known(self, event: MonitorEvent) -> bool:
        if isinstance(event, StragglerFound):
            return event.rank in self.status.known_stragglers()
        return isinstance(event, SlowdownFound) and self.status.slowdown_known()

    async def outcome(self, node: str, task: asyncio.Future[NodeOutcome]) -> NodeOutcome | NodeLost:
        try:
            return await task
        except ActivityError as exc:
            # A heartbeat timeout: the node agent is gone (dead host, partition, killed agent).
            return NodeLost(node=node, detail=f"{exc.cause or exc}")

    # -- events ---------------------------------------------------------------------------------

    def _on_monitor_event(self, event: MonitorEvent) -> None:
        status = self.status
        status.progress = event.progress
        status.telemetry_cursor = event.after
        status.straggler_seconds += event.progress.straggler_s  # the monitor counts afresh after each report
        if isinstance(event, FirstStep):
            at = datetime.fromtimestamp(event.at, UTC)
            if status.first_step_at is None:
                status.first_step_at = at
            last = status.interruptions[-1] if status.interruptions else None
            if last is not None and last.generation == status.generation - 1 and last.restart_seconds is None:
                last.restart_seconds = max(0.0, (at - last.at).total_seconds() - last.idle_seconds)
                last.restored_from = last.restored_from or event.restored_from
            if status.state in (RunState.LAUNCHING, RunState.RESUMING):
                self.set_state(RunState.RUNNING)

    def list_progress(self) -> None:
        """Refresh Step and Goodput between state changes, at most every LISTING_REFRESH."""
        if self.listed_at is None or workflow.now() - self.listed_at >= LISTING_REFRESH:
            self._list()

    def record(self, interruption: Interruption) -> None:
        """Add the interruption to the timeline; the generation that follows fills in where it resumed."""
        status = self.status
        status.interruptions.append(interruption)
        workflow.logger.warning("interruption: %s", interruption.line())
        status.generation += 1
        if len(status.interruptions) > self.spec.max_restarts:
            status.failure = f"gave up after {self.spec.max_restarts} restarts; last: {interruption.line()}"
            self.set_state(RunState.FAILED)
        elif len(status.nodes) < self.spec.min_nodes:
            self.stop(f"waiting for nodes: {len(status.nodes)} of the {self.spec.min_nodes} needed")

    async def _finish(self, gen: Generation) -> None:
        """Every rank exited cleanly. Done only once the final checkpoint is judged valid."""
        target = self.spec.target_step
        if gen.monitor is not None and target is not None:
            # The keeper may still be validating what the ranks wrote last (or catching up after a
            # supervisor restart): take its verdicts until the final checkpoint's is among them.
            # A generation that resumed from the target's own checkpoint has nothing more to write.
            while not any(
                c.step == target and (c.generation == gen.number or c.resumable) for c in self.status.checkpoints
            ):
                try:
                    await workflow.wait_condition(lambda: bool(self.verdicts), timeout=FINAL_VERDICT_WITHIN)
                except TimeoutError:
                    # Storage, not telemetry, is the record: judge what the ranks left there instead.
                    workflow.logger.warning("no verdict on the final checkpoint from the keeper; judging storage")
                    await gen.cancel()
                    await checkpoints.judge_leftovers(self)
                    break
                checkpoints.take_verdicts(self, gen)
            await gen.cancel()
            if not any(c.step == target and c.validated for c in self.status.checkpoints):
                self.record(
                    Interruption(
                        at=workflow.now(),
                        generation=self.status.generation,
                        detected_by="final checkpoint validation",
                        cause=Cause.CHECKPOINT_INVALID,
                        step=target,
                        detail=f"ranks finished but the checkpoint of step {target} is not valid",
                    )
                )
                return
            self.status.progress.step = target
        self.set_state(RunState.COMPLETED)

    # -- helpers --------------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        self.status.failure = reason
        self.set_state(RunState.STOPPED, reason)

    def spare_candidates(self) -> list[str]:
        """Spares first, then the run's own nodes that are out of the group (back after a self-test)."""
        return [n for n in [*self.spec.spare_nodes, *self.spec.nodes] if n not in self.status.nodes]

    def _continue_as_new_due(self, between_generations: bool) -> bool:
        if not workflow.info().is_continue_as_new_suggested() or self.status.state.terminal:
            return False
        self.suggested_at = self.suggested_at or workflow.now()
        return between_generations or workflow.now() - self.suggested_at >= REATTACH_AFTER

    def _checkpoint_seconds(self) -> float | None:
        return checkpoint_seconds(self.status, workflow.now())

    def checkpoint_steps(self) -> float:
        return checkpoint_steps(self.status, workflow.now())

    def next_command(self, kind: CommandKind, speeds: list[float] | None = None) -> Command:
        self.status.command_seq += 1
        return Command(seq=self.status.command_seq, kind=kind, speeds=speeds or [])

    async def command(self, kind: CommandKind, summary: str, speeds: list[float] | None = None) -> None:
        command = self.next_command(kind, speeds)
        await asyncio.gather(*(calls.command(self.run_id, node, command, summary) for node in self.status.nodes))

    async def _release(self) -> None:
        """The run is over: its nodes stop its ranks and free its memory, and go back to the fleet.
        (A node that left the group earlier was released by its drain or vacated by the self-test its
        quarantine started, or died with the ranks on it.)"""
        await asyncio.gather(*(calls.release(self.run_id, n) for n in self.status.nodes), return_exceptions=True)
        await calls.release_nodes(self.run_id)

    def set_state(self, state: RunState, note: str = "") -> None:
        self.status.state = state
        workflow.set_current_details(health_table(self.status, note))
        self._list(RUN_STATE.value_set(state.value))

    def _list(self, *updates: SearchAttributeUpdate) -> None:
        """Upsert what the web UI lists and filters runs by: Step and Goodput, and any `updates`."""
        status, self.listed_at = self.status, workflow.now()
        goodput = ledger(status, workflow.now()).goodput
        workflow.upsert_search_attributes([*updates, STEP.value_set(status.progress.step), GOODPUT.value_set(goodput)])


if __name__ == "__main__":
    raise SystemExit("RunWorkflow runs in the supervisor worker: python -m workers.supervisor")
