"""What a person (or, for a drain, the straggler ladder) asks a run to do: drain a node, pause, roll
back; and the stopped state, where nobody trains until a person or a free node lets the run go on.

Drain and pause share the first half of auto-cordon (docs/architecture.md §6): drain (no new work) → wait for
the in-flight step → checkpoint. Then a drain resizes (the group is rebuilt without the node) and a pause
waits for `resume`; both resume with the surviving processes, which kept their memory.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

from stayalive.workflows import calls, checkpoints, generation, incidents
from stayalive.workflows.generation import Ending, Generation
from stayalive.workflows.inbox import Inbox, Request

with workflow.unsafe.imports_passed_through():
    from stayalive.core.book.findings import (
        Draining,
        Failed,
        Held,
        HoldOver,
        Interrupted,
        Joined,
        Paused,
        Resumed,
        RolledBack,
    )
    from stayalive.core.book.runbook import RunBook
    from stayalive.core.decisions.goodput import recent_goodput
    from stayalive.core.decisions.interval import prior_mtbf
    from stayalive.core.messages.control import CommandRanks, ReleaseRanks
    from stayalive.core.messages.events import AllHeld
    from stayalive.core.run.launch import without_node
    from stayalive.core.run.lifecycle import RunState
    from stayalive.core.run.timeline import PLANNED, Cause, Interruption


async def hold_and_go_on(book: RunBook, inbox: Inbox, gen: Generation, request: Request) -> Ending | None:
    """Carry out a drain or a pause. Returns what ended the generation instead, if something did
    before every rank held (a failed rank, a lost node): the workflow handles that, and the request
    is answered with it."""
    started = workflow.now()
    why = f"drain {request.node}" if request.kind == "drain" else "pause"
    held = await hold(book, inbox, gen, why)
    if not isinstance(held, int):
        request.outcome = f"not carried out: the generation ended first ({held.kind})"  # type: ignore[union-attr]
        return held
    status = book.status
    interruption = Interruption(
        at=started,
        generation=status.generation,
        detected_by=request.by,
        cause=Cause.PAUSE if request.kind == "pause" else Cause.GPU_FAULT if request.gpu else Cause.DRAIN,
        node=request.node or None,
        step=held,
        restored_from="live",
        detail=request.gpu.detail() if request.gpu else request.reason,
        actions=[f"every rank held at step {held} with a checkpoint of it"],
        paging=None if request.gpu else PLANNED,
    )
    interruption.resumed_at(held)
    if request.kind == "drain":
        membership = await incidents.replace(book, interruption, request.node, f"drained: {request.reason}")
        release = ReleaseRanks(run_id=status.run_id, nodes=[request.node])
        await calls.release(release, f"{request.node}: its ranks leave the group; release the run there")
        interruption.actions.append(f"resized to {len(membership.nodes)} nodes; survivors kept their processes")
        note = f"drained {request.node}"
    else:
        book.apply(Paused(request.reason))
        inbox.resumed = False
        await inbox.until(lambda: inbox.resumed)
        interruption.idle_seconds = (workflow.now() - started).total_seconds()
        membership = without_node(status.nodes, None, None)
        interruption.actions.append("resumed by an operator")
        note = "resumed by an operator"
    # A failed GPU drained is a failure: the book classifies it; a drain or a pause was asked for.
    entry = (
        Failed(interruption, prior_mtbf(status), recent_goodput(status, workflow.now()))
        if request.gpu
        else Interrupted(interruption)
    )
    request.paged = book.apply(HoldOver(membership, note, entry)).page
    await gen.end()
    request.outcome = f"held at step {held}; " + "; ".join(interruption.actions[1:])
    return None


async def hold(book: RunBook, inbox: Inbox, gen: Generation, why: str) -> int | Ending:
    """Drain and wait: every rank finishes the in-flight step, checkpoints it, and holds. Then the
    checkpoint of that step is judged before anything about the group changes. Returns the held step,
    or what ended the generation first."""
    status = book.status
    book.apply(Draining(why))
    hold = CommandRanks(run_id=status.run_id, nodes=status.nodes, command=book.command("hold"))
    await calls.command(hold, f"{why}: finish the in-flight step, checkpoint it, hold")
    ended = await generation.supervise(book, inbox, gen, ends=lambda e: isinstance(e, AllHeld), take_requests=False)
    if not isinstance(ended, AllHeld):
        assert ended is not None
        return ended
    if book.apply(Held(ended.step, gen.number, ended.judged, why)).judge_held:
        await checkpoints.judge_leftovers(book)  # the monitor is done: storage has the held step's checkpoint
    return ended.step


def rollback(book: RunBook, request: Request) -> None:
    """Everything after the step is abandoned; the next generation restarts from its checkpoint."""
    superseded = book.apply(RolledBack(request.step, workflow.now())).said
    request.outcome = f"rolling back to step {request.step}; {superseded}"


async def stopped(book: RunBook, inbox: Inbox) -> None:
    """Nobody trains. Wait for a person (resume, resume_from) or, with too few nodes, for a spare."""
    status, spec = book.status, book.spec
    began = workflow.now()
    delay = 5.0
    while book.state == RunState.STOPPED:
        short = len(status.nodes) < spec.min_nodes
        woken = await inbox.until(
            lambda: inbox.resumed or bool(inbox.requests or inbox.partitions),
            timedelta(seconds=delay) if short else None,
        )
        incidents.file_partitions(book, inbox)
        if woken and not (inbox.resumed or inbox.requests):
            continue  # only a partition report: filed
        if short and not inbox.requests:
            # The timer, or a `resume` saying nodes may be back (a requeued Slurm job's agents are up
            # again): look for them now, and soon again after a wake.
            if woken:
                inbox.resumed, delay = False, 2.5
            if spare := await calls.take_spare(status.run_id, book.spare_candidates()):
                book.apply(Joined(spare))  # the run resumes once it has min_nodes
            delay = min(delay * 2, 60.0)
            continue
        if inbox.requests:
            request = inbox.requests.pop(0)
            if request.kind == "rollback":
                rollback(book, request)
            else:
                request.outcome = f"the run is stopped ({status.failure}): resume it first"
        else:
            inbox.resumed = False
            book.apply(Resumed("resumed by an operator"))
    book.idled((workflow.now() - began).total_seconds())
