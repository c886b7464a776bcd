"""Asynchronous checkpoints: a step blocks only while a rank copies its share into host memory.

A background thread then serializes the share, writes it under a temporary directory, fsyncs,
and counts itself done in the run's store. The last rank to finish writes the manifest and
renames the directory into place, so a checkpoint appears whole or not at all.
"""

from __future__ import annotations

import contextvars
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from safetensors.torch import save

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
    blocking_s: float = 0.0


class Checkpointer:
    def __init__(
        self,
        directory: Path,
        rank: int,
        world_size: int,
        store: dist.Store,
        identity: Identity,
        on_commit: Callable[[Manifest, Path], None],
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.identity = identity
        self.on_commit = on_commit
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: TrainState) -> float:
        """Stage this rank's share of `state` and return the seconds the step was blocked."""
        started = time.perf_counter()
        self.wait()  # one write in flight at a time: a second would double host memory
        tensors = state.tensors()
        owner = partition({n: t.numel() * t.element_size() for n, t in tensors.items()}, self.world_size)
        staged = _Staged(
            step=state.step,
            tensors={n: t.detach().to("cpu", copy=True) for n, t in tensors.items() if owner[n] == self.rank}
            | {n: t.clone() for n, t in rng_tensors(self.rank).items()},
            param_groups=state.param_groups(),
            python_rng=python_rng(),
        )
        staged.blocking_s = time.perf_counter() - started
        # The writer thread logs with this thread's run_id/node/rank/step context.
        self._writer = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._persist, staged),
            name="stayalive-checkpoint-writer",
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
            tmp = self.directory / f".{name}.tmp"
            tmp.mkdir(parents=True, exist_ok=True)
            data = save(staged.tensors)
            write_atomically(tmp / shard_filename(self.rank), data)
            record = ShardRecord(
                file=shard_filename(self.rank),
                rank=self.rank,
                size=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                tensors=len(staged.tensors),
                python_rng=staged.python_rng,
                blocking_s=staged.blocking_s,
            )
            self.store.set(f"{name}/shard/{self.rank}", record.model_dump_json())
            if self.store.add(f"{name}/written", 1) == self.world_size:
                self._commit(staged, name, tmp)
        except BaseException as exc:  # surfaces on the training thread at the next save or wait
            log.error("checkpoint write failed", step=staged.step, error=str(exc))
            self._error = exc

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
            model=self.identity.model,
            optimizer_param_groups=staged.param_groups,
            shards=shards,
        ).sealed()
        write_atomically(tmp / MANIFEST, manifest.model_dump_json(indent=1).encode())
        final = self.directory / name
        tmp.rename(final)
        fsync_dir(self.directory)
        log.info("checkpoint committed", step=staged.step, path=str(final))
        self.on_commit(manifest, final)
