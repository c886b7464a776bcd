"""Checkpoints a run can lean on: exact resume, corruption caught and never resumed from, restore from
a peer's host memory when storage is gone."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from temporalio.client import Client

from harness.tiny import REFERENCE_STEPS as TARGET
from harness.tiny import final_state
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Cause
from stayalive.training.checkpoint import dcp_file
from stayalive.workers.devstack import DevStack
from stayalive.workflows.run import RunWorkflow
from tests.helpers import assert_bitwise_equal, rank_pids, start, tiny_spec, wait_until


async def test_killed_three_times_ends_bitwise_identical(
    client: Client, checkpoint_root: Path, reference_run: dict[str, torch.Tensor]
) -> None:
    crashes = [
        {"kind": "crash", "rank": 1, "at_step": 13, "generation": 0},
        {"kind": "crash", "rank": 2, "at_step": 27, "generation": 1},
        {"kind": "crash", "rank": 0, "at_step": 44, "generation": 2},
    ]
    handle = await start(client, tiny_spec(checkpoint_root, target_step=TARGET, faults=crashes), "three-kills")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert [(i.cause, i.rank) for i in result.interruptions] == [(Cause.CRASH, 1), (Cause.CRASH, 2), (Cause.CRASH, 0)]
    checkpoints = await handle.query(RunWorkflow.checkpoints)
    # Each resume loads the newest valid checkpoint the crashed generation (or one before it) wrote.
    # That is 10, 20, 40 unless a loaded machine was still writing one when its rank was killed.
    newest = [
        max((c.step for c in checkpoints if c.validated and c.generation <= i.generation), default=0)
        for i in result.interruptions
    ]
    assert [i.resumed_from for i in result.interruptions] == newest
    assert all(step >= floor for step, floor in zip(newest, [0, 10, 30], strict=True))
    assert_bitwise_equal(final_state(checkpoints), reference_run)


DAMAGE = {
    "truncate_shard": "bytes, manifest says",
    "flip_byte": "does not match its SHA-256",
    "delete_shard": "is missing",
    "delete_manifest": "has no manifest.json",
    "edit_manifest": "edited after it was written",
}


@pytest.mark.parametrize("damage", DAMAGE)
async def test_a_damaged_checkpoint_is_caught_and_never_resumed_from(
    client: Client, checkpoint_root: Path, damage: str
) -> None:
    # Steps 20 and 30 are damaged once committed, and a rank dies at step 38. A save still waiting for
    # storage when the next one arrives never commits (training/flusher.py): on a loaded host step 20
    # (or 10) may be such a one, and step 30 may still be on its way at the crash. Whatever committed
    # after step 10 was damaged, so the run resumes from the newest checkpoint at or before 10.
    faults = [
        {"kind": "corrupt_checkpoint", "at_step": 20, "damage": damage, "shard": 2},
        {"kind": "corrupt_checkpoint", "at_step": 30, "damage": damage, "shard": 2},
        {"kind": "crash", "rank": 1, "at_step": 38},
    ]
    handle = await start(client, tiny_spec(checkpoint_root, target_step=40, faults=faults), f"damage-{damage}")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    first = [c for c in await handle.query(RunWorkflow.checkpoints) if c.generation == 0]
    (crash,) = result.interruptions
    assert crash.cause == Cause.CRASH
    assert crash.resumed_from == max((c.step for c in first if c.validated), default=0) <= 10, first
    damaged = [c for c in first if c.step in (20, 30) and not c.reason.startswith("never committed")]
    assert damaged, f"neither damaged checkpoint committed before the crash: {first}"
    assert all(c.validated is False and DAMAGE[damage] in c.reason for c in damaged), damaged


async def test_a_writer_killed_mid_write_leaves_nothing_to_resume_from(client: Client, checkpoint_root: Path) -> None:
    faults = [{"kind": "crash", "rank": 2, "at_step": 20, "during": "checkpoint_write"}]
    handle = await start(client, tiny_spec(checkpoint_root, target_step=40, faults=faults), "killed-writer")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert [(i.cause, i.rank, i.resumed_from) for i in result.interruptions] == [(Cause.CRASH, 2, 10)]
    checkpoints = await handle.query(RunWorkflow.checkpoints)
    torn = next(c for c in checkpoints if c.step == 20 and c.generation == 0)
    assert torn.validated is False and "never committed" in torn.reason
    assert not list(Path(torn.path).parent.glob(".step-*.tmp")), "the torn write was cleaned up"


async def test_replacement_restores_from_the_peer_copy_when_storage_is_gone(
    client: Client, stack: DevStack, checkpoint_root: Path, reference_run: dict[str, torch.Tensor]
) -> None:
    handle = await start(client, tiny_spec(checkpoint_root, target_step=TARGET), "peer-copy")
    status = await wait_until(handle, lambda s: any(c.validated and c.step >= 20 for c in s.checkpoints))
    os.kill((await rank_pids(client, handle))["n2"][3], signal.SIGKILL)
    # Before the replacement starts: every checkpoint on storage becomes unreadable, and the dead
    # rank's own host-memory copy goes too, so its shard can only come from its buddy's node (n1).
    run_dir = checkpoint_root / status.run_id
    for shard in run_dir.glob("step-*/*.distcp"):
        os.truncate(shard, 0)
    local = stack.memory_dir / "n2" / status.run_id
    lost = list(local.glob(f"step-*/{dcp_file(3)}"))
    assert lost, "rank 3's node held its own shard in memory"
    for shard in lost:
        shard.unlink()
    assert list((stack.memory_dir / "n1" / status.run_id).glob(f"step-*/{dcp_file(3)}"))

    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert [(i.cause, i.restored_from) for i in result.interruptions] == [(Cause.CRASH, "memory")]
    assert_bitwise_equal(final_state(await handle.query(RunWorkflow.checkpoints)), reference_run)
