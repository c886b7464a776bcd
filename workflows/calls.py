"""How RunWorkflow calls its activities: one function each, by name, with the timeouts, retries and
the summary a person reads in the web UI. No decisions here; those are in core/ and the workflow.

Activities are named, not imported: their modules load torch, and a workflow module should not.
Their inputs and results are core's models. What every interruption runs and what takes only a
moment in the supervisor (the fleet's answers, judging storage, launching, commanding, releasing,
paging) are local activities: one marker event each instead of three activity events and a
workflow task, which is what keeps an interruption within its history budget at any width.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol, cast

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.workflow import ActivityHandle

with workflow.unsafe.imports_passed_through():
    from stayalive.core.decisions.checkpoints import ChooseInput
    from stayalive.core.decisions.paging import Page
    from stayalive.core.fleet.model import EvictionOutcome, FailureRate
    from stayalive.core.fleet.requests import (
        Acquire,
        Grant,
        MarkSuspect,
        RecordEviction,
        RecordExposure,
        RecordWindows,
        Release,
        Replace,
        Replacement,
        TakeSpare,
    )
    from stayalive.core.messages.control import CommandRanks, HangInput, HangStacks, ReleaseRanks
    from stayalive.core.messages.events import MonitorInput, MonitorReport
    from stayalive.core.run.launch import Launch, Launched
    from stayalive.core.run.status import CheckpointRecord
    from stayalive.core.run.timeline import PagingClass

FOREVER = timedelta(days=3650)
QUICK = timedelta(minutes=2)
# A fan-out to every node of the run: the answer a launch waits for, plus the time to reach them all.
FAN_OUT = timedelta(minutes=5)


async def launch(request: Launch) -> Launched:
    """Start the generation on every node (one request per node agent, many at once); the nodes that
    did not answer within `answer_within` come back as unreachable, never as an error."""
    return await workflow.execute_local_activity(
        "launch",
        request,
        result_type=Launched,
        start_to_close_timeout=FAN_OUT,
        summary=f"launch generation {request.generation}: {request.world_size} ranks on {len(request.nodes)} nodes, "
        f"{request.origin()}",
    )


def monitor(input: MonitorInput) -> ActivityHandle[MonitorReport]:
    """Runs for the whole generation. It signals what it finds and each checkpoint's verdict, and it
    completes with what ended the generation (a failed rank, a silent node, a hang, failed SDC check):
    that costs the history the completion alone, not a signal and then a cancel. Whatever else ends a
    generation cancels its monitor and waits for it to stop (Generation.end)."""
    ends = "a failed rank or a silent node"
    watched = "every rank done"
    if input.hooks:
        first = "its first step, " if input.await_first_step else ""
        ends += ", a hang or a failed SDC check"
        watched = f"{first}stragglers, slowdowns, each checkpoint's verdict, every rank done or holding"
    return workflow.start_activity(
        "monitor_run",
        input,
        result_type=MonitorReport,
        start_to_close_timeout=FOREVER,
        heartbeat_timeout=timedelta(seconds=10),
        retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=5)),
        # A cancelled monitor's handle resolves only once the activity has acknowledged (its heartbeat
        # brings the cancel, it raises): TRY_CANCEL resolves at the request, and a run that closed
        # then would list its monitor as pending for good.
        cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        summary=f"watch generation {input.generation}: signal {watched}; end with {ends}",
    )


async def command(request: CommandRanks, summary: str) -> int:
    return await workflow.execute_local_activity(
        "command",
        request,
        result_type=int,
        start_to_close_timeout=FAN_OUT,
        summary=summary,
    )


async def release(request: ReleaseRanks, summary: str) -> int:
    return await workflow.execute_local_activity(
        "release",
        request,
        result_type=int,
        start_to_close_timeout=FAN_OUT,
        # An agent that is gone has nothing to release: a few tries, then the run goes on.
        retry_policy=RetryPolicy(maximum_attempts=3),
        summary=summary,
    )


async def dump_stacks(request: HangInput) -> HangStacks:
    """An activity of its own: the ranks take seconds to write their stacks, longer than a workflow
    task should wait."""
    return await workflow.execute_activity(
        "dump_stacks",
        request,
        result_type=HangStacks,
        start_to_close_timeout=timedelta(minutes=2),
        heartbeat_timeout=timedelta(seconds=10),
        summary=f"dump every rank's Python stacks ({len(request.nodes)} nodes), name the one that stands out",
    )


async def choose(input: ChooseInput) -> list[CheckpointRecord]:
    """Every restart needs it before it can launch, and it is usually a directory listing; a long
    test load keeps its workflow task alive through the SDK's workflow-task heartbeats."""
    return await workflow.execute_local_activity(
        "choose_checkpoint",
        input,
        result_type=list[CheckpointRecord],
        start_to_close_timeout=timedelta(minutes=30),
        summary=f"judge the checkpoints generation {input.generation - 1} left behind",
    )


async def acquire(run_id: str, nodes: list[str]) -> Grant:
    shown = ", ".join(nodes[:8]) + (f", … ({len(nodes)} in all)" if len(nodes) > 8 else "")
    return await workflow.execute_local_activity(
        "acquire_nodes",
        Acquire(run_id=run_id, wanted=nodes),
        result_type=Grant,
        start_to_close_timeout=QUICK,
        summary=f"ask the fleet for {shown}",
    )


