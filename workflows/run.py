"""RunWorkflow: carries one training run to its target step, through every interruption.

A run is a sequence of generations. Each generation prepares its nodes, starts their ranks
(`run_ranks` on every node's queue) and a run monitor, then waits for the first decisive event:
a checkpoint to validate, a first step to time, a failed rank, a lost node, or every rank done.
Workflow code decides; every side effect is an activity with a summary a human can read.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from pydantic import Discriminator, Tag, ValidationError
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.workflow import ActivityHandle

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from activities.checkpoints import ValidateCheckpoint, Verdict, validate_checkpoint
    from activities.monitor import monitor_run
    from activities.node import NodeActivities, NodeCommand, PrepareGeneration
    from core.events import (
        CheckpointWritten,
        FirstStep,
        MonitorEvent,
        MonitorInput,
        NodeOutcome,
        RankFailed,
        RanksFinished,
    )
    from core.goodput import ledger
    from core.interval import interval, mtbf
    from core.launch import NodeEndpoint, NodeLaunch, assign_ranks, supervision_env
    from core.run import Cause, CheckpointRecord, Interruption, RunResult, RunState, RunStatus
    from core.spec import RunSpec
    from core.telemetry import Command

TASK_QUEUE = "stayalive"
FOREVER = timedelta(days=3650)


def node_queue(node: str) -> str:
    return f"node.{node}"


class CarriedRun(BaseModel):
    """What continue-as-new hands to the next segment of the same run."""

    status: RunStatus


RunInput = Annotated[
    Annotated[RunSpec, Tag("spec")] | Annotated[CarriedRun, Tag("carried")],
    Discriminator(
        lambda v: "carried" if isinstance(v, CarriedRun) or (isinstance(v, dict) and "status" in v) else "spec"
    ),
]


class NodeLost(BaseModel):
    node: str
    detail: str


@workflow.defn(failure_exception_types=[ValidationError])
class RunWorkflow:
    @workflow.init
    def __init__(self, input: RunInput) -> None:
        if isinstance(input, CarriedRun):
            self.status = input.status
        else:
            info = workflow.info()
            self.status = RunStatus(spec=input, run_id=f"{info.workflow_id}/{info.first_execution_run_id[:8]}")
        self.run_id = self.status.run_id
        self._validations: list[asyncio.Task[None]] = []

    @property
    def spec(self) -> RunSpec:
        return self.status.spec

    @workflow.run
    async def run(self, input: RunInput) -> RunResult:
        if self.status.started_at is None:
            self.status.started_at = workflow.now()
        try:
            while not self.status.state.terminal:
                await self._generation()
        except asyncio.CancelledError:
            await self._stop_everywhere()
            self._set_state(RunState.CANCELLED)
            raise
        await asyncio.gather(*self._validations)
        self.status.finished_at = workflow.now()
        return RunResult(
            run_id=self.run_id,
            state=self.status.state,
            final_step=self.status.progress.step,
            interruptions=self.status.interruptions,
            ledger=ledger(self.status, workflow.now()),
            failure=self.status.failure,
        )

    @workflow.query
    def status_query(self) -> RunStatus:
        return self.status

    @workflow.query
    def timeline(self) -> list[Interruption]:
        return self.status.interruptions

    @workflow.signal
    async def force_checkpoint(self) -> None:
        """Checkpoint at the next step every rank agrees on (before maintenance, say)."""
        await self._command("checkpoint")

    # -- one generation -------------------------------------------------------------------------

    async def _generation(self) -> None:
        status, spec = self.status, self.spec
        resume = status.latest_valid_checkpoint()
        self._set_state(RunState.LAUNCHING if status.generation == 0 else RunState.RESUMING)
        endpoints = status.endpoints = await self._prepare(spec.nodes)
        rendezvous = endpoints[0].rendezvous
        assert rendezvous is not None
        env = spec.env | supervision_env(
            spec,
            self.run_id,
            status.checkpoint_dir,
            status.generation,
            resume.path if resume else None,
            self._checkpoint_seconds(),
        )
        ranks = assign_ranks(spec.nodes, spec.ranks_per_node)
        nodes = {
            node: self._run_ranks(
                NodeLaunch(
                    run_id=self.run_id,
                    node=node,
                    generation=status.generation,
                    ranks=ranks[node],
                    world_size=spec.world_size,
                    rendezvous=rendezvous,
                    entrypoint=spec.entrypoint,
                    env=env,
                ),
                resume,
            )
            for node in spec.nodes
        }
        monitor = self._monitor(endpoints, first_step=True) if spec.hooks else None
        finished: dict[str, RanksFinished] = {}
        while True:
            waiting: list[asyncio.Future] = [t for n, t in nodes.items() if n not in finished]
            done, _ = await workflow.wait(
                [*waiting, *([monitor] if monitor else [])], return_when=asyncio.FIRST_COMPLETED
            )
            if monitor is not None and monitor in done:
                self._on_monitor_event(monitor.result())
                monitor = self._monitor(endpoints, first_step=False)
            for node, task in nodes.items():
                if task in done:
                    outcome = await self._outcome(node, task)
                    if isinstance(outcome, RanksFinished):
                        finished[node] = outcome
                    else:
                        await self._interrupt(outcome, [*nodes.values(), monitor])
                        return
            if len(finished) == len(nodes):
                await self._finish(monitor)
                return

    async def _prepare(self, nodes: list[str]) -> list[NodeEndpoint]:
        generation = self.status.generation
        return list(
            await asyncio.gather(
                *(
                    workflow.execute_activity_method(
                        NodeActivities.prepare_generation,
                        PrepareGeneration(run_id=self.run_id, generation=generation, host_rendezvous=i == 0),
                        task_queue=node_queue(node),
                        schedule_to_start_timeout=timedelta(seconds=self.spec.health.node_heartbeat_timeout),
                        start_to_close_timeout=timedelta(minutes=2),
                        retry_policy=RetryPolicy(maximum_attempts=3),
                        summary=f"{node}: stop earlier ranks"
                        + (", open a fresh rendezvous store" if i == 0 else "")
                        + f" for generation {generation}",
                    )
                    for i, node in enumerate(nodes)
                )
            )
        )

    def _run_ranks(self, launch: NodeLaunch, resume: CheckpointRecord | None) -> ActivityHandle[NodeOutcome]:
        origin = f"from checkpoint step {resume.step}" if resume else "from scratch"
        return workflow.start_activity_method(
            NodeActivities.run_ranks,
            launch,
            task_queue=node_queue(launch.node),
            start_to_close_timeout=FOREVER,
            heartbeat_timeout=timedelta(seconds=self.spec.health.node_heartbeat_timeout),
            # Never retried: a second launch on a node the workflow knows nothing about would be a guess.
            retry_policy=RetryPolicy(maximum_attempts=1),
            summary=f"run ranks {launch.ranks[0]}-{launch.ranks[-1]} on {launch.node}, "
            f"generation {launch.generation}, {origin}",
        )

    def _monitor(self, endpoints: list[NodeEndpoint], first_step: bool) -> ActivityHandle[MonitorEvent]:
        resume = self.status.latest_valid_checkpoint()
        purpose = "until its first step" if first_step else "for the next checkpoint"
        return workflow.start_activity(
            monitor_run,
            MonitorInput(
                run_id=self.run_id,
                generation=self.status.generation,
                world_size=self.spec.world_size,
                endpoints=endpoints,
                resume_step=resume.step if resume else 0,
                await_first_step=first_step,
                after=self.status.telemetry_cursor,
            ),
            start_to_close_timeout=FOREVER,
            heartbeat_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=5)),
            summary=f"watch generation {self.status.generation} {purpose}",
        )

    async def _outcome(self, node: str, task: ActivityHandle[NodeOutcome]) -> NodeOutcome | NodeLost:
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
        if isinstance(event, FirstStep):
            at = datetime.fromtimestamp(event.at, UTC)
            if status.first_step_at is None:
                status.first_step_at = at
            last = status.interruptions[-1] if status.interruptions else None
            if last is not None and last.generation == status.generation - 1 and last.restart_seconds is None:
                last.restart_seconds = max(0.0, (at - last.at).total_seconds())
            self._set_state(RunState.RUNNING)
        elif isinstance(event, CheckpointWritten):
            record = CheckpointRecord(
                step=event.step,
                path=event.path,
                generation=status.generation,
                blocking_seconds=event.blocking_seconds,
                written_at=datetime.fromtimestamp(event.at, UTC),
            )
            status.checkpoints.append(record)
            self._validations.append(asyncio.create_task(self._validate(record)))
            self._set_state(RunState.RUNNING)

    async def _validate(self, record: CheckpointRecord) -> None:
        verdict: Verdict = await workflow.execute_activity(
            validate_checkpoint,
            ValidateCheckpoint(
                run_id=self.run_id,
                root=self.spec.checkpoint.root,
                checkpoint=record,
                history=self.status.checkpoints,
            ),
            start_to_close_timeout=timedelta(minutes=30),
            heartbeat_timeout=timedelta(seconds=30),
            summary=f"validate checkpoint step {record.step} (generation {record.generation})",
        )
        record.validated, record.reason, record.param_norm = (
            verdict.validated,
            verdict.reason,
            verdict.param_norm,
        )

    async def _interrupt(self, outcome: RankFailed | NodeLost, running: list[ActivityHandle | None]) -> None:
        status = self.status
        self._set_state(RunState.DIAGNOSING)
        await self._cancel(running)
        await asyncio.gather(*self._validations)
        resume = status.latest_valid_checkpoint()
        resumed_from = resume.step if resume else 0
        if isinstance(outcome, RankFailed):
            interruption = Interruption(
                at=datetime.fromtimestamp(outcome.at, UTC),
                generation=status.generation,
                detected_by="node agent: rank process exited",
                cause=Cause.CRASH,
                node=outcome.node,
                rank=outcome.rank,
                step=outcome.last_step,
                detail=f"exit code {outcome.exit_code}" + _last_line(outcome.log_tail),
            )
        else:
            interruption = Interruption(
                at=workflow.now(),
                generation=status.generation,
                detected_by="node agent heartbeat timeout",
                cause=Cause.NODE_LOST,
                node=outcome.node,
                step=status.progress.step,
                detail=outcome.detail,
            )
        self._record(interruption, resumed_from)

    async def _finish(self, monitor: ActivityHandle[MonitorEvent] | None) -> None:
        """Every rank exited cleanly. Done only once the final checkpoint is recorded and valid."""
        target = self.spec.target_step
        if monitor is not None and target is not None:
            # The monitor may still be reading what the ranks sent before exiting (or catching up
            # after a supervisor restart): take its events until the final checkpoint is among them.
            deadline = workflow.now() + timedelta(seconds=60)
            while not any(c.step == target for c in self.status.checkpoints) and workflow.now() < deadline:
                done, _ = await workflow.wait([monitor], timeout=(deadline - workflow.now()).total_seconds())
                if monitor not in done:
                    break
                self._on_monitor_event(monitor.result())
                monitor = self._monitor(self.status.endpoints, first_step=False)
            await self._cancel([monitor])
            await asyncio.gather(*self._validations)
            if not any(c.step == target and c.validated for c in self.status.checkpoints):
                resume = self.status.latest_valid_checkpoint()
                self._record(
                    Interruption(
                        at=workflow.now(),
                        generation=self.status.generation,
                        detected_by="final checkpoint validation",
                        cause=Cause.CHECKPOINT_INVALID,
                        step=target,
                        detail=f"ranks finished but no valid checkpoint of step {target}",
                    ),
                    resume.step if resume else 0,
                )
                return
            self.status.progress.step = target
        self._set_state(RunState.COMPLETED)

    def _record(self, interruption: Interruption, resumed_from: int) -> None:
        interruption.resumed_from = resumed_from
        if interruption.step is not None:
            interruption.lost_steps = max(0, interruption.step - resumed_from)
        self.status.interruptions.append(interruption)
        workflow.logger.warning("interruption: %s", interruption.line())
        self.status.generation += 1
        if len(self.status.interruptions) > self.spec.max_restarts:
            self.status.failure = f"gave up after {self.spec.max_restarts} restarts; last: {interruption.line()}"
            self._set_state(RunState.FAILED)

    # -- helpers --------------------------------------------------------------------------------

    def _checkpoint_seconds(self) -> float | None:
        cfg = self.spec.checkpoint
        if cfg.interval.kind == "seconds":
            return cfg.interval.value
        if cfg.interval.kind != "auto":
            return None
        measured = [c.blocking_seconds for c in self.status.checkpoints]
        if not measured:
            return cfg.min_interval  # the first checkpoint comes early: it measures C
        assert self.status.started_at is not None
        observed = (workflow.now() - self.status.started_at).total_seconds()
        m = mtbf(observed, len(self.status.interruptions), cfg.prior_mtbf)
        return interval(measured[-1], m, cfg.min_interval, cfg.max_interval)

    async def _command(self, kind: Literal["checkpoint", "exit"]) -> None:
        self.status.command_seq += 1
        command = Command(seq=self.status.command_seq, kind=kind)
        await asyncio.gather(
            *(
                workflow.execute_activity_method(
                    NodeActivities.send_command,
                    NodeCommand(run_id=self.run_id, command=command),
                    task_queue=node_queue(node),
                    start_to_close_timeout=timedelta(seconds=30),
                    summary=f"{node}: tell ranks to {kind}",
                )
                for node in self.spec.nodes
            )
        )

    async def _cancel(self, handles: list[ActivityHandle | None]) -> None:
        live = [h for h in handles if h is not None and not h.done()]
        for handle in live:
            handle.cancel()
        await asyncio.gather(*live, return_exceptions=True)

    async def _stop_everywhere(self) -> None:
        await asyncio.gather(
            *(
                workflow.execute_activity_method(
                    NodeActivities.stop_ranks,
                    self.run_id,
                    task_queue=node_queue(node),
                    start_to_close_timeout=timedelta(minutes=1),
                    summary=f"{node}: stop every rank of this run",
                )
                for node in self.spec.nodes
            ),
            return_exceptions=True,
        )

    def _set_state(self, state: RunState) -> None:
        self.status.state = state
        status = self.status
        workflow.set_current_details(
            f"**{state.value}** · generation {status.generation} · step {status.progress.step}"
            f"/{self.spec.target_step or '?'} · {len(status.interruptions)} interruptions"
        )


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return f": {lines[-1][-200:]}" if lines else ""


if __name__ == "__main__":
    raise SystemExit("RunWorkflow runs in the supervisor worker: python -m workers.supervisor")
