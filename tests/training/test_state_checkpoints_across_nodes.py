"""Checkpoints across two nodes: real ranks of the built-in trainer (`python -m stayalive.training.train`,
through `stayalive.Run`), one per node, two real node hubs, one store per generation.

A checkpoint's manifest says which node agents hold each of its DCP files in memory; a resume gathers
every file in its node's tier (its own copy, else its replica's agent's) and reads storage only when
some file is in no node's memory, so it needs no storage at all when every file and the manifest are
in memory. No rank is told every node's agent: each finds its replica's in the store."""

from __future__ import annotations

import asyncio
import errno
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import pytest
import torch.distributed as dist

from stayalive.agent.hub import NodeHub
from stayalive.core.protocol.access import run_token
from stayalive.core.protocol.telemetry import CheckpointCommitted, Resumed, StorageUnavailable
from stayalive.core.run.faults import DiskFull, Fault
from stayalive.training import validate
from stayalive.training.checkpoint import DCP_METADATA, MANIFEST, checkpoint_dirname, dcp_file, read_dcp_manifest
from stayalive.training.memory import memory_path
from tests.helpers import ROOT

SECRET = b"test fleet secret, 32 bytes long"
RUN = "tier/0000abcd"
STEP = 10  # the one checkpoint of generation 0, and every generation's target: a resume only restores
OUTAGE_S = 1.5

M = TypeVar("M")


async def launch(
    hubs: list[NodeHub],
    ckpt: Path,
    generation: int,
    resume: Path | None = None,
    target: int = STEP,
    every: int = STEP,
    faults: dict[int, list[Fault]] | None = None,
) -> dist.Store:
    """One rank per node: rank i talks to hubs[i] and keeps its memory; `faults`: each rank's own.
    Returns the generation's store, where the ranks counted their files in."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # fresh per generation
    env = os.environ | {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(len(hubs)),
        "LOCAL_WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "STAYALIVE_RUN_ID": RUN,
        "STAYALIVE_GENERATION": str(generation),
        "STAYALIVE_TARGET_STEP": str(target),
        "STAYALIVE_CHECKPOINT_DIR": str(ckpt),
        "STAYALIVE_RUN_TOKEN": run_token(SECRET, RUN),
        "STAYALIVE_CHECKPOINT_EVERY_STEPS": str(every),
        "STAYALIVE_RESUME_FROM": str(resume or ""),
    }
    # 200 ms of simulated device time a step: each checkpoint reaches the storage thread before the next
    argv = [sys.executable, "-m", "stayalive.training.train", "--preset", "tiny", "--global-batch", "8"]
    argv += ["--device-ms", "200"] if every < STEP else []
    ranks = []
    for rank, hub in enumerate(hubs):
        own = {
            "RANK": str(rank),
            "STAYALIVE_AGENT": str(hub.endpoint),
            "STAYALIVE_MEMORY_DIR": str(hub.memory_dir),
            "STAYALIVE_FAULTS": "[" + ",".join(f.model_dump_json() for f in (faults or {}).get(rank, [])) + "]",
        }
        ranks.append(await asyncio.create_subprocess_exec(*argv, env=env | own, cwd=ROOT))
    assert [await r.wait() for r in ranks] == [0] * len(hubs)
    return dist.PrefixStore("stayalive/checkpoints", store)


def reports(hubs: list[NodeHub], kind: type[M]) -> list[M]:
    """Every message of `kind` the ranks sent their node's hub."""
    return [r.message for hub in hubs for r in hub.run(RUN).records if isinstance(r.message, kind)]


def resumed_from(hubs: list[NodeHub], generation: int) -> list[str]:
    """Where each rank of `generation` says it read the checkpoint from, in rank order."""
    messages = sorted(reports(hubs, Resumed), key=lambda m: m.rank)
    return [m.source for m in messages if m.generation == generation]


def in_memory(hub: NodeHub, checkpoint: Path, file: str) -> Path:
    return memory_path(hub.memory_dir, RUN, checkpoint.name, file)


@pytest.fixture
async def hubs(tmp_path: Path) -> AsyncIterator[list[NodeHub]]:
    """The hubs of two nodes, n1 and n2, each with its host-memory tier."""
    started = [NodeHub(node, "127.0.0.1", tmp_path / f"memory-{node}", SECRET) for node in ("n1", "n2")]
    for hub in started:
        await hub.start()
    yield started
    for hub in started:
        hub.close()