async def replace(request: Replace) -> Replacement:
    spares = ", ".join(request.candidates[:4]) + ("…" if len(request.candidates) > 4 else "") or "none listed"
    return await workflow.execute_local_activity(
        "replace_node",
        request,
        result_type=Replacement,
        start_to_close_timeout=QUICK,
        summary=f"quarantine {request.node} ({request.reason}) and take a spare ({spares})",
    )


async def take_spare(run_id: str, candidates: list[str]) -> str | None:
    shown = ", ".join(candidates[:4]) + ("…" if len(candidates) > 4 else "") or "none"
    return await workflow.execute_local_activity(
        "take_spare",
        TakeSpare(run_id=run_id, candidates=candidates),
        result_type=str | None,  # type: ignore[arg-type]
        start_to_close_timeout=QUICK,
        summary=f"look for a free node among {shown}",
    )


async def release_nodes(run_id: str) -> list[str]:
    return await workflow.execute_local_activity(
        "release_nodes",
        Release(run_id=run_id),
        result_type=list[str],
        start_to_close_timeout=QUICK,
        summary="give the run's nodes back to the fleet",
    )


async def baseline(config_digest: str) -> list[float]:
    return await workflow.execute_local_activity(
        "baseline",
        config_digest,
        result_type=list[float],
        start_to_close_timeout=QUICK,
        summary=f"ask the fleet for healthy step times of configuration {config_digest}",
    )


async def record_baseline(config_digest: str, medians: list[float]) -> int:
    return await workflow.execute_local_activity(
        "record_baseline",
        RecordWindows(config_digest=config_digest, medians=medians),
        result_type=int,
        start_to_close_timeout=QUICK,
        summary=f"teach the fleet {len(medians)} healthy step-time windows of {config_digest}",
    )


async def failure_rate() -> FailureRate:
    return await workflow.execute_local_activity(
        "failure_rate",
        result_type=FailureRate,
        start_to_close_timeout=QUICK,
        summary="ask the fleet for its failures per GPU-hour: the baseline this run is paged against",
    )


async def record_exposure(request: RecordExposure) -> FailureRate:
    failures = f", {request.failures} failure" if request.failures else ""
    return await workflow.execute_local_activity(
        "record_exposure",
        request,
        result_type=FailureRate,
        start_to_close_timeout=QUICK,
        summary=f"tell the fleet of {request.gpu_hours:.4g} GPU-hours run{failures}",
    )


async def mark_suspect(node: str, reason: str) -> None:
    await workflow.execute_local_activity(
        "mark_suspect",
        MarkSuspect(node=node, reason=reason),
        start_to_close_timeout=QUICK,
        summary=f"mark {node} suspect: {reason}",
    )


async def eviction_outcomes() -> list[EvictionOutcome]:
    return await workflow.execute_local_activity(
        "eviction_outcomes",
        result_type=list[EvictionOutcome],
        start_to_close_timeout=QUICK,
        summary="ask the fleet how past straggler evictions turned out (P(healthy))",
    )


async def record_eviction(node: str, run_id: str, resolved: bool) -> None:
    await workflow.execute_local_activity(
        "record_eviction",
        RecordEviction(node=node, run_id=run_id, resolved=resolved),
        start_to_close_timeout=QUICK,
        summary=f"tell the fleet evicting {node} {'resolved' if resolved else 'did not resolve'} the straggler",
    )


class SendsPages(Protocol):
    """The workflow sending a page keeps its webhook delivery, to end it before the workflow ends."""

    deliveries: list[ActivityHandle[Any]]


async def send_page(message: Page) -> None:
    """Log the page and file it in the JSONL digest (a local activity, bounded: a broken sink gives up
    after a minute instead of holding the workflow task). A page that wants a person also goes to the
    webhook in an activity of its own, not awaited: its retries, spaced out over an hour, never hold
    the run back."""
    try:
        await workflow.execute_local_activity(
            "page",
            message,
            schedule_to_close_timeout=timedelta(minutes=1),
            start_to_close_timeout=timedelta(seconds=10),
            summary=f"{message.paging.value}: {message.summary}",
        )
    except ActivityError as exc:  # a page that cannot be filed is logged; it never stops the run
        workflow.logger.error("page not filed: %s (%s)", message.summary, exc.cause or exc)
    if message.webhook_url and message.paging != PagingClass.INDEPENDENT:
        delivery = workflow.start_activity(
            "deliver_webhook",
            message,
            start_to_close_timeout=timedelta(seconds=10),
            schedule_to_close_timeout=timedelta(hours=1),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=2), maximum_interval=timedelta(minutes=5)),
            # A cancelled delivery is over once its attempt is: nothing of the run is left pending.
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            summary=f"POST the {message.paging.value} page to the webhook",
        )
        cast(SendsPages, workflow.instance()).deliveries.append(delivery)


async def end_deliveries(deliveries: list[ActivityHandle[Any]], within: timedelta) -> None:
    """On the way out (closing, or continuing as new): webhook deliveries still in flight get `within`
    to land, then are cancelled, so no activity outlives the run. A page given up on here is still in
    the JSONL digest and the log."""
    pending = [delivery for delivery in deliveries if not delivery.done()]
    deliveries.clear()
    if not pending:
        return
    await workflow.wait(pending, timeout=within.total_seconds())
    late = [delivery for delivery in pending if not delivery.done()]
    if late:
        workflow.logger.warning("%d webhook pages not delivered before the run ended (see the digest)", len(late))
        for delivery in late:
            delivery.cancel()
        await workflow.wait(late)
