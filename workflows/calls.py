"""How RunWorkflow calls its activities: one function each, with the timeouts, retries and the
summary a person reads in the web UI. No decisions here; those are in workflows/run.py and core/."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityHandle

with workflow.unsafe.imports_passed_through():
    from activities.checkpoints import ChooseInput, KeeperInput, KeeperResult, choose_checkpoint, keep_checkpoints
    from activities.monitor import monitor_run
    from activities.node import NodeActivities, NodeCommand, PrepareGeneration
    from core.events import MonitorEvent, MonitorInput, NodeOutcome
    from core.launch import NodeEndpoint, NodeLaunch
    from core.run import CheckpointRecord
    from core.telemetry import Command

FOREVER = timedelta(days=3650)


def node_queue(node: str) -> str:
    return f"node.{node}"


async def prepare(run_id: str, generation: int, node: str, host_rendezvous: bool, answer_within: float) -> NodeEndpoint:
    # A node agent that does not pick this up within `answer_within` is gone: schedule-to-start is
    # not retried, which makes it a dead-node detector.
    return await workflow.execute_activity_method(
        NodeActivities.prepare_generation,
        PrepareGeneration(run_id=run_id, generation=generation, host_rendezvous=host_rendezvous),
        task_queue=node_queue(node),
        schedule_to_start_timeout=timedelta(seconds=answer_within),
        start_to_close_timeout=timedelta(minutes=2),
        retry_policy=RetryPolicy(maximum_attempts=3),
        summary=f"{node}: stop earlier ranks"
        + (", open a fresh rendezvous store" if host_rendezvous else "")
        + f" for generation {generation}",
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


def monitor(input: MonitorInput) -> ActivityHandle[MonitorEvent]:
    purpose = "until its first step" if input.await_first_step else "for the next decision"
    return workflow.start_activity(
        monitor_run,
        input,
        start_to_close_timeout=FOREVER,
        heartbeat_timeout=timedelta(seconds=10),
        retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=5)),
        summary=f"watch generation {input.generation} {purpose}",
    )


def keeper(input: KeeperInput, last_step: int | None) -> ActivityHandle[KeeperResult]:
    after = f" after step {last_step}" if last_step is not None else ""
    deleting = f"; delete {len(input.delete)} that retention dropped" if input.delete else ""
    return workflow.start_activity(
        keep_checkpoints,
        input,
        start_to_close_timeout=FOREVER,
        heartbeat_timeout=timedelta(seconds=30),
        retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=5)),
        summary=f"validate generation {input.generation}'s next checkpoint{after}{deleting}",
    )


async def choose(input: ChooseInput) -> list[CheckpointRecord]:
    return await workflow.execute_activity(
        choose_checkpoint,
        input,
        start_to_close_timeout=timedelta(minutes=30),
        heartbeat_timeout=timedelta(seconds=30),
        summary=f"judge the checkpoints generation {input.generation - 1} left behind",
    )


async def release(run_id: str, node: str) -> int:
    return await workflow.execute_activity_method(
        NodeActivities.release_run,
        run_id,
        task_queue=node_queue(node),
        start_to_close_timeout=timedelta(minutes=1),
        schedule_to_close_timeout=timedelta(minutes=5),
        summary=f"{node}: release the run (stop ranks, free host memory)",
    )


async def command(run_id: str, node: str, command: Command) -> int:
    return await workflow.execute_activity_method(
        NodeActivities.send_command,
        NodeCommand(run_id=run_id, command=command),
        task_queue=node_queue(node),
        start_to_close_timeout=timedelta(seconds=30),
        summary=f"{node}: tell ranks to {command.kind}",
    )
