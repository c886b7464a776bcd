"""One generation of ranks: how it is launched, watched, and how it ends.

A generation starts one of three ways: fresh ranks restoring a checkpoint (the first launch, or after
a crash), survivors rejoining in place after a hold (drain, pause), or a new monitor re-attaching to
ranks that never stopped (the next segment after continue-as-new). Whatever the width, the history
sees one launch (a local activity: every node agent is asked at once, over its hub) and one
monitor; how the generation ends arrives as one of the monitor's reports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from temporalio import workflow
from temporalio.workflow import ActivityHandle

from stayalive.workflows import calls, checkpoints, incidents, stragglers
from stayalive.workflows.inbox import Inbox, Request

with workflow.unsafe.imports_passed_through():
    from stayalive.core.book.findings import Judged, Observed
    from stayalive.core.book.runbook import RunBook
    from stayalive.core.decisions.interval import checkpoint_steps, choose_interval
    from stayalive.core.messages.control import CommandRanks
    from stayalive.core.messages.events import (
        AllHeld,
        AnomalyFound,
        GpuFailed,
        Hang,
        HealthyWindows,
        KeeperInput,
        MonitorEvent,
        MonitorInput,
        MonitorReport,
        NodeLost,
        Quiet,
        RankFailed,
        RanksFinished,
        SdcDetected,
        SlowdownFound,
        SlownessTally,
        StorageOutage,
        StragglerFound,
        ends_generation,
    )
    from stayalive.core.run.faults import HARDWARE
    from stayalive.core.run.launch import Launch, supervision_env
    from stayalive.core.run.lifecycle import RunState, takes


@dataclass
class Reattach:
    """Continue-as-new in the middle of a generation: the next segment watches the same ranks."""


Ending = RankFailed | NodeLost | RanksFinished | Hang | SdcDetected | GpuFailed | AllHeld | Request | Reattach


@dataclass
class Generation:
    number: int
    monitor: ActivityHandle[MonitorReport]
    heard: bool = False  # what the monitor's completion brought is in the inbox

    async def end(self) -> None:
        """Stop watching, and wait until the monitor has stopped (one that reported the end has stopped
        by itself): a monitor left running would outlive its generation, or the run, still listed as
        pending. The ranks keep running until the next launch or a release stops them. Idempotent."""
        if not self.monitor.done():
            self.monitor.cancel()
            await workflow.wait([self.monitor])
        _settled(self.monitor)

    def ending(self) -> MonitorEvent | None:
        """What the monitor completed with: the event that ended the generation."""
        event = self._completed()
        return None if isinstance(event, Quiet) else event

    def quiet(self) -> Quiet | None:
        """The monitor stopped with nothing due before a time: the generation goes on unwatched."""
        event = self._completed()
        return event if isinstance(event, Quiet) else None

    def watch_again(self, book: RunBook) -> None:
        self.monitor, self.heard = start_monitor(book).monitor, False

    def hear(self, book: RunBook, inbox: Inbox) -> None:
        """Take in (once) what the monitor's completion brought before its event, and a quiet one's
        progress."""
        if self.heard or self._completed() is None:
            return
        self.heard = True
        report = self.monitor.result()
        inbox.hand_over(report)
        if (quiet := self.quiet()) is not None:
            book.apply(Observed(quiet))

    def _completed(self) -> MonitorEvent | None:
        if not self.monitor.done() or self.monitor.cancelled() or self.monitor.exception() is not None:
            return None
        report = self.monitor.result()
        return report.event if report.generation == self.number else None


def _settled(handle: asyncio.Future[MonitorReport]) -> None:
    """A cancelled monitor ends in a cancellation nobody awaits: take it, so it is not reported lost."""
    if not handle.cancelled():
        handle.exception()


def launch_request(book: RunBook, checkpoint_seconds: float | None) -> Launch:
    """The next generation as the node agents receive it: on the current nodes, from the newest valid
    checkpoint, or with the survivors of a hold rejoining in place."""
    status, spec = book.status, book.spec
    membership = status.membership
    resume = status.latest_valid_checkpoint()
    env = spec.env | supervision_env(
        spec,
        status.run_id,
        status.checkpoint_dir,
        status.generation,
        resume.path if resume and membership is None else None,
        checkpoint_seconds,
    )
    return Launch(
        run_id=status.run_id,
        generation=status.generation,
        nodes=status.nodes,
        ranks_per_node=spec.ranks_per_node,
        backend=spec.backend,
        entrypoint=spec.entrypoint,
        workdir=spec.workdir,
        env=env,
        rejoin=membership is not None,
        newcomers=membership is not None and bool(membership.newcomers),
        hardware=[f for f in spec.faults if isinstance(f, HARDWARE)],
        answer_within=spec.health.node_heartbeat_timeout,
        checkpoint_dir=status.checkpoint_dir if spec.hooks else None,
        fence_after=spec.health.partition_fence,
    )


def start_monitor(book: RunBook) -> Generation:
    """Watch the current generation; from its first step while it has not reported one."""
    status, spec = book.status, book.spec
    first_step = status.state in (RunState.LAUNCHING, RunState.RESUMING)
    health = spec.health
    resume = status.latest_valid_checkpoint()
    assert status.started_at is not None
    keeper = KeeperInput(
        root=spec.checkpoint.root,
        checkpoints=status.checkpoints,
        verified_step=status.verified_step,
        started_at=status.started_at,
        sdc_check_steps=spec.sdc.self_check_every,
        checkpoint_steps=checkpoint_steps(status),
        validation=spec.checkpoint.validation,
        final_step=None if any(c.step == spec.target_step for c in status.checkpoints) else spec.target_step,
    )
    input = MonitorInput(
        run_id=status.run_id,
        generation=status.generation,
        nodes=status.nodes,
        ranks_per_node=spec.ranks_per_node,
        hooks=spec.hooks,
        resume_step=resume.step if resume else 0,
        await_first_step=first_step,
        node_silence=health.node_heartbeat_timeout,
        exit_grace=health.exit_grace,
        step_timeout=None if health.step_timeout == "auto" else health.step_timeout,
        startup_timeout=health.startup_timeout,
        known_step_s=status.progress.step_seconds_max or None,
        straggler_sigma=health.straggler_sigma,
        straggler_steps=health.straggler_steps,
        baseline=status.baseline,
        known_stragglers=status.known_stragglers(),  # what this generation found is not reported again
        slowdown_known=status.slowdown_known(),
        healthy_windows=health.baseline_windows,
        tally_s=health.slowness_tally,
        progress_s=health.progress_refresh,
        keeper=keeper if spec.hooks else None,
        storage_outage=status.storage_outage,
    )
    return Generation(number=status.generation, monitor=calls.monitor(input))


async def supervise(
    book: RunBook,
    inbox: Inbox,
    gen: Generation,
    *,
    ends: Callable[[MonitorEvent], bool] = lambda _: False,
    until: Callable[[], bool] = lambda: False,
    take_requests: bool = True,
    reattach_due: Callable[[], bool] = lambda: False,
) -> Ending | None:
    """Act on what the monitor finds until something ends the generation (or the wait): how the
    generation ended, an event `ends` wants (a hold's AllHeld), a person's request, or the moment to
    continue as new; None once `until()` holds. Verdicts are filed as they come."""

    def takes_request() -> bool:
        return take_requests and bool(inbox.requests) and takes(book.state, inbox.requests[0].kind)

    def news() -> bool:  # what this loop can take now (core/run/lifecycle.py's `takes`), or no request in a hold
        return inbox.news(takes_request(), takes(book.state, "checkpoint"))

    while True:
        gen.hear(book, inbox)
        if gen.ending() is None and not news():
            await _news_or_end(book, inbox, gen, news)
            gen.hear(book, inbox)
        ended = gen.ending()
        for event in [*inbox.events(gen.number), *([ended] if ended is not None else [])]:
            if book.known(event):
                continue  # a monitor restarted from an older place found it again
            book.apply(Observed(event))
            if ends_generation(event) or isinstance(event, RanksFinished) or _cannot_hold(book, event) or ends(event):
                book.apply(Judged(inbox.take_verdicts()))  # signalled before the end: they happened first
                return event  # type: ignore[return-value]  # the union of what `ends` picks
            await _on_finding(book, inbox, event)
        book.apply(Judged(inbox.take_verdicts()))
        incidents.file_partitions(book, inbox)
        await retune(book)
        if until():
            return None
        if inbox.checkpoint_asked and takes(book.state, "checkpoint"):
            inbox.checkpoint_asked = False
            if gen.quiet() is not None:
                gen.watch_again(book)  # the checkpoint's verdict comes from a watching monitor
            await checkpoints.force(book)
        if takes_request():
            request = inbox.requests.pop(0)
            if request.kind == "drain" and request.node not in book.status.nodes:
                request.outcome = f"not carried out: {request.node} left the run before the drain was taken"
                continue  # a failure, or an earlier drain, took the node out meanwhile
            if gen.quiet() is not None:
                gen.watch_again(book)  # a request is carried out with the ranks watched
            return request
        if reattach_due():
            return Reattach()


async def retune(book: RunBook) -> None:
    """`auto`: a checkpoint measured C anew, or the run's M moved: the running ranks keep the new
    interval from the next step they agree on, without a restart."""
    if book.state != RunState.RUNNING or (choice := choose_interval(book.status, workflow.now())) is None:
        return
    book.keep_interval(choice)
    status = book.status
    command = CommandRanks(
        run_id=status.run_id, nodes=status.nodes, command=book.command("interval", seconds=choice.seconds)
    )
    await calls.command(command, f"checkpoint every {choice.seconds:.4g}s from now: {choice.why}")


async def _news_or_end(book: RunBook, inbox: Inbox, gen: Generation, news: Callable[[], bool]) -> None:
    """Until `news()` or the monitor completes (a monitor that is done without an ending, cancelled,
    leaves only the inbox). A quiet monitor is watched again at the time it named, at once when
    there is news."""
    if (quiet := gen.quiet()) is not None:
        asleep = timedelta(seconds=max(0.0, quiet.until - workflow.now().timestamp()))
        await inbox.until(news, asleep)
        gen.watch_again(book)
        return
    if gen.monitor.done():
        await inbox.until(news)
        return
    waiting = asyncio.ensure_future(inbox.until(news))
    await workflow.wait([gen.monitor, waiting], return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()


def _cannot_hold(book: RunBook, event: MonitorEvent) -> bool:
    """A GPU failed that still computes, but a plain script cannot hold at a step to drain its node:
    the generation ends and restarts without it."""
    return isinstance(event, GpuFailed) and not book.spec.hooks


async def _on_finding(book: RunBook, inbox: Inbox, event: MonitorEvent) -> None:
    """What the detectors found that ends nothing: record it, act on slowness, drain a failed GPU."""
    if isinstance(event, GpuFailed):
        if not any(r.kind == "drain" and r.node == event.node for r in inbox.requests):
            reason = f"GPU failure: {event.detail()}"
            inbox.requests.append(Request(kind="drain", node=event.node, reason=reason, by="NVML", gpu=event))
    elif isinstance(event, AnomalyFound):
        incidents.anomaly(book, event)
    elif isinstance(event, StorageOutage):
        await incidents.storage(book, event)
    elif isinstance(event, StragglerFound | SlownessTally):
        if isinstance(event, StragglerFound):
            await stragglers.settle(book, resolved=False)
            await stragglers.straggler(book, event)
        if (drain := await stragglers.climb(book)) is not None:  # what it found with may buy a rung already
            inbox.requests.append(drain)
    elif isinstance(event, SlowdownFound):
        await stragglers.slowdown(book, event)
    elif isinstance(event, HealthyWindows):
        await stragglers.settle(book, resolved=True)
        await calls.record_baseline(book.spec.config_digest, event.medians)
