"""A partition told from a dead node, and the generation number as a fencing token.

A node cut off from the run looks, from the supervisor's side, exactly like a dead one: its hub falls
silent and its ranks' peers elsewhere lose it. What tells them apart is what the node's side can
still see: an agent that is alive but hears nothing from the run's monitor knows it is cut off. It
fences itself (stops the run's ranks: the run has moved on without them) and, when it can talk to
Temporal again, reports the partition; the run then amends the `node_lost` entry of that generation
to `partition`. The amendment comes after the fact: at detection time the supervisor has no evidence
that the node is alive (a cut that takes the hub takes the agent's path to Temporal too).

Fencing: each launch raises the fence in the run's checkpoint directory to the new generation. A
checkpoint of an older generation is never committed there (the committing rank reads the fence
before its rename) nor judged valid (the keeper reads it too). A returning node's ranks cannot join
the new group either: the rendezvous store opens only to its own generation (agent/hub.py).
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel

from stayalive.core.run.timeline import Cause, Interruption

PARTITION_REPORT = "partitioned"  # the RunWorkflow signal that carries a PartitionReport
FENCE_FILE = "FENCE"  # in the run's checkpoint directory: the newest generation launched, as text


def fenced_out(fence: int | None, generation: int) -> bool:
    """A writer of `generation` may not commit where the fence stands higher (None: no fence yet)."""
    return fence is not None and generation < fence


def raised(fence: int | None, generation: int) -> int:
    """The fence after launching `generation`: it never goes down (a retried old launch cannot lower it)."""
    return generation if fence is None else max(fence, generation)


def cut_off(last_read: float, now: float, bound: float) -> bool:
    """An agent whose run has ranks here and whose monitor has not read from it for `bound` seconds
    is cut off from the run (the monitor reads every second while it watches)."""
    return now - last_read > bound


class PartitionReport(BaseModel):
    """From a node agent that fenced itself out of a generation, once it can reach Temporal again."""

    node: str
    run_id: str
    generation: int
    since: float  # seconds since the epoch: when the monitor last read from it
    fenced_at: float  # when it stopped the generation's ranks
    stopped: int  # how many of them were still running


def amend(interruptions: list[Interruption], report: PartitionReport) -> Interruption | None:
    """The node-lost entry of the reported node and generation becomes a partition; None if there is
    none (the run never took the node for lost, or the entry has left the timeline)."""
    for interruption in reversed(interruptions):
        if (
            interruption.cause == Cause.NODE_LOST
            and interruption.node == report.node
            and interruption.generation == report.generation
        ):
            since = datetime.fromtimestamp(report.since, UTC).strftime("%H:%M:%S")
            fenced = datetime.fromtimestamp(report.fenced_at, UTC).strftime("%H:%M:%S")
            interruption.cause = Cause.PARTITION
            interruption.detected_by += "; the node's agent reported a partition"
            interruption.actions.append(
                f"{report.node} was alive but cut off from the run from {since} UTC; it fenced itself out "
                f"of generation {report.generation} at {fenced} UTC, stopping {report.stopped} ranks"
            )
            return interruption
    return None
