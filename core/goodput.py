"""The goodput ledger: where the run's wall-clock went (seed 000: track the categories, not one number)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from core.run import RunStatus


class Ledger(BaseModel):
    wall: float
    startup: float
    checkpoint: float
    lost: float
    recovery: float
    idle: float = 0.0  # waiting for a person or for nodes

    @property
    def productive(self) -> float:
        return max(0.0, self.wall - self.startup - self.checkpoint - self.lost - self.recovery - self.idle)

    @property
    def goodput(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0


def ledger(status: RunStatus, now: datetime) -> Ledger:
    if status.started_at is None:
        return Ledger(wall=0.0, startup=0.0, checkpoint=0.0, lost=0.0, recovery=0.0)
    end = status.finished_at or now
    step_seconds = status.progress.step_seconds_p50
    return Ledger(
        wall=(end - status.started_at).total_seconds(),
        startup=(status.first_step_at - status.started_at).total_seconds() if status.first_step_at else 0.0,
        checkpoint=sum(c.blocking_seconds for c in status.checkpoints),
        lost=sum((i.lost_steps or 0) * step_seconds for i in status.interruptions),
        recovery=sum(i.restart_seconds or 0.0 for i in status.interruptions),
        idle=sum(i.idle_seconds for i in status.interruptions),
    )
