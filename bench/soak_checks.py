"""What the soak checks after each run, over what the run left: its result and timeline, every
checkpoint record it showed, and the step reports and rank placements its node agents received.

Plain functions, no I/O: bench/soak.py gathers the evidence, these judge it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bench.soak_plan import WORLD_SIZE, PlannedFault, RunPlan
from stayalive.core.protocol.telemetry import StepReport
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.status import CheckpointRecord
from stayalive.core.run.timeline import Detection, Interruption

BLAMING_DETECTIONS = {"straggler", "slowdown"}  # detections that name a culprit


@dataclass
class FaultVerdict:
    run: int
    fault: PlannedFault
    caught: bool  # the timeline shows it as planned (an interruption of its cause, or the detection)
    blame_right: bool = True  # the rank and node it names are the ones the fault hit
    detail: str = ""
    lost_steps: int | None = None
    restart_s: float | None = None


@dataclass
class RunVerdict:
    index: int
    state: str
    final_step: int
    wall_s: float
    faults: list[FaultVerdict]
    samples_lost: int = 0
    samples_repeated: int = 0
    samples_out_of_order: int = 0
    reports_missing: str = ""  # where step reports never came, when samples count as lost
    weights_equal: bool = False
    unvalidated_resumes: list[str] = field(default_factory=list)
    uncosted: list[str] = field(default_factory=list)  # interruptions without their cost
    unexpected: list[str] = field(default_factory=list)  # interruptions or blame no fault explains

    @property
    def completed(self) -> bool:
        return self.state == RunState.COMPLETED


def judge_faults(
    plan: RunPlan,
    interruptions: list[Interruption],
    detections: list[Detection],
    placement: dict[tuple[int, int], str],
    acted_on: dict[int, str],
    missed: dict[int, str],
) -> tuple[list[FaultVerdict], list[str]]:
    """Each planned fault against the timeline, and what the timeline shows that no fault explains.
    `placement`: (generation, rank) → node, from the agents' RankStarted; `acted_on`: fault index →
    the node the bench acted on (an agent killed, a node cut off, a drain); `missed`: fault index →
    why the bench found no moment to carry it out."""
    by_generation: dict[int, list[Interruption]] = {}
    for interruption in interruptions:
        by_generation.setdefault(interruption.generation, []).append(interruption)
    verdicts, unexpected = [], []
    explained: set[int] = set()
    for index, fault in enumerate(plan.faults):
        if index in missed:
            verdicts.append(FaultVerdict(plan.index, fault, caught=False, detail=f"never carried out: {missed[index]}"))
        elif fault.interrupts:
            explained.add(fault.generation)
            found = by_generation.get(fault.generation, [])
            node = acted_on.get(index) if fault.action else placement.get((fault.generation, fault.rank or 0))
            verdicts.append(_interrupting(plan.index, fault, found[0] if found else None, node))
        else:
            verdicts.append(_riding_through(plan.index, fault, detections))
    for generation, found in sorted(by_generation.items()):
        extra = found[1:] if generation in explained else found
        unexpected += [f"generation {i.generation}: {i.line()} ({i.detected_by})" for i in extra]
    planned_slow = {(f.generation, f.rank) for f in plan.faults if f.kind == "straggler"}
    for detection in detections:
        if detection.kind in BLAMING_DETECTIONS and (detection.generation, detection.rank) not in planned_slow:
            unexpected.append(f"generation {detection.generation}: {detection.kind} on rank {detection.rank}")
    return verdicts, unexpected


def _interrupting(run: int, fault: PlannedFault, found: Interruption | None, node: str | None) -> FaultVerdict:
    expect = fault.expect
    if found is None:
        return FaultVerdict(run, fault, caught=False, detail=f"no interruption in generation {fault.generation}")
    verdict = FaultVerdict(run, fault, caught=found.cause.value == expect.cause, detail=found.line())
    verdict.lost_steps, verdict.restart_s = found.lost_steps, found.restart_seconds
    if not verdict.caught:
        verdict.detail = f"expected {expect.cause}, the timeline says {found.line()}"
        return verdict
    want_node = node if expect.blame_node else None
    verdict.blame_right = found.rank == expect.rank and found.node == want_node
    if not verdict.blame_right:
        verdict.detail = f"expected rank {expect.rank} on {want_node}, blamed rank {found.rank} on {found.node}"
    return verdict


def _riding_through(run: int, fault: PlannedFault, detections: list[Detection]) -> FaultVerdict:
    """A fault that must not interrupt: storage away is detected from the write it broke; a straggler
    may be flagged, and then as the rank that was slowed; a killed supervisor or server leaves no
    mark but the run's completing with everything else intact."""
    kind = fault.expect.detection
    if kind is None:
        return FaultVerdict(run, fault, caught=True, detail="ridden through")
    seen = [d for d in detections if d.kind == kind and d.generation == fault.generation]
    if kind == "storage_outage":
        caught = any(d.step == fault.step for d in seen)
        return FaultVerdict(
            run, fault, caught=caught, detail=f"{len(seen)} storage detections at {[d.step for d in seen]}"
        )
    wrong = [d for d in seen if d.rank != fault.rank]
    flagged = f"flagged at step {seen[0].step}" if seen else "not flagged"
    return FaultVerdict(
        run, fault, caught=bool(seen) or not fault.expect.required, blame_right=not wrong, detail=flagged
    )


