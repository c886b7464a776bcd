"""Asynchronous checkpoints of any state dict, through `torch.distributed.checkpoint` (DCP).

step N ─ snapshot: the state dicts made, what is not a tensor of the model's or optimizer's copied
         └ staging thread (training/staging.py): their tensors copied into CPU buffers kept from
           save to save (two sets, in turn: the last save's write may still read the other), while
           the loop goes on into step N+1's forward and backward; its update waits
           for the copy first (`staged()`: the optimizer's step pre-hook), as DCP's async staging and
           torchtitan's zero-overhead checkpoints do. Blocking (Young/Daly's `C`) = the snapshot + that wait.
           └ writer thread: dcp.save → this node's host-memory tier      (DCP's files, its plan)
                            each file → the replica's node               (a node lost keeps a copy)
             └ storage thread (training/flusher.py), retried while storage is away:
                            each file → storage, fsynced, digested, then the commit (training/commit.py)

A loop without an optimizer under the API has no update to wait at: its save waits for the copy.
DCP brings FSDP2's DTensors and loading at another world size; the manifest (training/checkpoint.py)
brings digests, the atomic commit and the memory tier's addresses. Every loop under stayalive, the
built-in trainer's too, checkpoints this way (training/run.py).
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from stayalive.training import hub_names, memory
from stayalive.training.checkpoint import DCP_METADATA, DcpManifest, FileRecord, RankRecord, checkpoint_dirname
from stayalive.training.commit import Committer, committed_key, copy_durably
from stayalive.training.dcp_load import load_dcp_metadata, tensor_entries
from stayalive.training.faults import FaultInjector
from stayalive.training.flusher import Flusher
from stayalive.training.memory import MemoryTier
from stayalive.training.staging import Stager
from stayalive.training.supervision import SupervisionConfig

log = structlog.get_logger()


@dataclass
class _Blocking:
    """How long a save held the loop up: its snapshot, then its update's wait for the copy (added by
    the training thread as soon as the copy is done, well before the writer reads it)."""

    seconds: float


@dataclass
class _Landing:
    """One checkpoint on its way to storage (in host memory already), and how far its write got."""

    name: str
    step: int
    last_verified: int
    blocking: _Blocking
    local: Path  # the directory that holds this rank's files in host memory
    files: list[str]
    record: RankRecord | None = None  # this rank's files are on storage
    counted: bool = False  # its record is in the store and counts towards the commit
    commits: bool = False  # this rank counted in last: it writes the manifest
    manifest: DcpManifest | None = None  # built once, so every attempt writes the same bytes


class StateCheckpointer:
    def __init__(
        self,
        committer: Committer,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup,
        config_digest: str,
        on_commit: Callable[[DcpManifest, Path], None],
        on_outage: Callable[[int, float, OSError], None],
        durable: str | None,
        overlap: bool = False,
    ) -> None:
        """`group`: a gloo group of every rank, for DCP's planning on the writer thread (never the
        training loop's group, whose collectives the writer would interleave with). `durable`: as
        for training/checkpointer.py, the newest checkpoint known whole on storage. `overlap`: the
        loop calls `staged()` before the state's tensors change, so a save need not wait for the copy."""
        self.commit = committer
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.config_digest = config_digest
        self.on_commit = on_commit
        self._durable = durable
        self._stager = Stager(gpu=torch.cuda.is_available())
        self.overlap = overlap
        self._staging: Future[dict[str, Any]] | None = None
        self._blocking = _Blocking(0.0)
        self._writer: threading.Thread | None = None  # the last save's write
        self._earlier: threading.Thread | None = None  # the write before it: the next save copies into its buffers
        self._error: BaseException | None = None
        self.flusher: Flusher[_Landing] = Flusher(
            self._land, lambda landing, since, error: on_outage(landing.step, since, error)
        )
        if durable is None:
            committer.directory.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, state_of: Callable[[], dict[str, Any]], last_verified: int = 0) -> float:
        """Stage the state `state_of()` gives (every rank calls this at the same step) and return the
        seconds it blocked: the state dict's making counts too, as Young/Daly's `C` must."""
        started = time.perf_counter()
        self._reusable()
        staging = self._stager.stage(state_of())
        if not self.overlap:  # no update of the loop's will wait for the copy: this save does
            staging.exception()  # a failed copy surfaces with the writer's error, as in staged()
        self._staging = staging if self.overlap else None
        self._blocking = _Blocking(time.perf_counter() - started)
        writer = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._persist, step, last_verified, self._blocking, staging, self._writer),
            name="stayalive-checkpoint-writer",
        )
        self._earlier, self._writer = self._writer, writer
        writer.start()
        return self._blocking.seconds

    def staged(self) -> None:
        """Before the saved tensors change (the loop's next update): wait until they are copied."""
        if self._staging is None:
            return
        started = time.perf_counter()
        staging, self._staging = self._staging, None
        staging.exception()  # a failed copy surfaces with the writer's error, at the next save or wait
        self._blocking.seconds += time.perf_counter() - started

    @property
    def blocking_s(self) -> float:
        """The seconds the last save held the loop up (final once its update began)."""
        return self._blocking.seconds

    def wait(self) -> None:
        """Until every checkpoint saved is on storage: however long storage is away."""
        self._in_memory()
        self.flusher.drain()

    def wait_committed(self, step: int) -> str:
        """Until every rank's share of the checkpoint of `step` is on storage and one rank committed it
        (this rank's wait() covers only its own share); its name."""
        self.wait()
        name = checkpoint_dirname(step, self.commit.generation)
        self.commit.store.wait([committed_key(name)])
        return name

    def durable(self) -> str | None:
        self._durable = self.commit.durable() or self._durable
        return self._durable

    def _reusable(self) -> None:
        """Before a save stages: the last save's copy is done, and the write two saves back, whose
        buffers this save copies into, is over (the last save's write may go on). A failed write raises."""
        self.staged()
        if self._earlier is not None:
            self._earlier.join()
            self._earlier = None
        self._raise_failed()

    def _in_memory(self) -> None:
        self.staged()
        if self._writer is not None:
            self._writer.join()  # each write first waits for the one before it
            self._writer = self._earlier = None
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self.flusher.check()

    def _persist(
        self,
        step: int,
        last_verified: int,
        blocking: _Blocking,
        staging: Future[dict[str, Any]],
        after: threading.Thread | None,
    ) -> None:
        if after is not None:
            after.join()  # one write at a time: DCP plans over one group, and the flusher lands them in order
        name = checkpoint_dirname(step, self.commit.generation)
        tier = self.commit.tier
        local = self.commit.staging(name) if tier is None else tier.directory / self.commit.run_id / name
        try:
            staged = staging.result()
            local.mkdir(parents=True, exist_ok=True)
            writer = dcp.FileSystemWriter(local, sync_files=False)
            dcp.save(staged, storage_writer=writer, planner=self._planner(), process_group=self.group)
            files = sorted(p.name for p in local.glob(f"__{self.rank}_*.distcp"))
            if self.rank == 0:
                files.append(DCP_METADATA)
            if tier is not None:
                memory.prune(tier.directory, self.commit.run_id, also=[self.durable(), *self.flusher.in_flight()])
                if tier.replica_hub:
                    for file in files:
                        memory.put(tier.replica_hub, tier.token, self.commit.run_id, name, local / file)
        except BaseException as exc:  # surfaces on the training thread at the next save or wait
            log.error("checkpoint write failed", step=step, error=str(exc))
            self._error = exc
            return
        self.flusher.submit(_Landing(name, step, last_verified, blocking, local, files))

    def _planner(self) -> dcp.DefaultSavePlanner:
        """DCP's planner, planning once per generation: every save of a generation holds the same tensors
        on the same group, so after the first its ranks send DCP's coordinator no plan to unpickle and
        check again. The cache is DCP's, class-wide and keyed by name: a generation's key keeps a new
        group (another world size, after a drain) from reusing the last one's plans."""
        planner = dcp.DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = f"{self.commit.run_id}/{self.commit.generation}"  # the class name by default
        return planner

    def _land(self, landing: _Landing) -> None:
        """Storage's copy of `landing`, from where its last attempt stopped. Raises OSError while storage fails."""
        tmp = self.commit.directory / f".{landing.name}.tmp"
        faults = self.commit.faults
        if landing.record is None:
            tmp.mkdir(exist_ok=True)
            records = []
            for file in landing.files:
                size, sha256 = copy_durably(
                    landing.local / file,
                    tmp / file,
                    opened=faults.writing_to_storage,
                    halfway=lambda f: faults.checkpoint_writing(landing.step, self.commit.directory, f),
                )
                hubs = [] if self.commit.tier is None else self.commit.tier.holders
                records.append(FileRecord(file=file, rank=self.rank, size=size, sha256=sha256, hubs=hubs))
            landing.record = RankRecord(rank=self.rank, files=records, blocking_s=landing.blocking.seconds)
        store = self.commit.store
        if not landing.counted:
            store.set(f"{landing.name}/rank/{self.rank}", landing.record.model_dump_json())
            landing.commits = store.add(f"{landing.name}/written", 1) == self.world_size
            landing.counted = True
        if landing.commits:
            if landing.manifest is None:
                landing.manifest = self._manifest(landing, tmp)
            final = self.commit.commit(landing.name, landing.step, landing.manifest.model_dump_json(indent=1).encode())
            if final is not None:
                self.on_commit(landing.manifest, final)

    def _manifest(self, landing: _Landing, tmp: Path) -> DcpManifest:
        ranks = [
            RankRecord.model_validate_json(self.commit.store.get(f"{landing.name}/rank/{rank}"))
            for rank in range(self.world_size)
        ]
        return DcpManifest(
            run_id=self.commit.run_id,
            step=landing.step,
            generation=self.commit.generation,
            world_size=self.world_size,
            config_digest=self.config_digest,
            created_at=time.time(),
            last_verified_step=landing.last_verified,
            tensors=tensor_entries(load_dcp_metadata((tmp / DCP_METADATA).read_bytes())),
            ranks=ranks,
        ).sealed()


def open_checkpoints(
    config: SupervisionConfig,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup,
    faults: FaultInjector,
    *,
    durable: str | None,
    on_commit: Callable[[DcpManifest, Path], None],
    on_outage: Callable[[int, float, OSError], None],
    overlap: bool,
) -> tuple[StateCheckpointer, MemoryTier | None]:
    """A generation's checkpoints, as a rank launched by stayalive saves them: committed through the
    generation's store, kept in its node's host-memory tier (whose agent each node's first rank
    publishes there, for the ranks whose replicas it holds). `overlap`: as for StateCheckpointer."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if config.agent is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        hub_names.publish_hub(store, rank // ranks_per_node, config.agent)
    tier = config.memory_tier(store, rank, world_size, ranks_per_node)
    prefixed = dist.PrefixStore("stayalive/checkpoints", store)
    committer = Committer(config.checkpoint_dir, config.run_id, config.generation, prefixed, tier, faults)
    checkpointer = StateCheckpointer(
        committer, rank, world_size, group, config.config_digest, on_commit, on_outage, durable, overlap
    )
    return checkpointer, tier
