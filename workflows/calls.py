"""How RunWorkflow calls its activities: one function each, with the timeouts, retries and the
summary a person reads in the web UI. No decisions here; those are in workflows/run.py and core/."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityHandle

with workflow.unsafe.imports_passed_through():
    from activities.checkpoints import ChooseInput, choose_checkpoint
    from activities.fleet import FleetActivities, RecordWindows, Replace, Replacement
    from activities.monitor import await_hold, monitor_run
    from activities.paging import Page, deliver_webhook, page
    from agent.node import NodeActivities, NodeCommand, NodeStacks, PrepareNode
    from core.events import MonitorInput, NodeOutcome
    from core.fleet import EvictionOutcome
    from core.fleet_requests import Acquire, Grant, MarkSuspect, RecordEviction, Release, TakeSpare
    from core.launch import NodeEndpoint, NodeLaunch, node_queue
    from core.paging import PagingClass
    from core.run import CheckpointRecord
    from core.telemetry import Command, Held

FOREVER = timedelta(days=3650)
QUICK = timedelta(minutes=2)


async def prepare(run_id: str, generation: int, node: str, host_rendezvous: bool, answer_within: float) -> NodeEndpoint:
    # A node agent that does not pick this up within `answer_within` is gone: schedule-to-start is
    # not retried, which makes it a dead-node detector.
    return await workflow.execute_activity_method(
        NodeActivities.prepare_node,
        PrepareNode(run_id=run_id, generation=generation, host_rendezvous=host_rendezvous),
        task_queue=node_queue(node),
        schedule_to_start_timeout=timedelta(seconds=answer_within),
        start_to_close_timeout=QUICK,
        retry_policy=RetryPolicy(maximum_attempts=3),
        summary=f"{node}: open a fresh rendezvous store for generation {generation}"
        if host_rendezvous
        else f"{node}: join generation {generation}",
    )


def run_ranks(launch: NodeLaunch, origin: str, heartbeat_timeout: float) -> ActivityHandle[NodeOutcome]:
    return workflow.start_activity_method(
        NodeActivities.run_ranks,
        launch,
        task_queue=node_queue(launch.node),
        start_to_close_timeout=FOREVER,
        heartbeat_timeout=timedelta(seconds=heartbeat_timeout),
        # Never retried: a second launch on a node the workflow knows nothing about would be a guess.
        retry_policy=RetryPolicy(maximum_attempts=1),
        summary=f"run ranks {launch.ranks[0]}-{launch.ranks[-1]} on {launch.node}, "
        f"generation {launch.generation}, {origin}",
    )


def monitor(input: MonitorInput) -> ActivityHandle[None]:
    first = "its first step, " if input.await_first_step else ""
    return workflow.start_activity(
        monitor_run,
        input,
        start_to_close_timeout=FOREVER,
        heartbeat_timeout=timedelta(seconds=10),
        retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=5)),
        summary=f"watch generation {input.generation}: signal {first}hangs, stragglers, slowdowns, SDC "
        "and each checkpoint's verdict",
    )


async def hold(input: MonitorInput) -> Held:
    return await workflow.execute_activity(
        await_hold,
        input,
        start_to_close_timeout=timedelta(hours=1),
        heartbeat_timeout=timedelta(seconds=10),
        summary=f"wait until all {input.world_size} ranks finish the in-flight step, checkpoint it and hold",
    )


async def choose(input: ChooseInput) -> list[CheckpointRecord]:
    """A local activity: every restart needs it before it can launch, storage is as near the supervisor
    as to any worker, and it is usually a directory listing. Run beside the workflow, it costs the
    history one marker, not three events and a workflow task; a long test load keeps its workflow
    task alive through the SDK's workflow-task heartbeats."""
    return await workflow.execute_local_activity(
        choose_checkpoint,
        input,
        start_to_close_timeout=timedelta(minutes=30),
        summary=f"judge the checkpoints generation {input.generation - 1} left behind",
    )


async def command(run_id: str, node: str, command: Command, summary: str) -> int:
    return await workflow.execute_activity_method(
        NodeActivities.send_command,
        NodeCommand(run_id=run_id, command=command),
        task_queue=node_queue(node),
        start_to_close_timeout=timedelta(seconds=30),
        summary=f"{node}: {summary}",
    )