async def test_files_sit_where_the_manifest_says_and_a_resume_reads_them_from_the_replica_or_storage(
    tmp_path: Path, hubs: list[NodeHub]
) -> None:
    agents = [str(hub.endpoint) for hub in hubs]
    ckpt = tmp_path / "ckpt"
    checkpoint = ckpt / checkpoint_dirname(STEP, 0)
    await launch(hubs, ckpt, generation=0)

    # (1) Rank r writes on node r; its replica goes to the other node. Rank 0 writes DCP's metadata too.
    manifest = read_dcp_manifest(checkpoint)
    assert {(f.file, tuple(f.hubs)) for f in manifest.files()} == {
        (dcp_file(0), (agents[0], agents[1])),
        (DCP_METADATA, (agents[0], agents[1])),
        (dcp_file(1), (agents[1], agents[0])),
    }
    assert all(in_memory(hub, checkpoint, f.file).is_file() for hub in hubs for f in manifest.files())
    kept_on = [hub.node for hub in hubs if in_memory(hub, checkpoint, MANIFEST).is_file()]
    assert kept_on == ["n1", "n2"], "the manifest is kept on the committing node and its replica's"
    [committed] = reports(hubs, CheckpointCommitted)
    assert committed.blocking_s == manifest.blocking_s > 0, "the message carries the longest blocking time"

    # (2) n1 loses its copy of rank 0's file: rank 0 gathers it from n2, the replica's agent the
    # manifest names, and its node's tier has it again.
    in_memory(hubs[0], checkpoint, dcp_file(0)).unlink()
    await launch(hubs, ckpt, generation=1, resume=checkpoint)
    assert resumed_from(hubs, generation=1) == ["memory"] * 2
    assert in_memory(hubs[0], checkpoint, dcp_file(0)).is_file()

    # (3) Both nodes lose it: that file is in no node's memory, so every rank reads storage.
    for hub in hubs:
        in_memory(hub, checkpoint, dcp_file(0)).unlink()
    await launch(hubs, ckpt, generation=2, resume=checkpoint)
    assert resumed_from(hubs, generation=2) == ["storage"] * 2


async def test_while_storage_is_away_a_resume_reads_the_whole_checkpoint_from_memory(
    tmp_path: Path, hubs: list[NodeHub]
) -> None:
    ckpt = tmp_path / "ckpt"
    checkpoint = ckpt / checkpoint_dirname(STEP, 0)
    await launch(hubs, ckpt, generation=0)
    ckpt.rename(tmp_path / "away")  # storage unmounted: every path under it is gone
    # The manifest survives on one node only; the rank of the other reads it from there.
    in_memory(hubs[0], checkpoint, MANIFEST).unlink()

    await launch(hubs, ckpt, generation=1, resume=checkpoint)
    assert resumed_from(hubs, generation=1) == ["memory"] * 2
    assert not ckpt.exists(), "a rank that resumed never recreates the run's directory"


async def test_a_checkpoint_other_ranks_counted_in_is_superseded_whole_and_its_partial_write_removed(
    tmp_path: Path, hubs: list[NodeHub]
) -> None:
    """Rank 1's disk fills during step 2's write; rank 0's does not, so step 2 holds rank 0's files only.
    Step 3 supersedes it on rank 1, commits, and takes step 2's partial directory away with it."""
    ckpt = tmp_path / "ckpt"
    faults: dict[int, list[Fault]] = {1: [DiskFull(at_step=2, seconds=OUTAGE_S)]}
    store = await launch(hubs, ckpt, generation=0, target=3, every=1, faults=faults)
    step_2 = checkpoint_dirname(2, 0)
    assert store.check([f"{step_2}/rank/0"]) and not store.check([f"{step_2}/rank/1"]), "only rank 0 counted in"
    assert [m.step for m in reports(hubs, CheckpointCommitted)] == [1, 3]
    assert [(m.rank, m.step) for m in reports(hubs, StorageUnavailable)] == [(1, 2)]
    assert f"[Errno {errno.ENOSPC}]" in reports(hubs, StorageUnavailable)[0].error
    assert sorted(p.name for p in ckpt.iterdir()) == [checkpoint_dirname(1, 0), checkpoint_dirname(3, 0)]
    assert validate.test_load(ckpt / checkpoint_dirname(3, 0)).ok
