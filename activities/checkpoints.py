"""Checkpoint activities on the supervisor: validate what ranks wrote, off the training path, and
delete what retention no longer needs.

`keep_checkpoints` is the run monitor's second loop (activities/monitor.py): for the whole generation
it waits for each committed checkpoint, validates it, deletes what retention drops, and signals the
verdict (one history event per checkpoint; the held step's goes with the generation's end).
`choose_checkpoint` runs before a restart, as a local
activity: it finds what the run left on storage that the workflow has not judged yet (a checkpoint
committed just before the crash, a write that never committed).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import structlog
from pydantic import BaseModel
from temporalio import activity

from stayalive.activities.reporting import Heartbeat, signal_run
from stayalive.activities.telemetry import NodeStreams
from stayalive.core.decisions.checkpoints import ChooseInput, TestLoad, norm_problem
from stayalive.core.decisions.fencing import fenced_out
from stayalive.core.decisions.recovery import file_judged
from stayalive.core.decisions.retention import to_delete
from stayalive.core.messages.events import CHECKPOINT_JUDGED, CheckpointJudged, KeeperInput, MonitorInput
from stayalive.core.protocol.telemetry import CheckpointCommitted, Subscribe
from stayalive.core.run.status import CheckpointRecord
from stayalive.training.checkpoint import (
    CheckpointError,
    parse_checkpoint_dirname,
    read_dcp_manifest,
    read_fence,
    within_root,
)

log = structlog.get_logger()

STORAGE_RETRY_S = 2.0  # while storage is away, a verdict is tried again this often


class Verdict(BaseModel):
    validated: bool
    reason: str
    param_norm: float | None = None


class _Loader:
    """The supervisor's test-load process (`python -m stayalive.training.validate`), started on first use and
    again whenever it dies; one checkpoint at a time."""

    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        # The answer of a load whose caller was cancelled (the keeper of a generation that ended): the
        # load goes on and its answer is dropped, and the next caller finds the process warm. Killing
        # it would make the restart that follows wait for a fresh one to import torch.
        self._abandoned: asyncio.Future[bytes] | None = None

    async def start(self) -> asyncio.subprocess.Process:
        """The test-load process, started if it is not running: the worker starts it with itself, so
        that the first checkpoint a run commits is not judged while torch is still being imported."""
        if self._process is None or self._process.returncode is not None:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "stayalive.training.validate",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
        return self._process

    async def test_load(self, directory: Path, heartbeat: Callable[[], None]) -> TestLoad:
        async with self._lock:
            if self._abandoned is not None:
                await asyncio.shield(self._abandoned)
                self._abandoned = None
            process = await self.start()
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(f"{directory}\n".encode())
            await process.stdin.drain()
            answer = asyncio.ensure_future(process.stdout.readline())
            try:
                while not answer.done():
                    heartbeat()
                    await asyncio.wait([answer], timeout=2.0)
            except asyncio.CancelledError:
                self._abandoned = answer
                raise
            line = answer.result()
            if not line:
                return TestLoad(ok=False, problems=[f"the test load crashed (exit {await process.wait()})"])
            return TestLoad.model_validate_json(line)


test_loader = _Loader()


async def validate(
    root: str,
    path: str,
    reference: CheckpointRecord | None,
    heartbeat: Callable[[], None],
    validation: list[str] | None = None,
) -> Verdict | None:
    """All shards present, digests match, a test load in another process, norms within the run's band,
    then the user's own check (`validation`, CheckpointSpec.validation), if any. None while storage is
    away (the run's directory is unreachable): no verdict, try again later. A checkpoint judged invalid
    because storage could not be read would never be resumed from."""
    try:
        directory = within_root(root, path)
    except CheckpointError as exc:
        return Verdict(validated=False, reason=str(exc))
    if (fenced := _fenced(directory)) is not None:
        return Verdict(validated=False, reason=fenced)
    result = await test_loader.test_load(directory, heartbeat)
    if not result.ok and not await asyncio.to_thread(directory.parent.is_dir):
        return None
    if not result.ok:
        return Verdict(validated=False, reason="; ".join(result.problems))
    history = [reference] if reference is not None else []
    if result.param_norm is not None and (problem := norm_problem(result.param_norm, history)):
        return Verdict(validated=False, reason=problem, param_norm=result.param_norm)
    if validation and (rejected := await users_check(validation, directory, heartbeat)) is not None:
        return Verdict(validated=False, reason=rejected, param_norm=result.param_norm)
    passed = "shards, digests, test load, norms" + (" and the run's own check" if validation else "") + " ok"
    return Verdict(validated=True, reason=passed, param_norm=result.param_norm)


async def users_check(argv: list[str], directory: Path, heartbeat: Callable[[], None]) -> str | None:
    """Run the spec's validation entry point on `directory`; None if it exits 0, else why it rejected."""
    command = [sys.executable, *argv[1:]] if argv[0] in ("python", "python3") else argv
    try:
        process = await asyncio.create_subprocess_exec(
            *command, str(directory), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        return f"the run's own check could not start ({exc}): fix checkpoint.validation"
    done = asyncio.ensure_future(process.communicate())
    while not done.done():
        heartbeat()
        await asyncio.wait([done], timeout=2.0)
    _, stderr = done.result()
    if process.returncode == 0:
        return None
    lines = stderr.decode(errors="replace").strip().splitlines()
    return f"the run's own check rejected it (exit {process.returncode}): {lines[-1] if lines else 'no reason given'}"


def _fenced(directory: Path) -> str | None:
    """Why a checkpoint is not the run's, if it was written by a generation the run had moved past."""
    try:
        _, generation = parse_checkpoint_dirname(directory.name)
    except ValueError:
        return None
    fence = read_fence(directory.parent)
    if not fenced_out(fence, generation):
        return None
    return f"fenced out: written by generation {generation} after generation {fence} was launched"


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


class Handover:
    """Where the keeper's verdicts go. By signal, one each, except the verdict on the checkpoint every
    rank holds at: that one travels with the end of the generation (AllHeld), which the monitor
    completes with, so a drain or a pause costs the history one event less."""

    def __init__(self) -> None:
        self.hold_step: int | None = None
        self.kept: dict[int, CheckpointJudged] = {}
        self.signalled: set[int] = set()
        self._changed = asyncio.Event()

    async def deliver(self, judged: CheckpointJudged) -> bool:
        """False when the workflow run is gone (continued as new, or ended)."""
        step = judged.checkpoint.step
        if step == self.hold_step:
            self.kept[step] = judged
        elif await signal_run(CHECKPOINT_JUDGED, judged):
            self.signalled.add(step)
        else:
            return False
        self._changed.set()
        return True

    async def held(self, step: int, timeout: float) -> CheckpointJudged | None:
        """Every rank holds at `step`: its verdict, once the keeper has it (None if the keeper already
        signalled it, or has none in `timeout` seconds: the workflow then judges storage)."""
        self.hold_step = step
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while step not in self.kept and step not in self.signalled:
                    self._changed.clear()
                    await self._changed.wait()
        return self.kept.get(step)


async def keep_checkpoints(
    input: MonitorInput, keeper: KeeperInput, hubs: dict[str, str], secret: bytes, beat: Heartbeat, handover: Handover
) -> None:
    """Judge each checkpoint the generation commits, delete what retention drops, hand over the
    verdict. Its place in each node's stream is kept by the node (reader `keep/g<generation>`), so a
    retried or re-attached keeper judges nothing twice. Returns only when the workflow run is gone."""
    shelved = beat.resumed.get("shelf")
    shelf = Shelf(keeper, [CheckpointRecord.model_validate(c) for c in shelved] if shelved else keeper.checkpoints)
    subscribe = Subscribe(
        run_id=input.run_id, reader=f"keep/g{input.generation}", generation=input.generation, only=["committed"]
    )
    async with NodeStreams(subscribe, hubs, secret) as streams:
        while True:
            record = await streams.next(timeout=1.0)
            if record is not None and isinstance(message := record.message, CheckpointCommitted):
                reference = shelf.reference()
                checkpoint = await judge(input.run_id, keeper.root, message, reference, beat, keeper.validation)
                deleted = await asyncio.to_thread(_delete, keeper.root, [c.path for c in shelf.add(checkpoint)])
                shelf.forget(deleted)
                if not await handover.deliver(
                    CheckpointJudged(generation=input.generation, checkpoint=checkpoint, deleted=deleted)
                ):
                    return
                beat(shelf=[c.model_dump(mode="json") for c in shelf.records])
                streams.ack({record.node: record.seq})


async def judge(
    run_id: str,
    root: str,
    message: CheckpointCommitted,
    reference: CheckpointRecord | None,
    beat: Heartbeat,
    validation: list[str],
) -> CheckpointRecord:
    """Validate a committed checkpoint, waiting as long as storage is away (the watch loop heartbeats)."""
    while (verdict := await validate(root, message.path, reference, beat, validation)) is None:
        log.warning("checkpoint storage unreachable: the verdict waits for it", run_id=run_id, step=message.step)
        await asyncio.sleep(STORAGE_RETRY_S)
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
        # A local activity: no heartbeat.
        verdict = await validate(input.root, str(entry), input.reference, lambda: None, input.validation)
        if verdict is not None:  # storage went away: a later restart judges it
            found.append(_record(entry, step, generation, verdict))
    return found


def _record(path: Path, step: int, generation: int, verdict: Verdict) -> CheckpointRecord:
    try:
        manifest = read_dcp_manifest(path)
        blocking, last_verified = manifest.blocking_s, manifest.last_verified_step
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
