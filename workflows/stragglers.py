"""What a run does about slowness: a straggler climbs the S1→S4 ladder as its cost is paid (ski
rental), a slowdown of every rank pages facilities and evicts nobody (docs/architecture.md §11).

The ladder's rent is the ledger's straggler loss (RunStatus.straggler_seconds), which the run monitor
tallies while a straggler is known. Each rung is bought once the rent paid on the one below exceeds
its price, and an eviction also has to pass core.judgement.eviction (the diagnosis, the payback against the
run's remaining time, one per hour, never twice in one rack without a person). Evicting is a drain
(auto-cordon): the survivors keep their processes and a spare takes the node's place, or the run
shrinks: `climb` returns the drain for the workflow to carry out.
"""

from __future__ import annotations

import statistics

from temporalio import workflow

from stayalive.workflows import calls
from stayalive.workflows.inbox import Request
from stayalive.workflows.incidents import page

with workflow.unsafe.imports_passed_through():
    from stayalive.core.book.runbook import RunBook
    from stayalive.core.decisions.paging import environmental
    from stayalive.core.judgement.diagnosis import NO_TELEMETRY, Diagnosis
    from stayalive.core.judgement.escalation import Escalation, Strategy, costs, next_strategy
    from stayalive.core.judgement.eviction import Eviction, should_evict
    from stayalive.core.messages.control import CommandRanks
    from stayalive.core.messages.events import SlowdownFound, StragglerFound
    from stayalive.core.run.lifecycle import RunState
    from stayalive.core.run.timeline import Detection

# R before the run has restarted once: the 10 minutes assumed at scale (docs/architecture.md §16).
PRIOR_RESTART_S = 600.0


async def straggler(book: RunBook, event: StragglerFound) -> None:
    """One rank is slow and correct: record it with its diagnosis, mark its node suspect, and start
    paying rent on S1 (do nothing: most slow-failures end on their own)."""
    verdict = event.verdict
    status = book.status
    detection = Detection(
        at=workflow.now(),
        generation=status.generation,
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
    book.detect(detection)
    if status.escalation is None and book.spec.hooks:
        book.escalate(
            Escalation(
                generation=status.generation,
                rank=event.rank,
                node=event.node,
                rack=event.rack or "unknown",
                ratio=event.ratio,
                verdict=verdict,
                # The rent the report carries was paid to this straggler while it was being detected.
                paid_before_s=status.straggler_seconds - event.progress.straggler_s,
            )
        )
        detection.actions.append("S1: wait, paying the slowdown as rent until a remedy costs less")
    workflow.logger.warning("straggler: rank %s on %s at %.2fx", event.rank, event.node, event.ratio)


async def climb(book: RunBook) -> Request | None:
    """After each tally of slowness: buy the next rung once the rent paid exceeds its price. S3 and
    S4 are a drain of the straggler's node, which this returns for the workflow to carry out."""
    status = book.status
    ladder = status.escalation
    if ladder is None or ladder.settled is not None or status.state != RunState.RUNNING:
        return None
    if ladder.generation != status.generation:  # the group was rebuilt: its ranks are not the ones measured
        book.escalate(None)
        return None
    verdict = ladder.verdict or NO_TELEMETRY
    restart_s = measured_restart(book)
    compute_bound = verdict.diagnosis not in (Diagnosis.NODE_LINK, Diagnosis.NETWORK_CONTENTION)
    prices = costs(restart_s, status.progress.step_seconds_p50, bool(book.spare_candidates()), compute_bound)
    paid = status.straggler_seconds - ladder.paid_before_s
    rung = next_strategy(ladder.strategy, paid, prices)
    if rung == ladder.strategy:
        return None
    detection = next(d for d in reversed(status.detections) if d.kind == "straggler" and d.node == ladder.node)
    if rung == Strategy.S2_REBALANCE:
        ladder.strategy, ladder.paid_before_s = rung, status.straggler_seconds
        speeds = [1 / ladder.ratio if rank == ladder.rank else 1.0 for rank in range(status.world_size)]
        detection.actions.append(f"S2 after {paid:.1f}s of slowdown paid: rebalance micro-batches by speed")
        command = CommandRanks(run_id=status.run_id, nodes=status.nodes, command=book.command("rebalance", speeds))
        await calls.command(command, f"rebalance micro-batches: rank {ladder.rank} at 1/{ladder.ratio:.2f}")
        return None
    remaining = (book.spec.target_step or status.progress.step) - status.progress.step
    decision = should_evict(
        verdict,
        ladder.rack,
        ladder.ratio,
        restart_s,
        remaining * status.progress.step_seconds_p50,
        await calls.eviction_outcomes(),
        status.evictions,
        workflow.now(),
    )
    if not decision.evict:
        ladder.settled = f"refused {rung.value}: {decision.reason}"
        detection.actions.append(f"{paid:.0f}s of slowdown paid; {ladder.settled}")
        return None
    ladder.strategy, ladder.paid_before_s, ladder.settled = rung, status.straggler_seconds, "evicted"
    book.evicted(Eviction(at=workflow.now(), node=ladder.node, rack=ladder.rack, diagnosis=verdict.diagnosis))
    how = "re-place it on a spare" if rung == Strategy.S3_REPLACE else "restart without it"
    detection.actions.append(f"{rung.value} after {paid:.0f}s of slowdown paid: {decision.reason}; {how}")
    reason = f"rank {ladder.rank} at {ladder.ratio:.2f}×: {rung.value}"
    return Request(kind="drain", node=ladder.node, reason=reason, by="straggler escalation")


async def settle(book: RunBook, resolved: bool) -> None:
    """An eviction's outcome is known: the run ran healthy windows after it (resolved) or found a
    straggler again (not). The fleet learns it, for every later run's P(healthy)."""
    ladder = book.status.escalation
    if ladder is None or ladder.settled != "evicted":
        return
    await calls.record_eviction(ladder.node, book.status.run_id, resolved)
    book.escalate(None)


def measured_restart(book: RunBook) -> float:
    """R: the median of this run's measured restarts, PRIOR_RESTART_S before the first."""
    measured = [i.restart_seconds for i in book.status.interruptions if i.restart_seconds is not None]
    return statistics.median(measured) if measured else PRIOR_RESTART_S


async def slowdown(book: RunBook, event: SlowdownFound) -> None:
    """Every rank is slow together: the absolute check against healthy runs caught what the relative
    one cannot. An environmental cause pages facilities; no node is evicted for it."""
    verdicts = list(event.verdicts.values())
    shared = [v for v in verdicts if v.diagnosis == Diagnosis.ENVIRONMENTAL]
    leading = (shared or verdicts)[0] if verdicts else None
    detection = Detection(
        at=workflow.now(),
        generation=book.status.generation,
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
    book.detect(detection)
    if detection.paging is not None:
        summary = f"every rank {event.ratio:.2f}× slower than healthy runs at step {event.step}"
        await calls.send_page(page(book, detection.paging, summary))
    workflow.logger.warning("slowdown: %.2fx the baseline (%s)", event.ratio, leading.diagnosis if leading else "?")
