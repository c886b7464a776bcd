"""Checkpoint activities on the supervisor: validate what ranks wrote, off the training path, and
delete what retention no longer needs.

`keep_checkpoints` is the run monitor's second loop (activities/monitor.py): for the whole generation
it waits for each committed checkpoint, validates it, deletes what retention drops, and signals the
verdict (one history event per checkpoint). `choose_checkpoint` runs before a restart, as a local
activity: it finds what the run left on storage that the workflow has not judged yet (a checkpoint
committed just before the crash, a write that never committed).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import structlog
from pydantic import BaseModel
from temporalio import activity

from activities.reporting import Heartbeat, signal_run
from activities.telemetry import records
from core.checkpoints import norm_problem
from core.events import CHECKPOINT_JUDGED, CheckpointJudged, KeeperInput, MonitorInput
from core.recovery import file_judged
from core.retention import to_delete
from core.run import CheckpointRecord
from core.telemetry import CheckpointCommitted
from training.checkpoint import CheckpointError, parse_checkpoint_dirname, read_manifest, within_root
from training.validate import TestLoad

log = structlog.get_logger()


class ChooseInput(BaseModel):
    run_id: str
    root: str
    directory: str  # the run's checkpoint directory
    generation: int  # the generation about to start
    known: list[str]  # names (step-…-g…) of the checkpoints the workflow has already judged
    reference: CheckpointRecord | None


class Verdict(BaseModel):
    validated: bool
    reason: str
    param_norm: float | None = None


class _Loader:
    """The supervisor's test-load process (`python -m training.validate`), started on first use and
    again whenever it dies; one checkpoint at a time."""

    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def test_load(self, directory: Path, heartbeat: Callable[[], None]) -> TestLoad:
        async with self._lock:
            if self._process is None or self._process.returncode is not None:
                self._process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "training.validate",
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                )
            process = self._process
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(f"{directory}\n".encode())
            await process.stdin.drain()
            answer = asyncio.ensure_future(process.stdout.readline())
            try:
                while not answer.done():
                    heartbeat()
                    await asyncio.wait([answer], timeout=2.0)
            except asyncio.CancelledError:
                process.kill()  # it is mid-load: a fresh one serves the next request
                raise
            line = answer.result()
            if not line:
                return TestLoad(ok=False, problems=[f"the test load crashed (exit {await process.wait()})"])
            return TestLoad.model_validate_json(line)


_loader = _Loader()


async def validate(root: str, path: str, reference: CheckpointRecord | None, heartbeat: Callable[[], None]) -> Verdict:
    """All shards present, digests match, a test load in another process, norms within the run's band."""
    try:
        directory = within_root(root, path)
    except CheckpointError as exc:
        return Verdict(validated=False, reason=str(exc))
    result = await _loader.test_load(directory, heartbeat)
    if not result.ok:
        return Verdict(validated=False, reason="; ".join(result.problems))
    history = [reference] if reference is not None else []
    if result.param_norm is not None and (problem := norm_problem(result.param_norm, history)):
        return Verdict(validated=False, reason=problem, param_norm=result.param_norm)
    return Verdict(validated=True, reason="shards, digests, test load and norms ok", param_norm=result.param_norm)


def _delete(root: str, paths: list[str]) -> list[str]:
    deleted = []
    for path in paths:
        try:
            shutil.rmtree(within_root(root, path))
        except FileNotFoundError:
            pass  # gone already (a torn write is removed when it is judged): deleted all the same
        except CheckpointError as exc:
            log.warning("retention could not delete", path=path, error=str(exc))
            continue
        deleted.append(path)
    return deleted


class Shelf:
    """The run's checkpoints as the keeper sees them: the records the workflow had when the generation
    started, and the keeper's own verdicts since. The workflow changes no record in between (a record
    turns suspect or superseded only when a generation ends), so retention over this list is what it
    would decide itself."""

    def __init__(self, keeper: KeeperInput, records: list[CheckpointRecord]) -> None:
        self.keeper = keeper
        self.records = records
        self.verified_step = keeper.verified_step

    def reference(self) -> CheckpointRecord | None:
        """The newest resumable checkpoint: the norm band's anchor."""
        return max((c for c in self.records if c.resumable), key=lambda c: c.step, default=None)

    def add(self, checkpoint: CheckpointRecord) -> list[CheckpointRecord]:
        """File a verdict; what retention drops now."""
        self.verified_step = file_judged(self.records, self.verified_step, checkpoint)
        keeper = self.keeper
        return to_delete(self.records, keeper.started_at, keeper.sdc_check_steps, keeper.checkpoint_steps)

    def forget(self, deleted: list[str]) -> None:
        self.records = [c for c in self.records if c.path not in deleted]