async def release(run_id: str, node: str) -> int:
    return await workflow.execute_activity_method(
        NodeActivities.release_run,
        run_id,
        task_queue=node_queue(node),
        start_to_close_timeout=timedelta(minutes=1),
        schedule_to_start_timeout=timedelta(seconds=30),  # an agent that is gone has nothing to release
        summary=f"{node}: release the run (stop its ranks, free its host memory)",
    )


async def acquire(run_id: str, nodes: list[str]) -> Grant:
    return await workflow.execute_activity_method(
        FleetActivities.acquire_nodes,
        Acquire(run_id=run_id, wanted=nodes),
        start_to_close_timeout=QUICK,
        summary=f"ask the fleet for {', '.join(nodes)}",
    )


async def replace(request: Replace) -> Replacement:
    """A local activity, like the page: every interruption that names a node replaces it, and the
    fleet is one update away in the supervisor itself."""
    spares = ", ".join(request.candidates) or "none listed"
    return await workflow.execute_local_activity_method(
        FleetActivities.replace_node,
        request,
        start_to_close_timeout=QUICK,
        summary=f"quarantine {request.node} ({request.reason}) and take a spare ({spares})",
    )


async def take_spare(run_id: str, candidates: list[str]) -> str | None:
    return await workflow.execute_activity_method(
        FleetActivities.take_spare,
        TakeSpare(run_id=run_id, candidates=candidates),
        start_to_close_timeout=QUICK,
        summary=f"look for a free node among {', '.join(candidates) or 'none'}",
    )


async def release_nodes(run_id: str) -> list[str]:
    return await workflow.execute_activity_method(
        FleetActivities.release_nodes,
        Release(run_id=run_id),
        start_to_close_timeout=QUICK,
        summary="give the run's nodes back to the fleet",
    )


async def baseline(config_digest: str) -> list[float]:
    return await workflow.execute_activity_method(
        FleetActivities.baseline,
        config_digest,
        start_to_close_timeout=QUICK,
        summary=f"ask the fleet for healthy step times of configuration {config_digest}",
    )


async def record_baseline(config_digest: str, medians: list[float]) -> int:
    return await workflow.execute_activity_method(
        FleetActivities.record_baseline,
        RecordWindows(config_digest=config_digest, medians=medians),
        start_to_close_timeout=QUICK,
        summary=f"teach the fleet {len(medians)} healthy step-time windows of {config_digest}",
    )


async def mark_suspect(node: str, reason: str) -> None:
    await workflow.execute_activity_method(
        FleetActivities.mark_suspect,
        MarkSuspect(node=node, reason=reason),
        start_to_close_timeout=QUICK,
        summary=f"mark {node} suspect: {reason}",
    )


async def eviction_outcomes() -> list[EvictionOutcome]:
    return await workflow.execute_activity_method(
        FleetActivities.eviction_outcomes,
        start_to_close_timeout=QUICK,
        summary="ask the fleet how past straggler evictions turned out (P(healthy))",
    )


async def record_eviction(node: str, run_id: str, resolved: bool) -> None:
    await workflow.execute_activity_method(
        FleetActivities.record_eviction,
        RecordEviction(node=node, run_id=run_id, resolved=resolved),
        start_to_close_timeout=QUICK,
        summary=f"tell the fleet evicting {node} {'resolved' if resolved else 'did not resolve'} the straggler",
    )


async def dump_stacks(run_id: str, node: str) -> NodeStacks:
    return await workflow.execute_activity_method(
        NodeActivities.dump_stacks,
        run_id,
        task_queue=node_queue(node),
        start_to_close_timeout=timedelta(seconds=30),
        schedule_to_start_timeout=timedelta(seconds=15),
        summary=f"{node}: dump every rank's Python stacks",
    )


async def send_page(message: Page) -> None:
    """Log the page and file it in the JSONL digest: a local activity, in the supervisor beside the
    workflow, because every interruption pages and a local one costs its history one marker, not
    three activity events and a workflow task. A page that wants a person also goes to the webhook
    in an activity of its own, not awaited: its retries, spaced out over an hour, never hold the run
    back."""
    await workflow.execute_local_activity(
        page,
        message,
        start_to_close_timeout=timedelta(seconds=10),
        summary=f"{message.paging.value}: {message.summary}",
    )
    if message.webhook_url and message.paging != PagingClass.INDEPENDENT:
        workflow.start_activity(
            deliver_webhook,
            message,
            start_to_close_timeout=timedelta(seconds=10),
            schedule_to_close_timeout=timedelta(hours=1),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=2), maximum_interval=timedelta(minutes=5)),
            summary=f"POST the {message.paging.value} page to the webhook",
        )
