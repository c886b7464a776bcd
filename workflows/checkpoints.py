"""What a run records of its checkpoints: the run monitor's verdicts as they arrive by signal, and,
before a restart, what the last generation left on storage that nobody judged. Workflow code: it
decides and calls activities, nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from temporalio import workflow

from workflows import calls
from workflows.generation import Generation

with workflow.unsafe.imports_passed_through():
    from activities.checkpoints import ChooseInput
    from core.events import CheckpointJudged
    from core.recovery import file_judged, mark_suspect, supersede
    from core.run import Cause, RunState

if TYPE_CHECKING:
    from workflows.run import RunWorkflow


def take_verdicts(run: RunWorkflow, gen: Generation) -> None:
    """Record the keeper's verdicts on this generation's checkpoints. One that arrives after its
    generation ended counts only for what retention deleted: the restart judged storage itself."""
    verdicts, run.verdicts = run.verdicts, []
    for judged in verdicts:
        if judged.generation == gen.number:
            _record(run, judged)
        else:
            _deleted(run, judged.deleted)


def _record(run: RunWorkflow, judged: CheckpointJudged) -> None:
    status = run.status
    _deleted(run, judged.deleted)
    if any(c.path == judged.checkpoint.path for c in status.checkpoints):
        return  # a monitor restarted from an older heartbeat judged it again
    status.checkpoint_cursor = judged.after
    status.verified_step = file_judged(status.checkpoints, status.verified_step, judged.checkpoint)
    status.progress.step = max(status.progress.step, judged.checkpoint.step)
    if status.state == RunState.CHECKPOINTING:
        run.set_state(RunState.RUNNING)
    run.list_progress()


def _deleted(run: RunWorkflow, paths: list[str]) -> None:
    for record in run.status.checkpoints:
        if record.path in paths:
            record.deleted = True


async def judge_leftovers(run: RunWorkflow) -> None:
    """Before choosing where to resume: validate what the last generation committed but nobody
    judged yet, and record writes that never committed."""
    status = run.status
    found = await calls.choose(
        ChooseInput(
            run_id=run.run_id,
            root=run.spec.checkpoint.root,
            directory=status.checkpoint_dir,
            generation=status.generation,
            known=[c.path.rstrip("/").rsplit("/", 1)[-1] for c in status.checkpoints],
            reference=status.latest_valid_checkpoint(),
        )
    )
    status.checkpoints.extend(found)
    for interruption in status.interruptions:
        earlier = [c for c in found if c.generation <= interruption.generation]
        if (check := interruption.sdc_check) is not None:  # what ranks halted by an SDC check left
            mark_suspect(earlier, interruption.generation, check.last_verified)
        if interruption.cause == Cause.ROLLBACK and interruption.resumed_from is not None:
            supersede(earlier, interruption.resumed_from)  # committed before the rollback, judged after
