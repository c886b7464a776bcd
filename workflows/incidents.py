"""What a run does about what went wrong: a crash, a lost node, a hang, a straggler, a slowdown,
silent data corruption, a skipped update.

Each is told apart by who noticed (seed 002): a node agent reaps a dead rank, a node agent falls
silent, the run monitor's progress watchdog sees no step, its detectors see one rank or the whole
run slow, the ranks' own checks see a wrong number. Each has its own remedy. Workflow code: it
decides and calls activities, nothing else.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from temporalio import workflow

from workflows import calls
from workflows.generation import Generation

with workflow.unsafe.imports_passed_through():
    from activities.fleet import Replace
    from activities.paging import Page
    from core.detectors import culprit
    from core.events import AnomalyFound, Hang, NodeLost, RankFailed, SdcDetected
    from core.goodput import recent_goodput
    from core.launch import Membership, assign_ranks, without_node
    from core.paging import Classification, PagingClass, classify
    from core.recovery import interruption_from, mark_suspect
    from core.run import Cause, Detection, Interruption, RunState

if TYPE_CHECKING:
    from workflows.run import RunWorkflow


async def failure(run: RunWorkflow, gen: Generation, first: RankFailed | NodeLost) -> None:
    """A rank died or a node went silent: find who failed, quarantine it, restart from a checkpoint."""
    failed = await _culprit(run, gen, first)
    await gen.cancel()
    status = run.status
    interruption = interruption_from(failed, status, workflow.now())
    if interruption.cause == Cause.CHECKPOINT_INVALID:
        interruption.actions.append("marked the checkpoint it was given unusable")
    else:  # its self-test, which quarantine starts, first stops the node's other ranks and frees its memory
        await replace(run, interruption, failed.node, interruption.line())
    await _restart(run, interruption)


async def hang(run: RunWorkflow, gen: Generation, event: Hang) -> None:
    """Alive, no progress: dump every rank's stacks, name the rank whose stack differs, take its node
    out, and restart every rank (a blocked collective cannot be aborted)."""
    status = run.status
    run.set_state(RunState.DIAGNOSING, f"no step for {event.stalled_s:.0f}s: dumping stacks")
    dumps = await asyncio.gather(*(calls.dump_stacks(run.run_id, node) for node in status.nodes))
    await gen.cancel()
    stacks = {rank: text for dump in dumps for rank, text in dump.stacks.items()}
    suspects = culprit(stacks)
    rank = suspects[0] if len(suspects) == 1 else None
    interruption = Interruption(
        at=datetime.fromtimestamp(event.at, UTC) - timedelta(seconds=event.stalled_s),
        generation=status.generation,
        detected_by=f"progress watchdog: no step for {event.timeout_s:.0f}s, every rank alive",
        cause=Cause.HANG,
        node=_node_of(run, rank) if rank is not None else None,
        rank=rank,
        step=event.step,
        detected_after_s=event.stalled_s,
        detail=f"rank {rank}'s stack differs from the other {len(stacks) - 1}"
        if rank is not None
        else f"no single rank's stack stands out (suspects: {suspects or 'none'})",
        artifacts=sorted({path for dump in dumps for path in dump.files.values()}),
    )
    if interruption.node is not None:  # its self-test first stops the hung rank
        await replace(run, interruption, interruption.node, interruption.line())
    else:
        interruption.actions.append("no culprit named: every rank restarts on the same nodes")
    await _restart(run, interruption)


async def sdc(run: RunWorkflow, gen: Generation, event: SdcDetected) -> None:
    """A check failed and every rank halted before the step's update. What was computed after the
    last passing check may be corrupt: those checkpoints become suspect, the culprit's node is
    quarantined (its self-test runs in the fleet), and the run restarts from the newest checkpoint
    at or before that check."""
    check, status = event.check, run.status
    await gen.cancel()
    suspect = mark_suspect(status.checkpoints, status.generation, check.last_verified)
    resume = status.latest_valid_checkpoint()
    status.verified_step = resume.step if resume else 0  # the new timeline is verified up to where it starts
    node = _node_of(run, check.culprit) if check.culprit is not None else None
    interruption = Interruption(
        at=workflow.now(),
        generation=status.generation,
        detected_by="bitwise self-check replay" if check.method == "self" else "cross-rank check",
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
        await replace(run, interruption, node, f"SDC: {check.detail}")
    await _restart(run, interruption)


def anomaly(run: RunWorkflow, event: AnomalyFound) -> None:
    """A step's update was skipped on every rank and training went on: recorded, with the rank whose
    numbers went non-finite, for a person to investigate."""
    found = event.anomaly
    run.status.detections.append(
        Detection(
            at=workflow.now(),
            generation=run.status.generation,
            kind=found.kind,
            step=found.step,
            node=_node_of(run, found.rank) if found.kind == "nonfinite" else None,
            rank=found.rank if found.kind == "nonfinite" else None,
            evidence=found.detail,
            actions=[f"every rank skipped the update of step {found.step}; the weights are untouched"],
        )
    )
    workflow.logger.warning("update of step %s skipped: %s", found.step, found.detail)


def _node_of(run: RunWorkflow, rank: int) -> str | None:
    placement = assign_ranks(run.status.nodes, run.spec.ranks_per_node)
    return next((node for node, ranks in placement.items() if rank in ranks), None)


async def replace(run: RunWorkflow, interruption: Interruption, node: str, reason: str) -> Membership:
    """Quarantine `node` and put a spare in its place, or go on without it (or stop, below the minimum)."""
    status, spec = run.status, run.spec
    replacement = await calls.replace(
        Replace(run_id=run.run_id, node=node, reason=reason, candidates=run.spare_candidates())
    )
    interruption.actions.append(f"quarantined {node} in the fleet (self-test running)")
    membership = without_node(status.nodes, node, replacement.spare, spec.ranks_per_node)
    if replacement.spare:
        status.spares_used.append(replacement.spare)
        interruption.actions.append(f"replaced {node} with spare {replacement.spare}")
    elif len(membership.nodes) >= spec.min_nodes:
        interruption.actions.append(f"no spare free: continuing on {len(membership.nodes)} nodes")
    else:
        interruption.actions.append(f"no spare free and {len(membership.nodes)} nodes < min {spec.min_nodes}")
    status.nodes = list(membership.nodes)
    return membership


async def _restart(run: RunWorkflow, interruption: Interruption) -> None:
    """Classify, record, page, and let the next generation restart every rank from a checkpoint."""
    status, now = run.status, workflow.now()
    paging = classify(status.interruptions, interruption, run.spec.checkpoint.prior_mtbf, recent_goodput(status, now))
    interruption.paging = paging
    run.record(interruption)
    if paging.paging == PagingClass.DETERMINISTIC:
        run.stop(f"{paging.rule}: {paging.evidence}. {paging.action}")
        interruption.actions.append("stopped the run for a person")
    await page(run, paging, interruption.line())


async def page(run: RunWorkflow, classification: Classification, summary: str) -> None:
    sinks = run.spec.paging
    await calls.send_page(
        Page.of(
            run.run_id,
            workflow.now(),
            classification,
            summary,
            webhook_url=str(sinks.webhook) if sinks.webhook else None,
            jsonl_path=sinks.jsonl,
        )
    )


async def _culprit(run: RunWorkflow, gen: Generation, first: RankFailed | NodeLost) -> RankFailed | NodeLost:
    """A rank that died of a lost peer is a witness: wait (up to a heartbeat timeout) for the node
    that actually failed, whose agent reports a crash or falls silent."""
    if not (isinstance(first, RankFailed) and first.peer_lost):
        return first
    run.set_state(RunState.DIAGNOSING, f"rank {first.rank} lost a peer: waiting for the node that failed")
    deadline = workflow.now() + timedelta(seconds=run.spec.health.node_heartbeat_timeout + 5)
    pending = {task: node for node, task in gen.nodes.items() if node not in gen.finished and node != first.node}
    while pending and workflow.now() < deadline:
        done, _ = await workflow.wait(
            list(pending), timeout=(deadline - workflow.now()).total_seconds(), return_when=asyncio.FIRST_COMPLETED
        )
        for task in done:
            outcome = await run.outcome(pending.pop(task), task)
            if isinstance(outcome, NodeLost) or (isinstance(outcome, RankFailed) and not outcome.peer_lost):
                return outcome
        if not done:
            break
    return first
