"""What went wrong in a generation, as the timeline entry it becomes: a crash, a lost node, a hang,
silent data corruption, a node that never answered its launch; and what went wrong and stopped
nothing, as a detection: a skipped update, checkpoint storage that went away.

Each is told apart by who noticed (docs/architecture.md §6): a node agent reaps a dead rank, a node agent falls
silent, the run monitor's watchdog sees no step, the ranks' own checks see a wrong number. Each
function gathers what it needs (stack dumps, the fleet's spare), puts the culprit's node out of the
group, and returns the Interruption; the workflow records it and restarts.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

from stayalive.workflows import calls
from stayalive.workflows.inbox import Inbox

with workflow.unsafe.imports_passed_through():
    from stayalive.core.book.findings import Diagnosing
    from stayalive.core.book.runbook import RunBook
    from stayalive.core.decisions.paging import Page
    from stayalive.core.decisions.recovery import interruption_from, resumed_step
    from stayalive.core.fleet.requests import Replace
    from stayalive.core.messages.control import HangInput
    from stayalive.core.messages.events import (
        AnomalyFound,
        GpuFailed,
        Hang,
        NodeLost,
        RankFailed,
        RanksFinished,
        SdcDetected,
        StorageOutage,
    )
    from stayalive.core.run.launch import Membership
    from stayalive.core.run.timeline import Cause, Classification, Detection, Interruption


async def failure(book: RunBook, failed: RankFailed | NodeLost) -> Interruption:
    """A rank died or a node went silent (the monitor has already waited out a rank that died of a
    lost peer): quarantine the node; the next generation restarts from a checkpoint."""
    interruption = interruption_from(failed, book.status, workflow.now())
    if interruption.cause == Cause.CHECKPOINT_INVALID:
        interruption.actions.append("marked the checkpoint it was given unusable")
    else:  # its self-test, which quarantine starts, first stops the node's other ranks and frees its memory
        await replace(book, interruption, failed.node, interruption.line())
    return interruption


async def unreachable(book: RunBook, nodes: dict[str, str]) -> Interruption:
    """Nodes whose agents did not answer the launch: each is a lost node, never a failed run."""
    status = book.status
    first, *others = sorted(nodes)
    interruption = Interruption(
        at=workflow.now(),
        generation=status.generation,
        detected_by="launch: the node agent did not answer",
        cause=Cause.NODE_LOST,
        node=first,
        step=status.progress.step,
        detail="; ".join(f"{node}: {why}" for node, why in sorted(nodes.items())),
    )
    for node in [first, *others]:
        await replace(book, interruption, node, f"did not answer the launch of generation {status.generation}")
    return interruption


async def hang(book: RunBook, event: Hang) -> Interruption:
    """Alive, no progress: dump every rank's stacks and collective counts into one file, name the
    rank they point at (core/judgement/hangs.py) and take its node out; every rank restarts (a blocked
    collective cannot be aborted). When nothing tells the ranks apart (every one waits in the same
    collective), the entry says so and nobody is quarantined: a guess would take out a healthy node."""
    status, spec = book.status, book.spec
    book.apply(Diagnosing(f"no step for {event.stalled_s:.0f}s: dumping stacks"))
    request = HangInput(
        run_id=status.run_id,
        nodes=status.nodes,
        ranks_per_node=spec.ranks_per_node,
        generation=status.generation,
        step=event.step,
        directory=status.checkpoint_dir,
    )
    try:
        stacks = await calls.dump_stacks(request)
        culprit, summary, artifacts = stacks.culprit, stacks.summary, [stacks.artifact] if stacks.artifact else []
    except ActivityError as exc:  # the stacks are evidence, not a precondition: restart all the same
        culprit, summary, artifacts = None, f"stacks could not be dumped: {exc.cause or exc}", []
    interruption = Interruption(
        at=datetime.fromtimestamp(event.at, UTC) - timedelta(seconds=event.stalled_s),
        generation=status.generation,
        detected_by=f"progress watchdog: no step for {event.timeout_s:.0f}s, every rank alive",
        cause=Cause.HANG,
        node=status.node_of(culprit) if culprit is not None else None,
        rank=culprit,
        step=event.step,
        detected_after_s=event.stalled_s,
        detail=summary,
        artifacts=artifacts,
    )
    if interruption.node is not None:  # its self-test first stops the hung rank
        await replace(book, interruption, interruption.node, interruption.line())
    else:
        interruption.actions.append("no culprit named: nobody quarantined, every rank restarts on the same nodes")
    return interruption


async def gpu_failure(book: RunBook, event: GpuFailed) -> Interruption:
    """NVML saw a GPU of the node fail in a way it cannot compute past (lost, an uncorrectable error,
    a critical Xid), or a plain script that cannot hold to drain: quarantine the node (its self-test
    reads NVML again before it may return); the next generation restarts from a checkpoint."""
    status = book.status
    interruption = Interruption(
        at=workflow.now(),
        generation=status.generation,
        detected_by="NVML: the node agent's GPU watch",
        cause=Cause.GPU_FAULT,
        node=event.node,
        # The last step every rank completed, or before this generation's first the step it resumed from.
        step=max(event.progress.step, resumed_step(status) or 0),
        detail=event.detail(),
    )
    await replace(book, interruption, event.node, f"GPU failure: {event.detail()}")
    return interruption


DETECTED_BY = {
    "self": "bitwise self-check replay",
    "cross": "cross-rank check",
    "replicas": "cross-rank check of data-parallel replicas",
}


async def sdc(book: RunBook, event: SdcDetected) -> Interruption:
    """A check failed and every rank halted before the step's update. What was computed after the
    last passing check may be corrupt: those checkpoints become suspect, the culprit's node is
    quarantined (its self-test runs in the fleet), and the run restarts from the newest checkpoint
    at or before that check."""
    check, status = event.check, book.status
    suspect = book.corrupted(check)
    node = status.node_of(check.culprit) if check.culprit is not None else None
    interruption = Interruption(
        at=workflow.now(),
        generation=status.generation,
        detected_by=DETECTED_BY[check.method],
        cause=Cause.SDC,
        node=node,
        rank=check.culprit,
        step=check.step - 1,  # the corrupted step's update was never applied
        detail=check.detail,
        sdc_check=check,
        actions=[
            f"every rank halted at step {check.step} before its update",
            f"marked {len(suspect)} checkpoints after step {check.last_verified} (the last passing check) suspect",
        ],
    )
    if node is not None:
        await replace(book, interruption, node, f"SDC: {check.detail}")
    return interruption


def anomaly(book: RunBook, event: AnomalyFound) -> None:
    """A step's update was skipped on every rank and training went on: recorded, with the rank whose
    numbers went non-finite, for a person to investigate."""
    found, status = event.anomaly, book.status
    named = found.kind == "nonfinite" and found.origin_known
    book.detect(
        Detection(
            at=workflow.now(),
            generation=status.generation,
            kind=found.kind,
            step=found.step,
            node=status.node_of(found.rank) if named else None,
            rank=found.rank if named else None,
            evidence=found.detail,
            actions=[f"every rank skipped the update of step {found.step}; the weights are untouched"],
        )
    )
    workflow.logger.warning("update of step %s skipped: %s", found.step, found.detail)


def lingered(book: RunBook, finished: RanksFinished) -> None:
    """Ranks still running an exit grace after another finished: the run's release stops them."""
    ranks = finished.lingering
    shown = ", ".join(str(r) for r in ranks[:16]) + (f", … ({len(ranks)} ranks)" if len(ranks) > 16 else "")
    book.detect(
        Detection(
            at=workflow.now(),
            generation=finished.generation,
            kind="lingered",
            step=finished.progress.step,
            rank=ranks[0],
            node=book.status.node_of(ranks[0]),
            evidence=f"rank {shown} still running {finished.grace_s:g}s after the first rank finished",
            actions=["stopped them and completed the run (health.exit_grace)"],
        )
    )


