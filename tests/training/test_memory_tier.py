"""The host-memory tier across two nodes: real ranks, two real node hubs, one store per generation.

A checkpoint's manifest says which node agents hold each shard in memory; a resume reads a shard
from there (its own node's copy, else its replica's) and from storage only when some shard is in
no node's memory, so it needs no storage at all when every shard and the manifest are in memory.
No rank is told every node's agent: each finds its replica's in the store."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import torch.distributed as dist

from stayalive.agent.hub import NodeHub
from stayalive.core.access import run_token
from stayalive.core.telemetry import Resumed
from stayalive.training.checkpoint import MANIFEST, read_manifest, shard_filename
from stayalive.training.memory import memory_path
from tests.helpers import ROOT

SECRET = b"test fleet secret, 32 bytes long"
RUN = "tier/0000abcd"
STEP = 10  # the one checkpoint of generation 0, and every generation's target: a resume only restores


async def launch(hubs: list[NodeHub], ckpt: Path, world_size: int, generation: int, resume: Path | None = None) -> None:
    """`world_size` ranks, node by node: ranks [i·W/N, (i+1)·W/N) talk to hubs[i] and keep its memory."""
    per_node = world_size // len(hubs)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # fresh per generation
    env = os.environ | {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(per_node),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "STAYALIVE_RUN_ID": RUN,
        "STAYALIVE_GENERATION": str(generation),
        "STAYALIVE_TARGET_STEP": str(STEP),
        "STAYALIVE_CHECKPOINT_DIR": str(ckpt),
        "STAYALIVE_RUN_TOKEN": run_token(SECRET, RUN),
        "STAYALIVE_CHECKPOINT_EVERY_STEPS": str(STEP),
    }
    if resume is not None:
        env["STAYALIVE_RESUME_FROM"] = str(resume)
    argv = [sys.executable, "-m", "stayalive.training.train", "--preset", "tiny", "--global-batch", "8"]
    ranks = []
    for rank in range(world_size):
        hub = hubs[rank // per_node]
        place = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % per_node),
            "STAYALIVE_AGENT": str(hub.endpoint),
            "STAYALIVE_MEMORY_DIR": str(hub.memory_dir),
        }
        ranks.append(await asyncio.create_subprocess_exec(*argv, env=env | place, cwd=ROOT))
    assert [await r.wait() for r in ranks] == [0] * world_size


def resumed_from(hubs: list[NodeHub], generation: int) -> list[str]:
    """Where each rank of `generation` says it read the checkpoint from, in rank order."""
    messages = [r.message for hub in hubs for r in hub.run(RUN).records if isinstance(r.message, Resumed)]
    return [m.source for m in sorted(messages, key=lambda m: m.rank) if m.generation == generation]


def in_memory(hub: NodeHub, checkpoint: Path, file: str) -> Path:
    return memory_path(hub.memory_dir, RUN, checkpoint.name, file)


async def test_shards_sit_where_the_manifest_says_and_a_resume_reads_them_from_the_replica_or_storage(
    tmp_path: Path,
) -> None:
    hubs = [NodeHub(node, "127.0.0.1", tmp_path / f"memory-{node}", SECRET) for node in ("n1", "n2")]
    for hub in hubs:
        await hub.start()
    agents = [str(hub.endpoint) for hub in hubs]
    ckpt = tmp_path / "ckpt"
    checkpoint = ckpt / f"step-{STEP:08d}-g0"
    try:
        await launch(hubs, ckpt, world_size=4, generation=0)

        # (1) Rank r writes on node r // 2; its replica goes to the node of rank (r − 2) mod 4, the other one.
        manifest = read_manifest(checkpoint)
        assert [shard.hubs for shard in manifest.shards] == [[agents[r // 2], agents[1 - r // 2]] for r in range(4)]
        assert all(in_memory(hub, checkpoint, shard.file).is_file() for hub in hubs for shard in manifest.shards)
        kept_on = [hub.node for hub in hubs if in_memory(hub, checkpoint, MANIFEST).is_file()]
        assert kept_on == ["n1", "n2"], "the manifest is kept on the committing node and its replica's"

        # (2) n1 loses its copy of shard 0. At world size 2 (one rank per node) rank 0 on n1 reads
        # shard 0: not in its own tier, so from n2, the replica's agent the manifest names.
        in_memory(hubs[0], checkpoint, shard_filename(0)).unlink()
        await launch(hubs, ckpt, world_size=2, generation=1, resume=checkpoint)
        assert resumed_from(hubs, generation=1) == ["memory"] * 2

        # (3) n2 loses the replica too: shard 0 is in no node's memory, so every rank reads storage.
        in_memory(hubs[1], checkpoint, shard_filename(0)).unlink()
        await launch(hubs, ckpt, world_size=4, generation=2, resume=checkpoint)
        assert resumed_from(hubs, generation=2) == ["storage"] * 4
    finally:
        for hub in hubs:
            hub.close()


async def test_while_storage_is_away_a_resume_reads_the_whole_checkpoint_from_memory(tmp_path: Path) -> None:
    hubs = [NodeHub(node, "127.0.0.1", tmp_path / f"memory-{node}", SECRET) for node in ("n1", "n2")]
    for hub in hubs:
        await hub.start()
    ckpt = tmp_path / "ckpt"
    checkpoint = ckpt / f"step-{STEP:08d}-g0"
    try:
        await launch(hubs, ckpt, world_size=4, generation=0)
        ckpt.rename(tmp_path / "away")  # storage unmounted: every path under it is gone
        # The manifest survives on one node only; the ranks of the other read it from there.
        in_memory(hubs[0], checkpoint, MANIFEST).unlink()

        await launch(hubs, ckpt, world_size=4, generation=1, resume=checkpoint)
        assert resumed_from(hubs, generation=1) == ["memory"] * 4
        assert not ckpt.exists(), "a rank that resumed never recreates the run's directory"
    finally:
        for hub in hubs:
            hub.close()
