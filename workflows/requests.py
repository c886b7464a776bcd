"""What a person (or, later, a detector) asks a run to do: drain a node, pause, roll back; and the
stopped state, where nobody trains until a person or a free node lets the run go on.

Drain and pause share the first half of auto-cordon (seed 000): drain (no new work) → wait for the
in-flight step → checkpoint. Then a drain resizes (the group is rebuilt without the node) and a pause
waits for `resume`; both resume with the surviving processes, which kept their memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

from temporalio import workflow

from workflows import calls, checkpoints, incidents
from workflows.generation import Generation

with workflow.unsafe.imports_passed_through():
    from core.events import MonitorInput
    from core.launch import without_node
    from core.paging import PLANNED
    from core.recovery import supersede
    from core.run import Cause, Interruption, RunState

if TYPE_CHECKING:
    from workflows.run import RunWorkflow


@dataclass
class Request:
    kind: Literal["drain", "pause", "rollback"]
    node: str = ""
    reason: str = ""
    step: int = 0
    by: str = "operator"  # who asked: a person, or a detector acting on its own authority
    outcome: str | None = None  # set when the main loop has carried it out


async def carry_out(run: RunWorkflow, request: Request, gen: Generation) -> None:
    if request.kind == "rollback":
        await gen.cancel()
        request.outcome = rollback(run, request.step)
        return
    started = workflow.now()
    held_at = await hold(run, gen, f"drain {request.node}" if request.kind == "drain" else "pause")
    interruption = Interruption(
        at=started,
        generation=run.status.generation,
        detected_by=request.by,
        cause=Cause.DRAIN if request.kind == "drain" else Cause.PAUSE,
        node=request.node or None,
        step=held_at,
        restored_from="live",
        detail=request.reason,
        actions=[f"every rank held at step {held_at} with a checkpoint of it"],
        paging=PLANNED,
    )
    interruption.resumed_at(held_at)
    if request.kind == "drain":
        membership = await incidents.replace(run, interruption, request.node, f"drained: {request.reason}")
        await calls.command(run.run_id, request.node, run.next_command("exit"), "ranks leave the group")
        await calls.release(run.run_id, request.node)
        interruption.actions.append(f"resized to {len(membership.nodes)} nodes; survivors kept their processes")
    else:
        run.set_state(RunState.STOPPED, f"paused: {request.reason}")
        run.resumed = False
        await workflow.wait_condition(lambda: run.resumed)
        interruption.idle_seconds = (workflow.now() - started).total_seconds()
        membership = without_node(run.status.nodes, "", None, run.spec.ranks_per_node)
        interruption.actions.append("resumed by an operator")
    await gen.cancel()
    run.set_state(RunState.RESIZING if request.kind == "drain" else RunState.RESUMING)
    run.status.membership = membership
    run.record(interruption)
    request.outcome = f"held at step {held_at}; " + "; ".join(interruption.actions[1:])


async def hold(run: RunWorkflow, gen: Generation, why: str) -> int:
    """Drain and wait: every rank finishes the in-flight step, checkpoints it, and holds. Then the
    checkpoint of that step is judged before anything about the group changes."""
    run.set_state(RunState.DRAINING, why)
    await run.command("hold", f"{why}: finish the in-flight step, checkpoint it, hold")
    status = run.status
    held = await calls.hold(
        MonitorInput(
            run_id=run.run_id,
            generation=gen.number,
            world_size=status.world_size,
            endpoints=status.endpoints,
            after=status.telemetry_cursor,
        )
    )
    run.set_state(RunState.CHECKPOINTING, f"{why}: validating the checkpoint of step {held.step}")
    while gen.monitor is not None and not any(
        c.step == held.step and c.generation == gen.number for c in status.checkpoints
    ):
        await workflow.wait_condition(lambda: bool(run.verdicts))
        checkpoints.take_verdicts(run, gen)
    return held.step


def rollback(run: RunWorkflow, step: int) -> str:
    """Everything after `step` is abandoned; the next generation restarts from its checkpoint."""
    superseded = supersede(run.status.checkpoints, step)
    run.status.verified_step = min(run.status.verified_step, step)
    interruption = Interruption(
        at=workflow.now(),
        generation=run.status.generation,
        detected_by="operator",
        cause=Cause.ROLLBACK,
        step=run.status.progress.step,
        detail=f"resume_from step {step}",
        actions=[f"marked {len(superseded)} later checkpoints superseded"],
        paging=PLANNED,
    )
    interruption.resumed_at(step)  # also what a checkpoint judged only later is measured against
    run.record(interruption)
    if run.status.state == RunState.STOPPED:
        run.set_state(RunState.RESUMING)
    return f"rolling back to step {step}; {len(superseded)} later checkpoints superseded"


async def stopped(run: RunWorkflow) -> None:
    """Nobody trains. Wait for a person (resume, resume_from) or, with too few nodes, for a spare."""
    status, spec = run.status, run.spec
    began = workflow.now()
    delay = 5.0
    while status.state == RunState.STOPPED:
        short = len(status.nodes) < spec.min_nodes
        try:
            await workflow.wait_condition(
                lambda: (run.resumed and len(status.nodes) >= spec.min_nodes) or bool(run.requests),
                timeout=timedelta(seconds=delay) if short else None,
            )
        except TimeoutError:
            if spare := await calls.take_spare(run.run_id, run.spare_candidates()):
                status.nodes.append(spare)
                status.spares_used.append(spare)
                if (membership := status.membership) is not None:  # survivors are holding
                    membership.nodes = list(status.nodes)
                    membership.newcomers.append(spare)
            if len(status.nodes) >= spec.min_nodes:
                run.set_state(RunState.RESUMING)
            delay = min(delay * 2, 60.0)
            continue
        if run.requests:
            request = run.requests.pop(0)
            request.outcome = (
                rollback(run, request.step)
                if request.kind == "rollback"
                else f"the run is stopped ({status.failure}): resume it first"
            )
        else:
            run.resumed = False
            run.set_state(RunState.RESUMING)
    if status.interruptions:
        status.interruptions[-1].idle_seconds += (workflow.now() - began).total_seconds()
