"""Asynchronous checkpoints: a step blocks only while a rank copies its share into host memory.

step N ─ copy this rank's share into reused staging buffers      (blocking: the `C` of Young/Daly)
         └ writer thread: shard → host-memory tier (tmpfs)      (a crashed rank's replacement reads it)
                          shard → replica on the buddy's node   (the host may die too; seed R1)
                          shard → storage, fsynced, digested    (under a temporary directory)
                          the last rank to finish writes the manifest and renames the directory
                          into place, so a checkpoint appears whole or not at all.

The manifest names, for every shard, the node agents whose tier holds it, so a restore asks those
and no others; the manifest itself goes to storage and to the committing node's tier.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from training import memory
from training.checkpoint import (
    MANIFEST,
    Manifest,
    ShardRecord,
    checkpoint_dirname,
    fsync_dir,
    partition,
    shard_filename,
    write_atomically,
)
from training.faults import FaultInjector
from training.memory import MemoryTier
from training.state import TrainState, python_rng, rng_tensors

log = structlog.get_logger()


@dataclass(frozen=True)
class Identity:
    """What every manifest of this run says about where it came from."""

    run_id: str
    generation: int
    config_digest: str
    model: dict[str, int]
    global_batch: int


@dataclass
class _Staged:
    step: int
    tensors: dict[str, torch.Tensor]
    param_groups: list[dict[str, object]]
    python_rng: tuple[int, list[int], float | None]
    last_verified: int
    blocking_s: float = 0.0


class Checkpointer:
    def __init__(
        self,
        directory: Path,
        rank: int,
        world_size: int,
        store: dist.Store,
        identity: Identity,
        tier: MemoryTier | None,
        faults: FaultInjector,
        on_commit: Callable[[Manifest, Path], None],
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.identity = identity
        self.tier = tier
        self.faults = faults
        self.on_commit = on_commit
        self._buffers: dict[str, torch.Tensor] = {}
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: TrainState) -> float:
        """Stage this rank's share of `state` and return the seconds the step was blocked."""
        started = time.perf_counter()
        self.wait()  # one write in flight: the staging buffers are reused by the next checkpoint
        tensors = state.tensors()
        owner = partition({n: t.numel() * t.element_size() for n, t in tensors.items()}, self.world_size)
        mine = {n: t for n, t in tensors.items() if owner[n] == self.rank} | rng_tensors(self.rank)
        for name, tensor in mine.items():
            buffer = self._buffers.get(name)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = self._buffers[name] = torch.empty_like(tensor, device="cpu")
            buffer.copy_(tensor.detach())
        staged = _Staged(
            step=state.step,
            tensors={n: self._buffers[n] for n in mine},
            param_groups=state.param_groups(),
            python_rng=python_rng(),
            last_verified=state.last_verified,
        )
        staged.blocking_s = time.perf_counter() - started
        # The writer thread logs with this thread's run_id/node/rank/step context.
        self._writer = threading.Thread(
            target=contextvars.copy_context().run, args=(self._persist, staged), name="stayalive-checkpoint-writer"
        )
        self._writer.start()
        return staged.blocking_s

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _persist(self, staged: _Staged) -> None:
        try:
            name = checkpoint_dirname(staged.step, self.identity.generation)
            shard = shard_filename(self.rank)
            local = self._to_memory(name, shard, staged)
            tmp = self.directory / f".{name}.tmp"
            tmp.mkdir(parents=True, exist_ok=True)
            size, sha256 = _copy_durably(
                local, tmp / shard, halfway=lambda: self.faults.checkpoint_writing(staged.step)
            )
            record = ShardRecord(
                file=shard,
                rank=self.rank,
                size=size,
                sha256=sha256,
                tensors=len(staged.tensors),
                python_rng=staged.python_rng,
                blocking_s=staged.blocking_s,
                hubs=[] if self.tier is None else self.tier.holders,
            )
            self.store.set(f"{name}/shard/{self.rank}", record.model_dump_json())
            if self.store.add(f"{name}/written", 1) == self.world_size:
                self._commit(staged, name, tmp)
        except BaseException as exc:  # surfaces on the training thread at the next save or wait
            log.error("checkpoint write failed", step=staged.step, error=str(exc))
            self._error = exc

    def _to_memory(self, name: str, shard: str, staged: _Staged) -> Path:
        """Serialize into host memory (tmpfs) and send the replica; return the local file."""
        if self.tier is None:  # no tier: serialize next to storage instead
            path = self.directory / f".{name}.staging" / shard
        else:
            path = memory.memory_path(self.tier.directory, self.identity.run_id, name, shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(staged.tensors, str(path))
        if self.tier is not None:
            memory.prune(self.tier.directory, self.identity.run_id)
            if self.tier.replica_hub:
                memory.put(self.tier.replica_hub, self.tier.token, self.identity.run_id, name, path)
        return path

    def _commit(self, staged: _Staged, name: str, tmp: Path) -> None:
        shards = [
            ShardRecord.model_validate_json(self.store.get(f"{name}/shard/{rank}")) for rank in range(self.world_size)
        ]
        manifest = Manifest(
            run_id=self.identity.run_id,
            step=staged.step,
            generation=self.identity.generation,
            world_size=self.world_size,
            config_digest=self.identity.config_digest,
            created_at=time.time(),
            samples_consumed=staged.step * self.identity.global_batch,
            last_verified_step=staged.last_verified,
            model=self.identity.model,
            optimizer_param_groups=staged.param_groups,
            shards=shards,
        ).sealed()
        body = manifest.model_dump_json(indent=1).encode()
        write_atomically(tmp / MANIFEST, body)
        final = self.directory / name
        tmp.rename(final)
        # Injected damage lands the moment the checkpoint is committed: a rank stopped a little later
        # (the crash that follows in a test, on a loaded host) must not leave it whole.
        self.faults.checkpoint_committed(staged.step, final)
        fsync_dir(self.directory)
        if self.tier is not None:  # a restore on this node skips storage for it; other nodes read storage's
            write_atomically(memory.memory_path(self.tier.directory, self.identity.run_id, name, MANIFEST), body)
        else:
            shutil.rmtree(self.directory / f".{name}.staging", ignore_errors=True)
        log.info("checkpoint committed", path=str(final))
        self.on_commit(manifest, final)


def _copy_durably(source: Path, target: Path, halfway: Callable[[], None]) -> tuple[int, str]:
    """Copy to storage under a temporary name, digesting on the way; fsync; rename. Returns size, SHA-256."""
    digest = hashlib.sha256()
    tmp = target.with_name(f".{target.name}.tmp")
    total = source.stat().st_size
    size = 0
    crossed = False
    with open(source, "rb") as src, open(tmp, "wb") as dst:
        while chunk := src.read(min(1 << 22, max(1, total // 2))):
            digest.update(chunk)
            dst.write(chunk)
            size += len(chunk)
            if not crossed and size * 2 >= total:
                crossed = True
                halfway()
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, target)
    fsync_dir(target.parent)
    return size, digest.hexdigest()
