"""Asynchronous checkpoints: a step blocks only while a rank copies its share into host memory.

step N ─ copy this rank's share into reused staging buffers      (blocking: the `C` of Young/Daly)
         └ writer thread: shard → host-memory tier (tmpfs)      (a crashed rank's replacement reads it)
                          shard → replica on the buddy's node   (the host may die too; seed R1)
           └ storage thread (training/flusher.py), retried while storage is away:
                          shard → storage, fsynced, digested    (under a temporary directory)
                          the last rank to finish writes the manifest and renames the directory
                          into place, so a checkpoint appears whole or not at all.

The next save waits only for the writer thread (the staging buffers are reused), never for storage:
while storage is away training goes on, checkpoints live in host memory, and the newest reaches
storage once it is back (seed 003 §8 rejects halting the job for it).

The manifest names, for every shard, the node agents whose tier holds it, so a restore asks those
and no others; the manifest itself goes to storage and to the tiers of the committing node and its
replica's.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from stayalive.training import memory
from stayalive.training.checkpoint import Manifest, ShardRecord, checkpoint_dirname, partition, shard_filename
from stayalive.training.commit import Committer, copy_durably
from stayalive.training.faults import FaultInjector
from stayalive.training.flusher import Flusher
from stayalive.training.memory import MemoryTier
from stayalive.training.state import TrainState, python_rng, rng_tensors

log = structlog.get_logger()


@dataclass(frozen=True)
class Identity:
    """What every manifest of this run says about where it came from."""

    run_id: str
    generation: int
    config_digest: str
    model: dict[str, int]
    global_batch: int


@dataclass(frozen=True)
class _Staged:
    """What this rank's part of a checkpoint says besides its tensors."""

    step: int
    tensors: int
    param_groups: list[dict[str, object]]
    python_rng: tuple[int, list[int], float | None]
    last_verified: int
    blocking_s: float


@dataclass
class _Landing:
    """One checkpoint on its way to storage (in host memory already), and how far its write got:
    each attempt resumes there, so a retry never counts a shard twice."""

    name: str
    staged: _Staged
    local: Path  # this rank's shard in host memory
    record: ShardRecord | None = None  # the shard is on storage
    counted: bool = False  # its record is in the store and counts towards the commit
    commits: bool = False  # this rank counted in last: it writes the manifest
    manifest: Manifest | None = None  # built once, so every attempt writes the same bytes

    @property
    def step(self) -> int:
        return self.staged.step


OnOutage = Callable[[int, float, OSError], None]  # (checkpoint step, since, error)


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
        on_outage: OnOutage = lambda step, since, error: None,
        durable: str | None = None,
    ) -> None:
        """`durable`: the newest checkpoint of the run known whole on storage (the one this generation
        resumed from), which host memory keeps while storage is away. None: the run has none yet, so
        its directory is created here, and only here: a writer that recreated a missing directory
        would write into the empty mount point of storage that went away."""
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.identity = identity
        self.tier = tier
        self.faults = faults
        self.on_commit = on_commit
        self.commit = Committer(directory, identity.run_id, identity.generation, store, tier, faults)
        self._durable = durable
        self._buffers: dict[str, torch.Tensor] = {}
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self.flusher: Flusher[_Landing] = Flusher(
            self._land, lambda landing, since, error: on_outage(landing.step, since, error)
        )
        if durable is None:
            directory.mkdir(parents=True, exist_ok=True)

    def save(self, state: TrainState) -> float:
        """Stage this rank's share of `state` and return the seconds the step was blocked."""
        started = time.perf_counter()
        self._in_memory()  # the staging buffers are reused: the previous checkpoint must be out of them
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
            tensors=len(mine),
            param_groups=state.param_groups(),
            python_rng=python_rng(),
            last_verified=state.last_verified,
            blocking_s=time.perf_counter() - started,
        )
        # The writer thread logs with this thread's run_id/node/rank/step context.
        self._writer = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._persist, staged, {n: self._buffers[n] for n in mine}),
            name="stayalive-checkpoint-writer",
        )
        self._writer.start()
        return staged.blocking_s

    def wait(self) -> None:
        """Until every checkpoint saved is on storage: however long storage is away."""
        self._in_memory()
        self.flusher.drain()

    def durable(self) -> str | None:
        """The newest checkpoint known whole on storage: this generation's newest commit (by any rank:
        the store says), else the one it started from."""
        self._durable = self.commit.durable() or self._durable
        return self._durable

    def _in_memory(self) -> None:
        """Until the last checkpoint saved is in host memory; raise what failed on the way there."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self.flusher.check()

    def _persist(self, staged: _Staged, tensors: dict[str, torch.Tensor]) -> None:
        try:
            name = checkpoint_dirname(staged.step, self.identity.generation)
            local = self._to_memory(name, shard_filename(self.rank), tensors)
        except BaseException as exc:  # surfaces on the training thread at the next save or wait
            log.error("checkpoint write failed", step=staged.step, error=str(exc))
            self._error = exc
            return
        self.flusher.submit(_Landing(name=name, staged=staged, local=local))

    def _to_memory(self, name: str, shard: str, tensors: dict[str, torch.Tensor]) -> Path:
        """Serialize into host memory (tmpfs) and send the replica; return the local file."""
        if self.tier is None:  # no tier: serialize next to storage instead
            path = self.commit.staging(name) / shard
        else:
            path = memory.memory_path(self.tier.directory, self.identity.run_id, name, shard)
        path.parent.mkdir(parents=self.tier is not None, exist_ok=True)
        save_file(tensors, str(path))
        if self.tier is not None:
            memory.prune(self.tier.directory, self.identity.run_id, also=[self.durable(), *self.flusher.in_flight()])
            if self.tier.replica_hub:
                memory.put(self.tier.replica_hub, self.tier.token, self.identity.run_id, name, path)
        return path

    def _land(self, landing: _Landing) -> None:
        """Storage's copy of `landing`, from where its last attempt stopped: this rank's shard, its
        count towards the commit, and (last to count in) the commit. Raises OSError while storage fails."""
        staged, tmp = landing.staged, self.directory / f".{landing.name}.tmp"
        if landing.record is None:
            tmp.mkdir(exist_ok=True)
            shard = shard_filename(self.rank)
            size, sha256 = copy_durably(
                landing.local,
                tmp / shard,
                opened=self.faults.writing_to_storage,
                halfway=lambda file: self.faults.checkpoint_writing(staged.step, self.directory, file),
            )
            landing.record = ShardRecord(
                file=shard,
                rank=self.rank,
                size=size,
                sha256=sha256,
                tensors=staged.tensors,
                python_rng=staged.python_rng,
                blocking_s=staged.blocking_s,
                hubs=[] if self.tier is None else self.tier.holders,
            )
        if not landing.counted:
            self.store.set(f"{landing.name}/shard/{self.rank}", landing.record.model_dump_json())
            landing.commits = self.store.add(f"{landing.name}/written", 1) == self.world_size
            landing.counted = True
        if landing.commits:
            self._commit(landing)

    def _commit(self, landing: _Landing) -> None:
        if landing.manifest is None:
            landing.manifest = self._manifest(landing.name, landing.staged)
        body = landing.manifest.model_dump_json(indent=1).encode()
        final = self.commit.commit(landing.name, landing.step, body)
        if final is not None:
            self.on_commit(landing.manifest, final)

    def _manifest(self, name: str, staged: _Staged) -> Manifest:
        shards = [
            ShardRecord.model_validate_json(self.store.get(f"{name}/shard/{rank}")) for rank in range(self.world_size)
        ]
        return Manifest(
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
