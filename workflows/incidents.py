"""What a run does about what went wrong: a crash, a lost node, a hang, a straggler, a slowdown.

Each is told apart by who noticed (seed 002): a node agent reaps a dead rank, a node agent falls
silent, the run monitor's progress watchdog sees no step, its detectors see one rank or the whole
run slow. Each has its own remedy. Workflow code: it decides and calls activities, nothing else.
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
    from core.detectors import culprit
    from core.diagnosis import Diagnosis
    from core.events import Hang, NodeLost, RankFailed, SlowdownFound, StragglerFound
    from core.launch import Membership, assign_ranks, without_node
    from core.paging import PagingClass, classify, environmental
    from core.recovery import interruption_from
    from core.run import Cause, Detection, Interruption, RunState

if TYPE_CHECKING:
    from workflows.run import RunWorkflow


async def failure(run: RunWorkflow, gen: Generation, first: RankFailed | NodeLost) -> None:
    """A rank died or a node went silent: find who failed, quarantine it, restart from a checkpoint."""
    failed = await _culprit(run, gen, first)
    await gen.cancel()
    status = run.status
    run.set_state(RunState.DIAGNOSING)
    interruption = interruption_from(failed, status, workflow.now())
    if interruption.cause == Cause.CHECKPOINT_INVALID:
        interruption.actions.append("marked the checkpoint it was given unusable")
    elif isinstance(failed, RankFailed):  # its agent is up: also stop the node's other ranks, free its memory
        await asyncio.gather(
            replace(run, interruption, failed.node, interruption.line()), calls.release(run.run_id, failed.node)
        )
    else:
        await replace(run, interruption, failed.node, interruption.line())
    _restart(run, interruption)


async def hang(run: RunWorkflow, gen: Generation, event: Hang) -> None:
    """Alive, no progress: dump every rank's stacks, name the rank whose stack differs, take its node
    out, and restart every rank (a blocked collective cannot be aborted)."""
    status = run.status
    run.set_state(RunState.DIAGNOSING, f"no step for {event.stalled_s:.0f}s: dumping stacks")
    dumps = await asyncio.gather(*(calls.dump_stacks(run.run_id, node) for node in status.nodes))
    await gen.cancel()
    stacks = {rank: text for dump in dumps for rank, text in dump.stacks.items()}
    suspects = culprit(stacks)
    node_of = {
        rank: node for node, ranks in assign_ranks(status.nodes, status.spec.ranks_per_node).items() for rank in ranks
    }
    rank = suspects[0] if len(suspects) == 1 else None
    interruption = Interruption(
        at=datetime.fromtimestamp(event.at, UTC) - timedelta(seconds=event.stalled_s),
        generation=status.generation,
        detected_by=f"progress watchdog: no step for {event.timeout_s:.0f}s, every rank alive",
        cause=Cause.HANG,
        node=node_of.get(rank) if rank is not None else None,
        rank=rank,
        step=event.step,
        detected_after_s=event.stalled_s,
        detail=f"rank {rank}'s stack differs from the other {len(stacks) - 1}"
        if rank is not None
        else f"no single rank's stack stands out (suspects: {suspects or 'none'})",
        artifacts=sorted({path for dump in dumps for path in dump.files.values()}),
    )
    if interruption.node is not None:
        await replace(run, interruption, interruption.node, interruption.line())
        await calls.release(run.run_id, interruption.node)  # its hung rank holds on until stopped
    else:
        interruption.actions.append("no culprit named: every rank restarts on the same nodes")
    _restart(run, interruption)


async def straggler(run: RunWorkflow, event: StragglerFound) -> None:
    """One rank is slow and correct: record it with its diagnosis and mark its node suspect."""
    verdict = event.verdict
    detection = Detection(
        at=workflow.now(),
        generation=run.status.generation,
        kind="straggler",
        step=event.step,
        ratio=event.ratio,
        node=event.node,
        rank=event.rank,
        diagnosis=verdict.diagnosis.value if verdict else None,
        evidence=verdict.evidence if verdict else "no GPU telemetry from the node yet",
        actions=[f"rank {event.rank} on {event.node} computes {event.ratio:.2f}× the median (z {event.z:.1f})"],
    )
    await calls.mark_suspect(event.node, f"straggler: rank {event.rank} at {event.ratio:.2f}× ({detection.diagnosis})")
    detection.actions.append(f"marked {event.node} suspect in the fleet")
    run.status.detections.append(detection)
    workflow.logger.warning("straggler: rank %s on %s at %.2fx", event.rank, event.node, event.ratio)


def slowdown(run: RunWorkflow, event: SlowdownFound) -> None:
    """Every rank is slow together: the absolute check against healthy runs caught what the relative
    one cannot. An environmental cause pages facilities; no node is evicted for it."""
    verdicts = list(event.verdicts.values())
    shared = [v for v in verdicts if v.diagnosis == Diagnosis.ENVIRONMENTAL]
    leading = (shared or verdicts)[0] if verdicts else None
    run.status.detections.append(
        Detection(
            at=workflow.now(),
            generation=run.status.generation,
            kind="slowdown",
            step=event.step,
            ratio=event.ratio,
            diagnosis=leading.diagnosis.value if leading else None,
            evidence=leading.evidence if leading else "no GPU telemetry",
            actions=[
                f"the run's step time is {event.ratio:.2f}× its healthy baseline "
                f"({event.window_median * 1000:.0f} ms against {event.baseline_median * 1000:.0f} ms)",
                "no node evicted: every rank is slow alike",
            ],
            paging=environmental(event.ratio, leading.evidence) if shared and leading else None,
        )
    )
    workflow.logger.warning("slowdown: %.2fx the baseline (%s)", event.ratio, leading.diagnosis if leading else "?")


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


def _restart(run: RunWorkflow, interruption: Interruption) -> None:
    """Classify, record, and let the next generation restart every rank from a checkpoint."""
    status = run.status
    interruption.paging = classify(status.interruptions, interruption, run.spec.checkpoint.prior_mtbf, None)
    run.record(interruption)
    if interruption.paging.paging == PagingClass.DETERMINISTIC:
        run.stop(f"{interruption.paging.rule}: {interruption.paging.evidence}. {interruption.paging.action}")
        interruption.actions.append("stopped the run for a person")


async def _culprit(run: RunWorkflow, gen: Generation, first: RankFailed | NodeLost) -> RankFailed | NodeLost:
    """A rank that died of a lost peer is a witness: wait (up to a heartbeat timeout) for the node
    that actually failed, whose agent reports a crash or falls silent."""
    if not (isinstance(first, RankFailed) and first.peer_lost):
        return first
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
