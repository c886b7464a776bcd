"""Checkpoint activities on the supervisor: validate what ranks wrote, off the training path."""

from __future__ import annotations

import asyncio
import sys

import structlog
from pydantic import BaseModel
from temporalio import activity

from core.checkpoints import norm_problem
from core.run import CheckpointRecord
from training.checkpoint import CheckpointError, within_root
from training.validate import TestLoad

log = structlog.get_logger()


class ValidateCheckpoint(BaseModel):
    run_id: str
    root: str
    checkpoint: CheckpointRecord
    history: list[CheckpointRecord]


class Verdict(BaseModel):
    validated: bool
    reason: str
    param_norm: float | None = None


@activity.defn
async def validate_checkpoint(request: ValidateCheckpoint) -> Verdict:
    """All shards present, digests match, a test load in a fresh process, norms within the run's band."""
    step = request.checkpoint.step
    try:
        directory = within_root(request.root, request.checkpoint.path)
    except CheckpointError as exc:
        return Verdict(validated=False, reason=str(exc))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "training.validate", str(directory), stdout=asyncio.subprocess.PIPE
    )
    communicate = asyncio.ensure_future(process.communicate())
    try:
        while not communicate.done():
            activity.heartbeat(f"test-loading step {step}")
            await asyncio.wait([communicate], timeout=2.0)
    finally:
        if process.returncode is None:  # cancelled: do not leave a loader behind
            process.kill()
    out, _ = communicate.result()
    if process.returncode != 0:
        return Verdict(validated=False, reason=f"test load crashed (exit {process.returncode})")
    result = TestLoad.model_validate_json(out.splitlines()[-1])
    if not result.ok:
        verdict = Verdict(validated=False, reason="; ".join(result.problems))
    elif result.param_norm is not None and (problem := norm_problem(result.param_norm, request.history)):
        verdict = Verdict(validated=False, reason=problem, param_norm=result.param_norm)
    else:
        verdict = Verdict(
            validated=True, reason="shards, digests, test load and norms ok", param_norm=result.param_norm
        )
    log.info(
        "checkpoint validated",
        run_id=request.run_id,
        step=step,
        validated=verdict.validated,
        reason=verdict.reason,
    )
    return verdict
