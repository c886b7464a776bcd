"""Checkpoint policy: which checkpoints may be trusted and which one a run resumes from."""

from __future__ import annotations

from pydantic import BaseModel

from stayalive.core.run.status import CheckpointRecord

# Parameters move slowly between two checkpoints; a jump past this factor is corruption that digests
# cannot see: digests confirm what was read is what was written, not that it was sane (docs/architecture.md §8).
NORM_BAND = 2.0


def norm_problem(norm: float, history: list[CheckpointRecord]) -> str | None:
    """Why `norm` is outside the band of the run's validated history, or None when it is inside."""
    earlier = [c for c in history if c.validated and c.param_norm is not None]
    if not earlier:
        return None
    previous = max(earlier, key=lambda c: c.step)
    assert previous.param_norm is not None
    ratio = norm / previous.param_norm if previous.param_norm else float("inf")
    if 1 / NORM_BAND <= ratio <= NORM_BAND:
        return None
    return (
        f"parameter norm {norm:.4g} is {ratio:.3g}× that of step {previous.step} ({previous.param_norm:.4g}), "
        f"outside the band ×{NORM_BAND:g}"
    )


class ChooseInput(BaseModel):
    run_id: str
    root: str
    directory: str  # the run's checkpoint directory
    generation: int  # the generation about to start
    known: list[str]  # names (step-…-g…) of the checkpoints the workflow has already judged
    reference: CheckpointRecord | None
    validation: list[str] = []  # CheckpointSpec.validation


class TestLoad(BaseModel):
    """The verdict of a checkpoint's test load, as its process (training/validate.py) answers it."""

    ok: bool
    problems: list[str] = []
    param_norm: float | None = None
    step: int | None = None