def unvalidated_resumes(
    plan: RunPlan, interruptions: list[Interruption], records: dict[tuple[int, int], CheckpointRecord]
) -> list[str]:
    """Resumes from a checkpoint no validation passed (by step and writing generation, as every record
    of the run showed it), and resumes from a checkpoint the plan damaged."""
    wrong = []
    for interruption in interruptions:
        step = interruption.resumed_from
        if not step:
            continue
        valid = any(
            r.step == step and r.generation <= interruption.generation and r.resumable for r in records.values()
        )
        if not valid:
            wrong.append(f"generation {interruption.generation} resumed from step {step}, never validated")
    for fault in plan.faults:
        if fault.damaged_step is None:
            continue
        record = records.get((fault.damaged_step, fault.generation))
        if record is not None and record.validated:
            wrong.append(f"the damaged checkpoint of step {fault.damaged_step} passed validation")
        resumed = next((i.resumed_from for i in interruptions if i.generation == fault.generation), None)
        if resumed is not None and resumed >= fault.damaged_step:
            wrong.append(
                f"generation {fault.generation + 1} resumed from {resumed}, at or after the damaged checkpoint"
            )
    return wrong


def coverage(reports: list[StepReport], resumed: list[int], target: int) -> str:
    """Where step reports are missing along the final lineage: per generation, the steps it should
    have reported and how many each rank did (to tell lost samples from reports that never came)."""
    starts, ends = [0, *resumed], [*resumed, target]
    shown = []
    for generation, (first, last) in enumerate(zip(starts, ends, strict=True)):
        steps: Counter[int] = Counter(r.rank for r in reports if r.generation == generation and first < r.step <= last)
        if any(n < last - first for n in steps.values()) or len(steps) < WORLD_SIZE:
            shown.append(f"g{generation} steps {first + 1}-{last}: {dict(sorted(steps.items()))}")
    return "; ".join(shown)


def uncosted(interruptions: list[Interruption]) -> list[str]:
    """Interruptions whose cost the timeline does not give: steps lost, and the seconds to recover.
    A recovery the next interruption cut short, before its generation completed a step, has no
    seconds of its own: they run on into the next entry's."""
    missing = []
    for i, following in zip(interruptions, [*interruptions[1:], None], strict=True):
        cut_short = following is not None and following.step is not None and following.step <= (i.resumed_from or 0)
        if i.resumed_from is None or i.lost_steps is None or (i.restart_seconds is None and not cut_short):
            missing.append(f"generation {i.generation}: {i.line()}")
    return missing