async def keep_checkpoints(input: MonitorInput, keeper: KeeperInput, beat: Heartbeat) -> None:
    """Judge each checkpoint the generation commits, delete what retention drops, signal the verdict.
    Returns only when the workflow run is gone."""
    after = {str(k): int(v) for k, v in beat.resumed.get("checkpoints_after", keeper.after).items()}
    shelved = beat.resumed.get("shelf")
    shelf = Shelf(keeper, [CheckpointRecord.model_validate(c) for c in shelved] if shelved else keeper.checkpoints)
    async for record in records(input.run_id, input.endpoints, after, only=["committed"]):
        if record is not None:
            message = record.message
            if isinstance(message, CheckpointCommitted) and message.generation == input.generation:
                checkpoint = await judge(input.run_id, keeper.root, message, shelf.reference(), beat)
                deleted = await asyncio.to_thread(_delete, keeper.root, [c.path for c in shelf.add(checkpoint)])
                shelf.forget(deleted)
                cursor = after | {record.node: record.seq}
                judged = CheckpointJudged(
                    generation=input.generation, checkpoint=checkpoint, after=cursor, deleted=deleted
                )
                if not await signal_run(CHECKPOINT_JUDGED, judged):
                    return
                beat(shelf=[c.model_dump(mode="json") for c in shelf.records])
            after[record.node] = record.seq
        beat(checkpoints_after=after)


async def judge(
    run_id: str, root: str, message: CheckpointCommitted, reference: CheckpointRecord | None, beat: Heartbeat
) -> CheckpointRecord:
    verdict = await validate(root, message.path, reference, beat)
    log.info("checkpoint judged", run_id=run_id, step=message.step, validated=verdict.validated)
    return CheckpointRecord(
        step=message.step,
        path=message.path,
        generation=message.generation,
        blocking_seconds=message.blocking_s,
        written_at=datetime.now(UTC),
        last_verified_step=message.last_verified_step,
        **verdict.model_dump(),
    )


@activity.defn
async def choose_checkpoint(input: ChooseInput) -> list[CheckpointRecord]:
    """Judge what the run left on storage that the workflow has not: checkpoints committed but never
    validated (validated now), and writes that never committed (recorded, then deleted)."""
    directory = within_root(input.root, input.directory)
    found: list[CheckpointRecord] = []
    if not directory.is_dir():
        return found
    for entry in sorted(directory.iterdir(), key=lambda p: p.name):
        name = entry.name.removeprefix(".").removesuffix(".tmp")
        if not name.startswith("step-") or name in input.known:
            continue
        step, generation = parse_checkpoint_dirname(name)
        if entry.name.endswith(".tmp"):
            if generation < input.generation:
                reason = "never committed: a writer died before every shard and the manifest were written"
                found.append(_record(entry, step, generation, Verdict(validated=False, reason=reason)))
                shutil.rmtree(entry, ignore_errors=True)
            continue
        verdict = await validate(input.root, str(entry), input.reference, heartbeat=lambda: None)  # a local activity
        found.append(_record(entry, step, generation, verdict))
    return found


def _record(path: Path, step: int, generation: int, verdict: Verdict) -> CheckpointRecord:
    try:
        manifest = read_manifest(path)
        blocking, last_verified = max(s.blocking_s for s in manifest.shards), manifest.last_verified_step
    except CheckpointError:
        blocking, last_verified = 0.0, 0
    return CheckpointRecord(
        step=step,
        path=str(path),
        generation=generation,
        blocking_seconds=blocking,
        last_verified_step=last_verified,
        written_at=datetime.fromtimestamp(path.stat().st_mtime, UTC) if path.exists() else datetime.now(UTC),
        **verdict.model_dump(),
    )
