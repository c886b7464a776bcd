"""Which checkpoints to keep (docs/architecture.md §8): enough to roll back past the SDC detection window,
plus a milestone every six hours of the run, kept to the end."""

from __future__ import annotations

import math
from datetime import datetime

from stayalive.core.run.status import CheckpointRecord

MILESTONE_SECONDS = 6 * 3600.0


def keep_count(sdc_check_steps: float, checkpoint_steps: float) -> int:
    """retain ≥ 3 × (sdc_check_interval / checkpoint_interval) + 2: corruption can enter, be checkpointed
    until the next check detects it, and the rollback still finds a clean ancestor."""
    return math.ceil(3 * sdc_check_steps / max(checkpoint_steps, 1.0)) + 2


def to_delete(
    checkpoints: list[CheckpointRecord],
    started_at: datetime,
    sdc_check_steps: float,
    checkpoint_steps: float,
) -> list[CheckpointRecord]:
    """Checkpoints retention no longer needs: invalid and SDC-suspect ones, and valid ones past the
    newest `keep_count` that are neither milestones nor the newest verified one (the ancestor an SDC
    rollback needs, however far back the last passing check was). A checkpoint still being
    validated is never among them."""
    valid = sorted((c for c in checkpoints if c.validated and not c.suspect), key=lambda c: (c.step, c.generation))
    keep = {id(c) for c in valid[-keep_count(sdc_check_steps, checkpoint_steps) :]}
    keep |= {id(c) for c in [c for c in valid if c.verified][-1:]}
    windows: set[int] = set()
    for c in sorted((c for c in checkpoints if c.validated), key=lambda c: c.written_at):
        window = int((c.written_at - started_at).total_seconds() // MILESTONE_SECONDS)
        if window not in windows:  # the first valid checkpoint of each six-hour window
            windows.add(window)
            keep.add(id(c))
    return [c for c in checkpoints if c.validated is False or c.suspect or (c.validated and id(c) not in keep)]
