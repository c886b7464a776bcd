"""Builders for the run records the pure decisions read: a spec, a status, interruptions, checkpoints."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import CheckpointRecord, RunStatus
from stayalive.core.run.timeline import Cause, Interruption

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float = 0.0, *, minutes: float = 0.0, hours: float = 0.0) -> datetime:
    """T0 plus an offset: histories read as 'at 3 h 10 min', not as timestamps."""
    return T0 + timedelta(seconds=seconds, minutes=minutes, hours=hours)


def spec(**checkpoint: Any) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": "t",
            "world_size": 4,
            "ranks_per_node": 2,
            "nodes": ["n1", "n2"],
            "entrypoint": ["python", "train.py"],
            "target_step": 1000,
            "checkpoint": {"root": "/ckpt"} | checkpoint,
        }
    )


def status(**fields: Any) -> RunStatus:
    """A run started at T0 with an `auto` checkpoint interval, unless `spec` says otherwise."""
    fields.setdefault("spec", spec())
    fields.setdefault("started_at", T0)
    return RunStatus(**fields)


def interruption(
    when: datetime, cause: Cause = Cause.CRASH, node: str | None = "n1", step: int | None = None, **fields: Any
) -> Interruption:
    fields.setdefault("generation", 0)
    return Interruption(at=when, detected_by="test", cause=cause, node=node, step=step, **fields)


def checkpoint(
    written: datetime, blocking_seconds: float = 30.0, step: int = 0, validated: bool = True
) -> CheckpointRecord:
    return CheckpointRecord(
        step=step,
        path=f"/ckpt/step-{step}",
        generation=0,
        blocking_seconds=blocking_seconds,
        written_at=written,
        validated=validated,
    )