async def storage(book: RunBook, event: StorageOutage) -> None:
    """Checkpoint storage is away and the ranks train on, checkpointing into host memory: recorded
    on the run, and a person is paged once it outlasts paging's bound (core.decisions.paging.storage_outage)."""
    outage = event.outage
    paging = book.storage(event)
    workflow.logger.warning("checkpoint storage %s (since step %s): %s", event.phase, outage.step, outage.error)
    if paging is not None:
        since = datetime.fromtimestamp(outage.since, UTC).strftime("%H:%M:%S UTC")
        summary = f"checkpoint storage unavailable since {since} (step {outage.step}); training goes on"
        await calls.send_page(page(book, paging, summary))


async def replace(book: RunBook, interruption: Interruption, node: str, reason: str) -> Membership:
    """Quarantine `node` and put a spare in its place, or go on without it (or stop, below the minimum)."""
    replacement = await calls.replace(
        Replace(run_id=book.status.run_id, node=node, reason=reason, candidates=book.spare_candidates())
    )
    return book.replaced(interruption, node, replacement.spare)


def page(book: RunBook, classification: Classification, summary: str) -> Page:
    sinks = book.spec.paging
    return Page.of(
        book.status.run_id,
        workflow.now(),
        classification,
        summary,
        webhook_url=str(sinks.webhook) if sinks.webhook else None,
        jsonl_path=sinks.jsonl,
    )


def file_partitions(book: RunBook, inbox: Inbox) -> None:
    """Node agents that fenced themselves out of a generation they were cut off from: each one's
    node-lost entry becomes a partition, through the book."""
    for report in inbox.take_partitions():
        if (amended := book.partitioned(report)) is None:
            workflow.logger.info("partition of %s (g%s): no lost node to amend", report.node, report.generation)
        else:
            workflow.logger.warning("interruption amended: %s", amended.line())
