"""What a run learns of its checkpoints besides the keeper's verdicts (which RunBook files as they
arrive): what the last generation left on storage that nobody judged, before a restart; and, when
every rank has finished, the verdict on the final checkpoint, which decides whether the run is done.
And the checkpoint a person asks for.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

from stayalive.workflows import calls
from stayalive.workflows.inbox import Inbox

with workflow.unsafe.imports_passed_through():
    from stayalive.core.book.findings import CheckpointAsked, Finished, Interrupted, Judged
    from stayalive.core.book.runbook import RunBook
    from stayalive.core.decisions.checkpoints import ChooseInput
    from stayalive.core.messages.control import CommandRanks
    from stayalive.core.messages.events import RanksFinished
    from stayalive.core.run.timeline import Cause, Interruption

# Every rank has finished, so the final checkpoint is on storage; its verdict is one validation away.
FINAL_VERDICT_WITHIN = timedelta(minutes=2)


async def force(book: RunBook) -> None:
    """A person asked for a checkpoint (before maintenance, say): every rank takes one at the next
    step they agree on, and the run shows CHECKPOINTING until its verdict."""
    book.apply(CheckpointAsked())
    status = book.status
    command = CommandRanks(run_id=status.run_id, nodes=status.nodes, command=book.command("checkpoint"))
    await calls.command(command, "checkpoint at the next step all ranks agree on")


async def judge_leftovers(book: RunBook) -> None:
    """Before choosing where to resume: validate what the last generation committed but nobody
    judged yet, and record writes that never committed."""
    status = book.status
    found = await calls.choose(
        ChooseInput(
            run_id=status.run_id,
            root=book.spec.checkpoint.root,
            directory=status.checkpoint_dir,
            generation=status.generation,
            known=[c.path.rstrip("/").rsplit("/", 1)[-1] for c in status.checkpoints],
            reference=status.latest_valid_checkpoint(),
            validation=book.spec.checkpoint.validation,
        )
    )
    book.file_leftovers(found)


async def final_verdict(book: RunBook, inbox: Inbox, generation: int, keeper_gone: bool) -> bool:
    """Every rank exited cleanly: the keeper's verdict on the target step's checkpoint (a generation
    that resumed from that very checkpoint has nothing more to write). True once it is valid. A
    monitor that ended without it (`keeper_gone`), or a keeper that does not answer in time, leaves
    storage, not telemetry, as the record: judge it."""
    target = book.spec.target_step
    status = book.status

    def judged() -> bool:
        return any(c.step == target and (c.generation == generation or c.resumable) for c in status.checkpoints)

    while not judged():
        if keeper_gone or not await inbox.until(lambda: bool(inbox.verdicts), timeout=FINAL_VERDICT_WITHIN):
            workflow.logger.warning("no verdict on the final checkpoint from the keeper; judging storage")
            await judge_leftovers(book)
            break
        book.apply(Judged(inbox.take_verdicts()))
    return any(c.step == target and c.validated for c in status.checkpoints)


async def finished(
    book: RunBook, inbox: Inbox, ending: RanksFinished, generation: int, keeper_gone: bool
) -> Finished | Interrupted:
    """Every rank exited cleanly (or some did and the rest lingered: the release stops them). The run
    is done once the final checkpoint is judged valid; one that is not is an interruption, and the
    next generation writes it again."""
    target = book.spec.target_step
    if not book.spec.hooks or target is None:
        return Finished(None, workflow.now())  # a plain script: its clean exit is the end
    book.apply(Judged([ending.judged] if ending.judged is not None else []))
    if await final_verdict(book, inbox, generation, keeper_gone):
        return Finished(target, workflow.now())
    invalid = Interruption(
        at=workflow.now(),
        generation=book.status.generation,
        detected_by="final checkpoint validation",
        cause=Cause.CHECKPOINT_INVALID,
        step=target,
        detail=f"ranks finished but the checkpoint of step {target} is not valid",
    )
    return Interrupted(invalid)
