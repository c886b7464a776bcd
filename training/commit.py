"""How a checkpoint reaches storage, whatever its format: files copied under a temporary directory,
digested and fsynced; the last rank to count in writes the manifest and renames the directory into
place, so a checkpoint appears whole or not at all. Shared by the built-in trainer's checkpointer
(training/checkpointer.py) and the public API's (training/state_checkpointer.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import structlog
import torch.distributed as dist

from stayalive.core.decisions.fencing import fenced_out
from stayalive.training import memory
from stayalive.training.checkpoint import MANIFEST, fsync_dir, parse_checkpoint_dirname, read_fence, write_atomically
from stayalive.training.faults import FaultInjector
from stayalive.training.memory import MemoryTier

log = structlog.get_logger()

DURABLE = "durable"  # in the generation's store: the newest checkpoint committed whole on storage


def committed_key(name: str) -> str:
    """In the generation's store once checkpoint `name` is committed (by whichever rank counted in last)."""
    return f"{name}/committed"


def copy_durably(
    source: Path,
    target: Path,
    opened: Callable[[BinaryIO], None] = lambda _: None,
    halfway: Callable[[BinaryIO], None] = lambda _: None,
) -> tuple[int, str]:
    """Copy to storage under a temporary name, digesting on the way; fsync; rename. Returns size, SHA-256."""
    digest = hashlib.sha256()
    tmp = target.with_name(f".{target.name}.tmp")
    total = source.stat().st_size
    size = 0
    crossed = False
    with open(source, "rb") as src, open(tmp, "wb") as dst:
        opened(dst)
        while chunk := src.read(min(1 << 22, max(1, total // 2))):
            digest.update(chunk)
            dst.write(chunk)
            size += len(chunk)
            if not crossed and size * 2 >= total:
                crossed = True
                halfway(dst)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, target)
    fsync_dir(target.parent)
    return size, digest.hexdigest()


@dataclass(frozen=True)
class Committer:
    """The commit of one generation's checkpoints into the run's directory on storage."""

    directory: Path
    run_id: str
    generation: int
    store: dist.Store
    tier: MemoryTier | None
    faults: FaultInjector

    def durable(self) -> str | None:
        """The newest checkpoint this generation committed whole on storage (by any rank), if any."""
        return self.store.get(DURABLE).decode() if self.store.check([DURABLE]) else None

    def staging(self, name: str) -> Path:
        """Where a rank without a host-memory tier serializes its share, next to storage."""
        return self.directory / f".{name}.staging"

    def commit(self, name: str, step: int, manifest: bytes) -> Path | None:
        """Write the manifest into the checkpoint's temporary directory and rename it into place; the
        committed directory, or None when the run has moved past this generation (fenced out)."""
        tmp, final = self.directory / f".{name}.tmp", self.directory / name
        if fenced_out(fence := read_fence(self.directory), self.generation):
            # The run launched a newer generation without this one (a node cut off and back): its
            # checkpoint is not the run's. Nothing is committed or announced.
            log.error("checkpoint fenced out", checkpoint=name, generation=self.generation, fence=fence)
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(self.staging(name), ignore_errors=True)
            return None
        if not final.is_dir():  # an attempt that failed after the rename has nothing left to rename
            write_atomically(tmp / MANIFEST, manifest, opened=self.faults.writing_to_storage)
            tmp.rename(final)
            # Injected damage lands the moment the checkpoint is committed: a rank stopped a little later
            # (the crash that follows in a test, on a loaded host) must not leave it whole.
            self.faults.checkpoint_committed(step, final)
        fsync_dir(self.directory)
        if self.tier is not None:  # a restore anywhere reads it from memory (training/state_restore.py)
            self._keep_manifest(name, manifest)
        else:
            shutil.rmtree(self.staging(name), ignore_errors=True)
        self._drop_superseded(step)
        self.store.set(DURABLE, name)
        self.store.set(committed_key(name), name)
        log.info("checkpoint committed", path=str(final))
        return final

    def _keep_manifest(self, name: str, body: bytes) -> None:
        """Copies of the committed manifest in this node's tier and its replica's. Copies, not the
        commit: storage has it. A node's ranks prune its tier after each save of theirs, and with a
        checkpoint every step one may prune this checkpoint's directory while its manifest lands."""
        assert self.tier is not None
        kept = memory.memory_path(self.tier.directory, self.run_id, name, MANIFEST)
        try:
            write_atomically(kept, body)
            if self.tier.replica_hub:
                memory.put(self.tier.replica_hub, self.tier.token, self.run_id, name, kept)
        except OSError as exc:
            log.warning("manifest not kept in memory", checkpoint=name, error=str(exc))

    def _drop_superseded(self, step: int) -> None:
        """The partial writes of this generation's earlier checkpoints that an outage superseded: every
        rank counted into this one, and each writes its checkpoints in order, so none will finish them."""
        for partial in self.directory.glob(f".step-*-g{self.generation}.tmp"):
            earlier, _ = parse_checkpoint_dirname(partial.name.removeprefix(".").removesuffix(".tmp"))
            if earlier < step:
                log.info("superseded checkpoint write removed", path=str(partial))
                shutil.rmtree(partial, ignore_errors=True)
