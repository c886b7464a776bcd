"""Silent data corruption: a GPU that computes wrong numbers without an error. The run must notice,
name the rank and its node, never resume from state computed after the last passing check, and end
where a clean run ends."""

from __future__ import annotations

from pathlib import Path

import torch
from temporalio.client import Client

from harness.tiny import REFERENCE_STEPS, TINY_ENTRYPOINT, checkpoint_state, final_state
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Cause
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import RunWorkflow
from tests.helpers import assert_bitwise_equal, start, tiny_spec


async def test_a_transient_bit_flip_rolls_back_to_the_verified_ancestor_and_ends_bitwise_clean(
    client: Client, checkpoint_root: Path, reference_run: dict[str, torch.Tensor]
) -> None:
    # Self-checks every 10 steps, checkpoints every 5: the check at step 20 (rank 2) passes; at step
    # 30 it is rank 3's turn to replay, and rank 3's gradient had a bit flipped.
    spec = tiny_spec(
        checkpoint_root,
        target_step=REFERENCE_STEPS,
        checkpoint={"root": str(checkpoint_root), "interval": "5 steps"},
        sdc={"self_check_every": 10},
        faults=[{"kind": "bitflip", "rank": 3, "at_step": 30}],
    )
    handle = await start(client, spec, "bitflip")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    (sdc,) = result.interruptions
    assert (sdc.cause, sdc.rank, sdc.node) == (Cause.SDC, 3, "n2"), "the rank and its node are named"
    assert sdc.detected_by == "bitwise self-check replay"
    assert sdc.sdc_check is not None and sdc.sdc_check.last_verified == 20 and sdc.sdc_check.step == 30
    assert sdc.resumed_from == 20, "back to the newest checkpoint at or before the last passing check"

    records = await handle.query(RunWorkflow.checkpoints)
    first = {c.step: c for c in records if c.generation == 0}
    assert first[25].suspect, "written after the last passing check"
    # Step 20 was resumed from; retention may have deleted it since (it keeps the newest verified).
    assert all(c.verified and not c.suspect for c in first.values() if c.step <= 20)
    assert "n2" not in (await handle.query(RunWorkflow.status_query)).nodes
    quarantines = await fleet_handle(client).query(FleetWorkflow.quarantines)
    assert any(
        q.node == "n2" and q.reason.startswith("SDC") and result.run_id in q.run_ids_affected for q in quarantines
    )
    assert_bitwise_equal(final_state(records), reference_run)


async def test_a_flipped_weight_splits_one_replica_from_the_others_and_the_replica_check_names_it(
    client: Client, checkpoint_root: Path, reference_run: dict[str, torch.Tensor]
) -> None:
    # Rank 2's weights take a bit flip at step 13, after its gradient all-reduce: every replay of
    # its own is consistent, but at step 20 its fingerprint is not the other three ranks'.
    spec = tiny_spec(
        checkpoint_root,
        target_step=REFERENCE_STEPS,
        checkpoint={"root": str(checkpoint_root), "interval": "5 steps"},
        sdc={"self_check_every": 10},
        faults=[{"kind": "weightflip", "rank": 2, "at_step": 13}],
    )
    handle = await start(client, spec, "weightflip")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    (sdc,) = result.interruptions
    assert (sdc.cause, sdc.rank, sdc.node) == (Cause.SDC, 2, "n2")
    assert sdc.detected_by == "cross-rank check of data-parallel replicas"
    assert sdc.sdc_check is not None and (sdc.sdc_check.step, sdc.sdc_check.last_verified) == (20, 10)
    assert sdc.resumed_from == 10
    records = await handle.query(RunWorkflow.checkpoints)
    assert {c.step for c in records if c.generation == 0 and c.suspect} >= {15}
    assert_bitwise_equal(final_state(records), reference_run)


async def test_a_deterministically_wrong_rank_passes_its_self_checks_and_fails_the_cross_check(
    client: Client, checkpoint_root: Path
) -> None:
    # Rank 1 replays its own micro-batch at step 5 and gets the same wrong answer: the self-check
    # passes. At step 20 ranks 1 and 3 compute rank 1's micro-batch and disagree; rank 2 sides with 3.
    spec = tiny_spec(
        checkpoint_root,
        target_step=30,
        sdc={"self_check_every": 5, "cross_check_every": 20},
        faults=[{"kind": "wrong", "rank": 1, "epsilon": 1e-3}],
    )
    handle = await start(client, spec, "wrong-rank")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    (sdc,) = result.interruptions
    assert (sdc.cause, sdc.rank, sdc.node, sdc.step) == (Cause.SDC, 1, "n1", 19)
    assert sdc.detected_by == "cross-rank check"
    check = sdc.sdc_check
    assert check is not None and check.method == "cross" and check.culprit == 1
    assert check.difference is not None and check.tolerance is not None
    assert check.difference > check.tolerance > 0, "the measured difference and the tolerance it broke"
    assert "spread" in check.detail, "how the tolerance was derived"
    assert check.last_verified == 15, "the self-checks before it passed"
    assert "n1" not in (await handle.query(RunWorkflow.status_query)).nodes


async def test_a_nan_loss_and_a_gradient_spike_skip_their_update_without_touching_the_weights(
    client: Client, checkpoint_root: Path
) -> None:
    spec = tiny_spec(
        checkpoint_root,
        target_step=32,
        checkpoint={"root": str(checkpoint_root), "interval": "1 steps"},
        # Steps slow enough for each checkpoint's write to land before the next one's: a write still
        # waiting when the next checkpoint comes is superseded (training/flusher.py), and the test
        # compares the checkpoints on either side of each skipped update.
        entrypoint=[*TINY_ENTRYPOINT[:-1], "150"],  # at 60 ms, a loaded CI host superseded one
        faults=[
            {"kind": "nan_loss", "rank": 2, "at_step": 8},
            {"kind": "grad_spike", "rank": 0, "at_step": 30, "factor": 1000},
        ],
    )
    handle = await start(client, spec, "nan-spike")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert result.interruptions == [], "a skipped update interrupts nothing"
    nonfinite, spike = await handle.query(RunWorkflow.detections)
    assert (nonfinite.kind, nonfinite.step, nonfinite.rank, nonfinite.node) == ("nonfinite", 8, 2, "n2")
    assert (spike.kind, spike.step) == ("grad_spike", 30)
    assert (await handle.query(RunWorkflow.health)).skipped_updates == 2

    paths = {c.step: Path(c.path) for c in await handle.query(RunWorkflow.checkpoints)}

    def weights(step: int) -> dict[str, torch.Tensor]:
        return checkpoint_state(paths[step], step)

    for skipped in (8, 30):
        assert_bitwise_equal(weights(skipped), weights(skipped - 1))
    after = min(step for step in paths if step > 8)  # on a loaded host a newer write may supersede step 9's
    assert any(not torch.equal(a, b) for a, b in zip(weights(after).values(), weights(8).values(), strict=True))
