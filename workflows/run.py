"""RunWorkflow: carries one training run to its target step, through every interruption.

A run is a sequence of generations. Each generation judges what the last one left behind, picks
the newest valid checkpoint, prepares its nodes, starts their ranks (`run_ranks` on each node's
queue), a run monitor and a checkpoint keeper, then handles events until the generation ends: a
checkpoint judged, the first step after a restart, a failed rank, a lost node, or every rank done.
Workflow code decides; every side effect is an activity (workflows/calls.py).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import Discriminator, Tag, ValidationError
from temporalio import workflow
from temporalio.exceptions import ActivityError
from temporalio.workflow import ActivityHandle

from workflows import calls

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from activities.checkpoints import ChooseInput, KeeperInput, KeeperResult
    from core.events import FirstStep, MonitorEvent, MonitorInput, NodeOutcome, RankFailed, RanksFinished
    from core.goodput import ledger
    from core.interval import interval, mtbf
    from core.launch import EXIT_CHECKPOINT_UNUSABLE, NodeEndpoint, NodeLaunch, assign_ranks, supervision_env
    from core.retention import to_delete
    from core.run import Cause, CheckpointRecord, Interruption, RunResult, RunState, RunStatus
    from core.spec import RunSpec
    from core.telemetry import Command

TASK_QUEUE = "stayalive"
node_queue = calls.node_queue


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
            await self._release()
            self._set_state(RunState.CANCELLED)
            raise
        await self._release()
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

    @workflow.query
    def checkpoints(self) -> list[CheckpointRecord]:
        """Every checkpoint the run wrote: validated or not, and why; deleted by retention or kept."""
        return self.status.checkpoints

    @workflow.signal
    async def force_checkpoint(self) -> None:
        """Checkpoint at the next step every rank agrees on (before maintenance, say)."""
        await self._command("checkpoint")

    # -- one generation -------------------------------------------------------------------------

    async def _generation(self) -> None:
        status, spec = self.status, self.spec
        if status.generation > 0:
            await self._judge_leftovers()
        resume = status.latest_valid_checkpoint()
        if status.interruptions and status.interruptions[-1].resumed_from is None:
            status.interruptions[-1].resumed_at(resume.step if resume else 0)
        self._set_state(RunState.LAUNCHING if status.generation == 0 else RunState.RESUMING)
        endpoints = status.endpoints = await self._prepare()
        rendezvous = endpoints[0].rendezvous
        assert rendezvous is not None
        env = spec.env | supervision_env(
            spec,
            self.run_id,
            status.checkpoint_dir,
            status.generation,
            resume.path if resume else None,
            self._checkpoint_seconds(),
            endpoints,
        )
        origin = f"from checkpoint step {resume.step}" if resume else "from scratch"
        nodes = {
            node: calls.run_ranks(
                NodeLaunch(
                    run_id=self.run_id,
                    node=node,
                    generation=status.generation,
                    ranks=ranks,
                    world_size=spec.world_size,
                    rendezvous=rendezvous,
                    entrypoint=spec.entrypoint,
                    env=env,
                ),
                origin,
                spec.health.node_heartbeat_timeout,
            )
            for node, ranks in assign_ranks(spec.nodes, spec.ranks_per_node).items()
        }
        monitor = self._monitor(first_step=True) if spec.hooks else None
        keeper = self._keeper() if spec.hooks else None
        finished: set[str] = set()
        while True:
            waiting = [t for n, t in nodes.items() if n not in finished] + [h for h in (monitor, keeper) if h]
            done, _ = await workflow.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if monitor is not None and monitor in done:
                self._on_monitor_event(monitor.result())
                monitor = self._monitor(first_step=False)
            if keeper is not None and keeper in done:
                self._on_checkpoint(keeper.result())
                keeper = self._keeper()
            for node, task in nodes.items():
                if task in done:
                    outcome = await self._outcome(node, task)
                    if isinstance(outcome, RanksFinished):
                        finished.add(node)
                    else:
                        await self._cancel([*nodes.values(), monitor, keeper])
                        self._interrupt(outcome, resume)
                        return
            if len(finished) == len(nodes):
                await self._cancel([monitor])
                await self._finish(keeper)
                return

    async def _prepare(self) -> list[NodeEndpoint]:
        answer_within = self.spec.health.node_heartbeat_timeout
        return list(
            await asyncio.gather(
                *(
                    calls.prepare(self.run_id, self.status.generation, node, i == 0, answer_within)
                    for i, node in enumerate(self.spec.nodes)
                )
            )
        )

    def _monitor(self, first_step: bool) -> ActivityHandle[MonitorEvent]:
        resume = self.status.latest_valid_checkpoint()
        return calls.monitor(
            MonitorInput(
                run_id=self.run_id,
                generation=self.status.generation,
                world_size=self.spec.world_size,
                endpoints=self.status.endpoints,
                resume_step=resume.step if resume else 0,
                await_first_step=first_step,
                after=self.status.telemetry_cursor,
            )
        )

    def _keeper(self) -> ActivityHandle[KeeperResult]:
        status = self.status
        assert status.started_at is not None
        dropped = to_delete(
            status.checkpoints, status.started_at, status.spec.sdc.self_check_every, self._checkpoint_steps()
        )
        mine = [c for c in status.checkpoints if c.generation == status.generation]
        return calls.keeper(
            KeeperInput(
                run_id=self.run_id,
                generation=status.generation,
                root=self.spec.checkpoint.root,
                endpoints=status.endpoints,
                after=status.checkpoint_cursor,
                reference=status.latest_valid_checkpoint(),
                delete=[c.path for c in dropped],
            ),
            max((c.step for c in mine), default=None),
        )

    async def _outcome(self, node: str, task: ActivityHandle[NodeOutcome]) -> NodeOutcome | NodeLost:
        try:
            return await task
        except ActivityError as exc:
            # A heartbeat timeout: the node agent is gone (dead host, partition, killed agent).
            return NodeLost(node=node, detail=f"{exc.cause or exc}")

    async def _judge_leftovers(self) -> None:
        """Before choosing where to resume: validate what the last generation committed but nobody
        judged yet, and record writes that never committed."""
        status = self.status
        known = [c.path.rstrip("/").rsplit("/", 1)[-1] for c in status.checkpoints]
        found = await calls.choose(
            ChooseInput(
                run_id=self.run_id,
                root=self.spec.checkpoint.root,
                directory=status.checkpoint_dir,
                generation=status.generation,
                known=known,
                reference=status.latest_valid_checkpoint(),
            )
        )
        status.checkpoints.extend(found)

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
                last.restored_from = event.restored_from
            self._set_state(RunState.RUNNING)

    def _on_checkpoint(self, result: KeeperResult) -> None:
        status = self.status
        status.checkpoint_cursor = result.after
        for record in status.checkpoints:
            if record.path in result.deleted:
                record.deleted = True
        status.checkpoints.append(result.checkpoint)
        status.progress.step = max(status.progress.step, result.checkpoint.step)

    def _interrupt(self, outcome: RankFailed | NodeLost, resume: CheckpointRecord | None) -> None:
        status = self.status
        if isinstance(outcome, RankFailed) and outcome.exit_code == EXIT_CHECKPOINT_UNUSABLE and resume:
            # The ranks could not load the checkpoint they were given: it is not resumable after all.
            resume.validated = False
            resume.reason = f"could not be loaded at resume{_last_line(outcome.log_tail)}"
            cause, detected_by = Cause.CHECKPOINT_INVALID, "rank refused its resume checkpoint"
        elif isinstance(outcome, RankFailed):
            cause, detected_by = Cause.CRASH, "node agent: rank process exited"
        else:
            cause, detected_by = Cause.NODE_LOST, "node agent heartbeat timeout"
        if isinstance(outcome, RankFailed):
            interruption = Interruption(
                at=datetime.fromtimestamp(outcome.at, UTC),
                generation=status.generation,
                detected_by=detected_by,
                cause=cause,
                node=outcome.node,
                rank=outcome.rank,
                step=outcome.last_step,
                detail=f"exit code {outcome.exit_code}" + _last_line(outcome.log_tail),
            )
        else:
            interruption = Interruption(
                at=workflow.now(),
                generation=status.generation,
                detected_by=detected_by,
                cause=cause,
                node=outcome.node,
                step=status.progress.step,
                detail=outcome.detail,
            )
        self._record(interruption)

    async def _finish(self, keeper: ActivityHandle[KeeperResult] | None) -> None:
        """Every rank exited cleanly. Done only once the final checkpoint is judged valid."""
        target = self.spec.target_step
        if keeper is not None and target is not None:
            # The keeper may still be validating what the ranks wrote last (or catching up after a
            # supervisor restart): take its verdicts until the final checkpoint's is among them.
            while not any(c.step == target for c in self.status.checkpoints if c.generation == self.status.generation):
                self._on_checkpoint(await keeper)
                keeper = self._keeper()
            await self._cancel([keeper])
            if not any(c.step == target and c.validated for c in self.status.checkpoints):
                self._record(
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
        self._set_state(RunState.COMPLETED)

    def _record(self, interruption: Interruption) -> None:
        """Add the interruption to the timeline; the next generation fills in where it resumed."""
        status = self.status
        status.interruptions.append(interruption)
        workflow.logger.warning("interruption: %s", interruption.line())
        status.generation += 1
        if len(status.interruptions) > self.spec.max_restarts:
            status.failure = f"gave up after {self.spec.max_restarts} restarts; last: {interruption.line()}"
            self._set_state(RunState.FAILED)

    # -- helpers --------------------------------------------------------------------------------

    def _checkpoint_seconds(self) -> float | None:
        cfg = self.spec.checkpoint
        if cfg.interval.kind == "seconds":
            return cfg.interval.value
        if cfg.interval.kind != "auto":
            return None
        measured = [c.blocking_seconds for c in self.status.checkpoints if c.validated]
        if not measured:
            return cfg.min_interval  # the first checkpoint comes early: it measures C
        assert self.status.started_at is not None
        observed = (workflow.now() - self.status.started_at).total_seconds()
        m = mtbf(observed, len(self.status.interruptions), cfg.prior_mtbf)
        return interval(measured[-1], m, cfg.min_interval, cfg.max_interval)

    def _checkpoint_steps(self) -> float:
        """The checkpoint interval in steps, for retention (time-based intervals convert at the p50 step time)."""
        cfg = self.spec.checkpoint
        if cfg.interval.kind == "steps":
            return cfg.interval.value or 1.0
        seconds = self._checkpoint_seconds() or cfg.min_interval
        return seconds / max(self.status.progress.step_seconds_p50, 1e-3)

    async def _command(self, kind: Literal["checkpoint", "exit"]) -> None:
        self.status.command_seq += 1
        command = Command(seq=self.status.command_seq, kind=kind)
        await asyncio.gather(*(calls.command(self.run_id, node, command) for node in self.spec.nodes))

    async def _cancel(self, handles: list[ActivityHandle | None]) -> None:
        live = [h for h in handles if h is not None and not h.done()]
        for handle in live:
            handle.cancel()
        await asyncio.gather(*live, return_exceptions=True)

    async def _release(self) -> None:
        await asyncio.gather(*(calls.release(self.run_id, node) for node in self.spec.nodes), return_exceptions=True)

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
