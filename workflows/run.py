"""RunWorkflow: carries one training run to its target step, through every interruption.

A thin shell over a RunBook (core/book/runbook.py), which owns the run's state and every change to it.
The workflow waits and calls: it launches a generation (workflows/generation.py), watches it until
something ends it, and hands that to the module that knows what to do — a failure, a hang or
corruption (incidents.py), a person's request (requests.py), slowness (stragglers.py), checkpoints
(checkpoints.py) — which gathers the evidence and returns what it found. Each finding goes to
`book.apply`, which moves the run as the lifecycle table allows. Messages only land in the inbox;
the loop decides.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Annotated, Any

from pydantic import Discriminator, Tag, ValidationError
from temporalio import workflow
from temporalio.workflow import ActivityHandle

from stayalive.workflows import calls, checkpoints, generation, incidents, requests
from stayalive.workflows.generation import Ending, Generation, Reattach
from stayalive.workflows.inbox import Inbox, Request
from stayalive.workflows.listing import Listing

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from stayalive.core.book.findings import (
        Cancelled,
        Failed,
        Launching,
        LaunchRefused,
        ShortOfNodes,
    )
    from stayalive.core.book.health import Health
    from stayalive.core.book.runbook import RunBook
    from stayalive.core.decisions.fencing import PARTITION_REPORT, PartitionReport
    from stayalive.core.decisions.goodput import ledger, recent_goodput
    from stayalive.core.decisions.interval import checkpoint_seconds, choose_interval, prior_mtbf
    from stayalive.core.decisions.paging import Page
    from stayalive.core.fleet.requests import RecordExposure
    from stayalive.core.messages.control import ReleaseRanks
    from stayalive.core.messages.events import (
        CHECKPOINT_JUDGED,
        MONITOR_REPORT,
        AllHeld,
        CheckpointJudged,
        GpuFailed,
        Hang,
        MonitorReport,
        NodeLost,
        RankFailed,
        RanksFinished,
        SdcDetected,
    )
    from stayalive.core.run.lifecycle import RunState
    from stayalive.core.run.spec import RunSpec
    from stayalive.core.run.status import CheckpointRecord, RunResult, RunStatus
    from stayalive.core.run.timeline import Classification, Detection, Interruption

TASK_QUEUE = "stayalive"


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
        if isinstance(input, CarriedRun):
            status, verdicts = input.status, input.verdicts
        else:
            info = workflow.info()
            run_id = f"{info.workflow_id}/{info.first_execution_run_id[:8]}"
            status, verdicts = RunStatus(spec=input, run_id=run_id, nodes=list(input.nodes)), []
        self.listing = Listing()  # what the web UI shows of the run
        self.book = RunBook(status, on_move=self.listing.show, on_progress=self.listing.progressed)
        self.inbox = Inbox(verdicts=list(verdicts))
        self.pages: list[Page] = []  # filed once the next generation is launched: never on the restart path
        self.suggested_at: datetime | None = None  # when this segment first saw continue-as-new suggested
        self.gen: Generation | None = None  # the generation watched last: its monitor is stopped on the way out
        self.deliveries: list[ActivityHandle[Any]] = []  # webhook pages in flight (calls.SendsPages)

    @workflow.run
    async def run(self, input: RunInput) -> RunResult:
        book = self.book
        status = book.status
        if status.started_at is None:
            book.begin(workflow.now(), await calls.baseline(book.spec.config_digest) if book.spec.hooks else [])
            book.learned(await calls.failure_rate())
            await self._acquire()
        try:
            while not book.state.terminal:
                if book.state == RunState.STOPPED:
                    await self._file_pages()
                    await requests.stopped(book, self.inbox)
                    continue
                gen = await self._start()
                if gen is not None:
                    self.gen = gen
                    await self._end(gen, await self._watch(gen))
                if self._continue_as_new_due(between_generations=True):
                    await self._stop_watching()
                    await self._file_pages()
                    await self._end_deliveries()
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    workflow.continue_as_new(CarriedRun(status=status, verdicts=self.inbox.verdicts))
        except asyncio.CancelledError:
            await self._stop_watching()  # before the release: what the ranks do then is no finding
            await self._release()
            await self._end_deliveries()
            book.apply(Cancelled())
            raise
        await self._stop_watching()
        await self._file_pages()
        await self._tell_fleet(failures=0)
        await self._release()
        await self._end_deliveries()
        book.finish(workflow.now())
        return RunResult(
            run_id=status.run_id,
            state=status.state,
            final_step=status.progress.step,
            interruptions=status.interruptions,
            earlier_interruptions=status.earlier_interruptions,
            ledger=ledger(status, workflow.now()),
            failure=status.failure,
        )

    # -- what a person can ask ------------------------------------------------------------------

    @workflow.query
    def status_query(self) -> RunStatus:
        return self.book.status

    @workflow.query
    def health(self) -> Health:
        return Health.of(self.book.status, workflow.now(), self._checkpoint_seconds())

    @workflow.query
    def timeline(self) -> list[Interruption]:
        return self.book.status.interruptions

    @workflow.query
    def detections(self) -> list[Detection]:
        """Stragglers, slowdowns and skipped updates: nothing stopped, so not interruptions."""
        return self.book.status.detections

    @workflow.query
    def checkpoints(self) -> list[CheckpointRecord]:
        """Every checkpoint retention keeps, and the newest it deleted as refused, in step order:
        validated or not, and why; SDC-verified, unverified or suspect. The valid ones it deleted
        are counted in the status (`deleted_checkpoints`), not listed."""
        status = self.book.status
        return sorted([*status.rejected_checkpoints, *status.checkpoints], key=lambda c: (c.step, c.generation))

    @workflow.signal
    def force_checkpoint(self) -> None:
        """Checkpoint at the next step every rank agrees on (before maintenance, say); a run whose
        ranks are not training yet (launching, held, paused) takes it once they are."""
        self.inbox.checkpoint_asked = True

    @workflow.signal(name=MONITOR_REPORT)
    def monitor_report(self, report: MonitorReport) -> None:
        """What the run monitor found (activities/monitor.py); handled by the main loop."""
        self.inbox.reports.append(report)

    @workflow.signal(name=CHECKPOINT_JUDGED)
    def checkpoint_judged(self, judged: CheckpointJudged) -> None:
        """A checkpoint the ranks committed, with the keeper's verdict; recorded by the main loop."""
        self.inbox.verdicts.append(judged)

    @workflow.signal(name=PARTITION_REPORT)
    def partitioned(self, report: PartitionReport) -> None:
        """A node agent fenced itself out of a generation it was cut off from: the node-lost entry of
        that generation was a partition (core/decisions/fencing.py)."""
        self.inbox.partitions.append(report)

    @workflow.signal
    def pause(self, reason: str = "paused by an operator") -> None:
        self.inbox.requests.append(Request(kind="pause", reason=reason))

    @workflow.signal
    def resume(self) -> None:
        self.inbox.resumed = True

    @workflow.update
    async def drain_node(self, request: DrainNode) -> str:
        """Take a node out of the run: drain, wait, checkpoint, resize (spare or fewer nodes), resume."""
        return await self._carry_out(Request(kind="drain", node=request.node, reason=request.reason))

    @drain_node.validator
    def _check_drain(self, request: DrainNode) -> None:
        status = self.book.status
        if not self.book.spec.hooks:
            raise ValueError("drain_node needs a run with hooks: a plain script cannot hold at a step")
        if request.node not in status.nodes:
            shown = ", ".join(status.nodes[:16]) + (
                f", … ({len(status.nodes)} in all)" if len(status.nodes) > 16 else ""
            )
            raise ValueError(f"{request.node} is not in this run; its nodes are {shown}")
        if status.state != RunState.RUNNING:
            raise ValueError(f"the run is {status.state.value}; drain a node once it is RUNNING")

    @workflow.update
    async def resume_from(self, request: ResumeFrom) -> str:
        """Roll the run back to the validated checkpoint of `step` and continue from there."""
        return await self._carry_out(Request(kind="rollback", step=request.step))

    @resume_from.validator
    def _check_resume_from(self, request: ResumeFrom) -> None:
        checkpoints = self.book.status.checkpoints
        if not any(c.step == request.step and c.resumable for c in checkpoints):
            valid = ", ".join(str(s) for s in sorted({c.step for c in checkpoints if c.resumable}))
            raise ValueError(
                f"no resumable checkpoint at step {request.step} (validated and not suspect of SDC); "
                f"resume_from one of the resumable steps: {valid or 'none yet'}"
            )

    async def _carry_out(self, request: Request) -> str:
        self.inbox.requests.append(request)
        await workflow.wait_condition(lambda: request.outcome is not None)
        return request.outcome or ""

    # -- generations ----------------------------------------------------------------------------

    async def _acquire(self) -> None:
        """Ask the fleet for the spec's nodes; a refused one is replaced by a spare or left out."""
        book, status = self.book, self.book.status
        grant = await calls.acquire(status.run_id, book.spec.nodes)
        for node, why in grant.refused.items():
            workflow.logger.warning("fleet refused %s: %s", node, why)
            book.refused(node, await calls.take_spare(status.run_id, book.spare_candidates()))
        if len(status.nodes) < book.spec.min_nodes:
            usable = f"the fleet has {len(status.nodes)} usable nodes of the {book.spec.min_nodes} this run needs"
            book.apply(ShortOfNodes(usable))

    async def _start(self) -> Generation | None:
        """Launch the next generation (or re-attach to the running one) and start watching it. None
        when a node did not answer: it is replaced, and the loop launches again."""
        book = self.book
        status = book.status
        reattach, rejoin = status.reattach, status.membership is not None
        if not reattach:
            book.apply(Launching())
            if status.generation > 0 and not rejoin:
                await checkpoints.judge_leftovers(book)
            resume = status.latest_valid_checkpoint()
            book.resumed(resume.step if resume else 0)
            if (choice := choose_interval(status, workflow.now())) is not None:
                book.keep_interval(choice)  # the launch carries it
            launched = await calls.launch(generation.launch_request(book, self._checkpoint_seconds()))
            await self._file_pages()
            if launched.refused:
                refusals = "; ".join(launched.refused[node] for node in sorted(launched.refused))
                book.apply(LaunchRefused(refusals))
                return None
            if not launched.started:
                book.start_afresh()
                await self._restart(await incidents.unreachable(book, launched.unreachable))
                return None
        gen = generation.start_monitor(book)
        book.launched()
        return gen

    async def _watch(self, gen: Generation) -> Ending:
        ended = await generation.supervise(
            self.book, self.inbox, gen, reattach_due=lambda: self._continue_as_new_due(between_generations=False)
        )
        assert ended is not None, "supervise without `until` returns only what ended the generation"
        return ended

    async def _end(self, gen: Generation, ending: Ending) -> None:
        """What ended the generation decides what comes next."""
        book = self.book
        match ending:
            case Request(kind="rollback"):
                await gen.end()
                requests.rollback(book, ending)
            case Request():
                if (interrupted := await requests.hold_and_go_on(book, self.inbox, gen, ending)) is not None:
                    await self._end(gen, interrupted)
                elif ending.paged is not None:  # the drain cordoned a failed GPU: a failure
                    await self._counted(ending.paged, ending.reason)
            case Reattach():
                book.reattach()
                await gen.end()
            case RanksFinished():  # done once the final checkpoint is judged valid
                if ending.lingering:
                    incidents.lingered(book, ending)
                outcome = await checkpoints.finished(book, self.inbox, ending, gen.number, gen.monitor.done())
                await gen.end()
                book.apply(outcome)
            case RankFailed() | NodeLost():
                await gen.end()
                await self._restart(await incidents.failure(book, ending))
            case Hang():
                interruption = await incidents.hang(book, ending)  # the stacks, while the ranks still hang
                await gen.end()
                await self._restart(interruption)
            case SdcDetected():
                await gen.end()
                await self._restart(await incidents.sdc(book, ending))
            case GpuFailed():
                await gen.end()
                await self._restart(await incidents.gpu_failure(book, ending))
            case AllHeld():
                workflow.logger.warning("every rank holds at step %s, but no hold was asked for", ending.step)

    async def _end_deliveries(self) -> None:
        """Pages on their way to the webhook land, or are given up after the spec's grace."""
        await calls.end_deliveries(self.deliveries, timedelta(seconds=self.book.spec.paging.webhook_grace))

    async def _stop_watching(self) -> None:
        """On every way out (completed, failed, cancelled, continued as new): no monitor outlives the run."""
        if self.gen is not None:
            await self.gen.end()

    async def _tell_fleet(self, failures: int) -> None:
        """The run's exposure since it last told the fleet, and its failures in it: the fleet's rate
        learns, and so does this run's prior."""
        book = self.book
        exposure = RecordExposure(run_id=book.status.run_id, gpu_hours=book.exposure(workflow.now()), failures=failures)
        book.learned(await calls.record_exposure(exposure))

    async def _restart(self, interruption: Interruption) -> None:
        """Record a failure; the next generation restarts every rank from a checkpoint. Its page is
        filed once that generation is launched."""
        book, now = self.book, workflow.now()
        paging = book.apply(Failed(interruption, prior_mtbf(book.status), recent_goodput(book.status, now))).page
        assert paging is not None, "a failure is recorded with its paging class"
        await self._counted(paging, interruption.line())

    async def _counted(self, paging: Classification, summary: str) -> None:
        """A failure on the timeline: the fleet's rate learns of it, and its page is filed once the
        next generation is launched."""
        await self._tell_fleet(failures=1)
        workflow.logger.warning("interruption: %s", summary)
        self.pages.append(incidents.page(self.book, paging, summary))

    async def _file_pages(self) -> None:
        pages, self.pages = self.pages, []
        for page in pages:
            await calls.send_page(page)

    async def _release(self) -> None:
        """The run is over: its nodes stop its ranks and free its memory, and go back to the fleet.
        (A node that left the group earlier was released by its drain or vacated by the self-test its
        quarantine started, or died with the ranks on it.)"""
        status = self.book.status
        release = ReleaseRanks(run_id=status.run_id, nodes=status.nodes)
        try:
            await calls.release(release, f"release the run on its {len(status.nodes)} nodes")
        except Exception as exc:  # a node that is gone has nothing to release; the fleet still takes them back
            workflow.logger.warning("release incomplete: %s", exc)
        await calls.release_nodes(status.run_id)

    # -- helpers --------------------------------------------------------------------------------

    def _continue_as_new_due(self, between_generations: bool) -> bool:
        if not workflow.info().is_continue_as_new_suggested() or self.book.state.terminal:
            return False
        if self.inbox.pending():  # a person's request, or a partition, that this segment has not taken
            return False
        self.suggested_at = self.suggested_at or workflow.now()
        # Between generations there is nothing to re-attach to; in the middle of one, only once the
        # suggestion is `health.reattach_after` old (a long healthy stretch).
        reattach_after = timedelta(seconds=self.book.spec.health.reattach_after)
        return between_generations or workflow.now() - self.suggested_at >= reattach_after

    def _checkpoint_seconds(self) -> float | None:
        return checkpoint_seconds(self.book.status)


if __name__ == "__main__":
    raise SystemExit("RunWorkflow runs in the supervisor worker: python -m stayalive.workers.supervisor")
