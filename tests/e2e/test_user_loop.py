"""A user's own training loop with the public API (`stayalive.Run`, tests/training/api_loop.py) under
the real workflow: what the built-in trainer survives, it survives."""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from temporalio.client import Client

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import DevStack
from stayalive.workflows.run import DrainNode, ResumeFrom, RunWorkflow
from tests.helpers import rank_pids, start, wait_for_step, wait_until

LOOP = "tests/training/api_loop.py"


def loop_spec(checkpoint_root: Path, out: Path, samples: Path, **overrides: object) -> RunSpec:
    spec: dict[str, object] = {
        "name": "user-loop",
        "world_size": 4,
        "ranks_per_node": 2,
        "nodes": ["n1", "n2"],
        "spare_nodes": ["n3"],
        "min_nodes": 2,
        "entrypoint": ["python", LOOP, "--out", str(out), "--samples", str(samples), "--step-ms", "30"],
        "target_step": 40,
        "checkpoint": {"root": str(checkpoint_root), "interval": "5 steps"},
    }
    return RunSpec.model_validate(spec | overrides)


async def uninterrupted(client: Client, tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int], str]]:
    """The same script, seed and launcher with nothing going wrong: its final weights and the samples
    each rank trained on at each step. (Under torchrun instead, the first layer's gradients differ
    in the last bits: a forked rank's CPU kernels are not a cold interpreter's.)"""
    out, samples = tmp_path / "reference.pt", tmp_path / "reference-samples.txt"
    result = await (await start(client, loop_spec(tmp_path / "reference", out, samples), "user-loop-ref")).result()
    assert result.state == RunState.COMPLETED and not result.interruptions
    return torch.load(out, weights_only=True), trained_samples(samples)


Reference = tuple[dict[str, torch.Tensor], dict[tuple[int, int], str]]


@pytest.fixture(scope="module")
async def reference(client: Client, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return await uninterrupted(client, tmp_path_factory.mktemp("user-loop-reference"))


def assert_ends_as_uninterrupted(out: Path, samples: Path, reference: Reference) -> None:
    weights, reference_samples = reference
    final = torch.load(out, weights_only=True)
    assert final.keys() == weights.keys()
    assert trained_samples(samples) == reference_samples, "a sample was lost or repeated"
    assert all(torch.equal(final[k], weights[k]) for k in final), "final weights differ from an uninterrupted run"


def trained_samples(path: Path) -> dict[tuple[int, int], str]:
    """(step, rank) → the samples of the step as it stands: a step trained again after a restart
    replaces what the lost generation trained at it."""
    lines = [line.split(" ", 2) for line in path.read_text().splitlines()]
    return {(int(step), int(rank)): samples for step, rank, samples in lines}


async def test_a_killed_rank_resumes_from_host_memory_bitwise_and_no_sample_is_lost_or_repeated(
    client: Client, tmp_path: Path, reference: Reference
) -> None:
    out, samples = tmp_path / "final.pt", tmp_path / "samples.txt"
    handle = await start(client, loop_spec(tmp_path / "checkpoints", out, samples), "user-loop-kill")
    await wait_until(handle, lambda s: any(c.validated and c.step >= 10 for c in s.checkpoints))
    os.kill((await rank_pids(client, handle))["n2"][3], signal.SIGKILL)

    result = await handle.result()
    assert result.state == RunState.COMPLETED, result.failure
    (crash,) = result.interruptions
    assert (crash.cause, crash.rank, crash.restored_from) == (Cause.CRASH, 3, "memory")
    assert crash.resumed_from is not None and crash.resumed_from >= 10
    assert_ends_as_uninterrupted(out, samples, reference)


@dataclass(frozen=True)
class Corruption:
    """A silent corruption planted in one rank, and what the run must say of it."""

    fault: dict[str, object]
    rank: int
    node: str
    detected_by: str
    detail: str
    checked_at: int  # the step whose check fails
    last_verified: int  # the last check that passed: the run resumes from it
    suspect: int  # a checkpoint written after it


CORRUPTIONS = {
    # Checks every 10 steps, checkpoints every 5: the checks at 10 and 20 pass; at 30 it is rank 3's
    # turn to replay its step (the loop hands it over), and rank 3's gradient had a bit flipped.
    "bitflip": Corruption(
        fault={"kind": "bitflip", "rank": 3, "at_step": 30},
        rank=3,
        node="n2",
        detected_by="bitwise self-check replay",
        detail="rank 3",  # its own replay's report, or another rank's word of it, whichever lands first
        checked_at=30,
        last_verified=20,
        suspect=25,
    ),
    # Rank 1's weights take a bit flip at step 13: its replica differs from the others' at the check
    # of step 20. Nothing in its own computation is inconsistent, so only the comparison finds it.
    "weightflip": Corruption(
        fault={"kind": "weightflip", "rank": 1, "at_step": 13},
        rank=1,
        node="n1",
        detected_by="cross-rank check of data-parallel replicas",
        detail="rank 1's weights or gradient differ from the other 3 replicas'",
        checked_at=20,
        last_verified=10,
        suspect=15,
    ),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
async def test_a_corrupted_rank_is_named_and_the_run_rolls_back_past_it_and_ends_as_if_untouched(
    client: Client, tmp_path: Path, reference: Reference, corruption: Corruption
) -> None:
    out, samples = tmp_path / "final.pt", tmp_path / "samples.txt"
    spec = loop_spec(tmp_path / "checkpoints", out, samples, sdc={"self_check_every": 10}, faults=[corruption.fault])
    handle = await start(client, spec, f"user-loop-{corruption.fault['kind']}")
    result = await handle.result()
    assert result.state == RunState.COMPLETED, result.failure
    (sdc,) = result.interruptions
    assert (sdc.cause, sdc.rank, sdc.node) == (Cause.SDC, corruption.rank, corruption.node), "rank and node named"
    assert sdc.detected_by == corruption.detected_by and corruption.detail in sdc.detail
    check = sdc.sdc_check
    assert check is not None and (check.step, check.last_verified) == (corruption.checked_at, corruption.last_verified)
    assert sdc.resumed_from == corruption.last_verified, "back to the newest checkpoint at the last passing check"
    first = {c.step: c for c in await handle.query(RunWorkflow.checkpoints) if c.generation == 0}
    assert first[corruption.suspect].suspect, "written after the last passing check"
    assert corruption.node not in (await handle.query(RunWorkflow.status_query)).nodes
    assert_ends_as_uninterrupted(out, samples, reference)


async def test_a_deterministically_wrong_rank_passes_its_replays_and_fails_the_cross_rank_check(
    client: Client, tmp_path: Path
) -> None:
    # Rank 1 scales its first layer's output by 1 + 1e-3 on every forward. Its replay at step 5 agrees
    # with itself and the all-reduce hands every replica the same gradient, so the checks at 5, 10
    # and 15 pass. At step 20 ranks 1 and 3 compute rank 1's micro-batch (the loop replays any rank's:
    # --any-rank) and disagree; rank 2 sides with rank 3.
    root, out, samples = tmp_path / "checkpoints", tmp_path / "final.pt", tmp_path / "samples.txt"
    entrypoint = ["python", LOOP, "--out", str(out), "--samples", str(samples), "--step-ms", "30", "--any-rank"]
    sdc = {"self_check_every": 5, "cross_check_every": 20}
    faults = [{"kind": "wrong", "rank": 1, "epsilon": 1e-3}]
    spec = loop_spec(root, out, samples, entrypoint=entrypoint, sdc=sdc, faults=faults)
    handle = await start(client, spec, "user-loop-wrong-rank")
    result = await handle.result()
    assert result.state == RunState.COMPLETED, result.failure
    (interruption,) = result.interruptions
    assert (interruption.cause, interruption.rank, interruption.node) == (Cause.SDC, 1, "n1")
    assert interruption.detected_by == "cross-rank check"
    check = interruption.sdc_check
    assert check is not None and (check.method, check.step, check.culprit) == ("cross", 20, 1)
    assert check.difference is not None and check.tolerance is not None
    assert check.difference > check.tolerance > 0, "the measured difference and the tolerance it broke"
    assert "spread" in check.detail, "how the tolerance was derived"
    assert check.last_verified == 15 and interruption.resumed_from == 15


@pytest.mark.parametrize("wrapping", ["ddp", "fsdp2"])
async def test_a_nan_loss_and_a_gradient_spike_skip_their_update_on_every_rank_and_interrupt_nothing(
    client: Client, tmp_path: Path, wrapping: str
) -> None:
    root, out, samples = tmp_path / "checkpoints", tmp_path / "final.pt", tmp_path / "samples.txt"
    entrypoint = ["python", LOOP, "--out", str(out), "--samples", str(samples), "--step-ms", "30"]
    faults = [
        {"kind": "nan_loss", "rank": 2, "at_step": 8},
        {"kind": "grad_spike", "rank": 0, "at_step": 30, "factor": 1000},
    ]
    fsdp = ["--fsdp"] if wrapping == "fsdp2" else []
    spec = loop_spec(root, out, samples, entrypoint=entrypoint + fsdp, faults=faults)
    handle = await start(client, spec, f"user-loop-nan-spike-{wrapping}")
    result = await handle.result()
    assert result.state == RunState.COMPLETED, result.failure
    assert result.interruptions == [], "a skipped update interrupts nothing"
    nonfinite, spike = await handle.query(RunWorkflow.detections)
    assert (nonfinite.kind, nonfinite.step, spike.kind, spike.step) == ("nonfinite", 8, "grad_spike", 30)
    if wrapping == "ddp":  # each bucket's sum as it entered the all-reduce names the rank
        assert (nonfinite.rank, nonfinite.node) == (2, "n2")
    else:  # FSDP2's reduce-scatter spreads it: the norm of the shards finds it, nobody can say whose
        assert (nonfinite.rank, nonfinite.node) == (None, None)
        assert "from a rank unknown" in nonfinite.evidence
    assert (await handle.query(RunWorkflow.health)).skipped_updates == 2


async def test_a_hang_in_one_ranks_collective_is_blamed_on_that_rank(client: Client, tmp_path: Path) -> None:
    # At step 30: past the 20 steps the hang watchdog measures before its timeout leaves the start-up allowance.
    faults = [{"kind": "collective_hang", "rank": 3, "at_step": 30}]
    paths = (tmp_path / "checkpoints", tmp_path / "final.pt", tmp_path / "samples.txt")
    handle = await start(client, loop_spec(*paths, target_step=50, faults=faults), "user-loop-hang")
    result = await handle.result()
    assert result.state == RunState.COMPLETED, result.failure
    (hang,) = result.interruptions
    assert (hang.cause, hang.node, hang.rank) == (Cause.HANG, "n2", 3)
    assert re.search(r"rank 3 never entered collective #\d+ \(the gradient all-reduce of step 30\)", hang.detail)


DRAINED_TARGET = 80  # long enough that the survivors are still training when the test asks for their pids


@dataclass(frozen=True)
class Drain:
    flags: list[str]  # the loop's: DDP by default, or its own all-reduce rejoining in place
    spares: list[str]
    outcome: str  # what the drain says it did
    nodes: list[str]  # the run's nodes after it
    rejoined: str  # what the survivors' logs say


DRAINS = {
    "re-executed": Drain([], [], "continuing on 1 nodes", ["n1"], "rejoining as a new process"),
    "in-place": Drain(["--manual", "--in-place"], [], "continuing on 1 nodes", ["n1"], "rejoining in place"),
    # The spare's ranks start fresh and load the held checkpoint together with the survivors, who load
    # what they hold. (DCP gives a fresh optimizer its state by stepping it: the SDC checks must not take
    # that step for the loop's update, or the fresh ranks would enter a collective the survivors never do.)
    "in-place, a spare joins": Drain(
        ["--manual", "--in-place"], ["n3"], "replaced n2 with spare n3", ["n1", "n3"], "rejoining in place"
    ),
}


@pytest.mark.parametrize("case", DRAINS.values(), ids=DRAINS.keys())
async def test_a_drain_goes_on_resharded_from_the_agreed_step(
    client: Client, stack: DevStack, tmp_path: Path, case: Drain
) -> None:
    """A DDP model is bound to its group, so its survivors re-execute themselves; a loop that all-reduces
    through the API and says so (`rejoin_in_place`) keeps its processes and their memory."""
    paths = (tmp_path / "checkpoints", tmp_path / "final.pt", tmp_path / "samples.txt")
    spec = loop_spec(*paths, spare_nodes=case.spares, min_nodes=1, target_step=DRAINED_TARGET)
    spec = spec.model_copy(update={"entrypoint": [*spec.entrypoint, *case.flags]})
    handle = await start(client, spec, "user-loop-drain")
    await wait_for_step(client, handle, 10)
    await wait_until(handle, lambda s: s.state == RunState.RUNNING)
    survivors = (await rank_pids(client, handle))["n1"]
    outcome = await handle.execute_update(RunWorkflow.drain_node, DrainNode(node="n2", reason="fan failing"))
    assert case.outcome in outcome
    assert (await rank_pids(client, handle))["n1"] == survivors, "the survivors kept their processes"

    result = await handle.result()
    assert result.state == RunState.COMPLETED, result.failure
    (drain,) = result.interruptions
    assert drain.cause == Cause.DRAIN and drain.step is not None
    status = await handle.query(RunWorkflow.status_query)
    world_size = 2 * len(case.nodes)
    assert status.nodes == case.nodes and status.world_size == world_size
    steps = trained_samples(tmp_path / "samples.txt")
    assert {rank for (step, rank) in steps if step > drain.step} == set(range(world_size))
    assert max(step for step, _ in steps) == DRAINED_TARGET
    logs = sorted(stack.state_dir.glob(f"nodes/n1/runs/{status.run_id}/g0/rank-*.log"))
    assert [case.rejoined in log.read_text() for log in logs] == [True, True], f"the logs say '{case.rejoined}'"


async def test_force_checkpoint_and_resume_from_a_named_step(client: Client, tmp_path: Path) -> None:
    paths = (tmp_path / "checkpoints", tmp_path / "final.pt", tmp_path / "samples.txt")
    checkpoint = {"root": str(tmp_path / "checkpoints"), "interval": "1000 steps"}
    handle = await start(client, loop_spec(*paths, target_step=400, checkpoint=checkpoint), "user-loop-forced")
    before = await wait_for_step(client, handle, 10)
    await handle.signal(RunWorkflow.force_checkpoint)
    status = await wait_until(handle, lambda s: any(c.validated for c in s.checkpoints), timeout=60)
    (forced,) = status.checkpoints
    assert forced.step >= before

    outcome = await handle.execute_update(RunWorkflow.resume_from, ResumeFrom(step=forced.step))
    assert outcome.startswith(f"rolling back to step {forced.step}")
    await wait_until(handle, lambda s: s.generation == 1 and s.state == RunState.RUNNING, timeout=60)
    status = await handle.query(RunWorkflow.status_query)
    (rollback,) = status.interruptions
    assert (rollback.cause, rollback.resumed_from) == (Cause.ROLLBACK, forced.step)
    await handle.cancel()


async def test_a_checkpoint_the_runs_own_check_rejects_is_never_resumed(client: Client, tmp_path: Path) -> None:
    """checkpoint.validation runs tests/training/api_check.py (load, forward pass) on every checkpoint
    after stayalive's checks: it rejects step 30's, and a rank killed just after that verdict resumes
    from another checkpoint, one both checks passed, or from the start."""
    root, out, samples = tmp_path / "checkpoints", tmp_path / "final.pt", tmp_path / "samples.txt"
    checkpoint = {
        "root": str(root),
        "interval": "30 steps",
        "validation": ["python", "tests/training/api_check.py", "--reject-step", "30"],
    }
    # The check is a process per checkpoint (python, torch, a load): its verdict trails the run by
    # seconds, by many on a loaded host. The ranks wait before step 35 until the verdict is in and the
    # rank is killed (the step timeout outlasts that wait), so the kill always finds them training.
    go = tmp_path / "go"
    entrypoint = ["python", LOOP, "--out", str(out), "--samples", str(samples), "--hold", "35", str(go)]
    spec = loop_spec(
        root, out, samples, target_step=40, checkpoint=checkpoint, entrypoint=entrypoint, health={"step_timeout": 300}
    )
    handle = await start(client, spec, "user-loop-check")
    status = await wait_until(handle, lambda s: any(c.step == 30 for c in s.checkpoints), timeout=120)
    os.kill((await rank_pids(client, handle))["n1"][1], signal.SIGKILL)
    go.touch()
    (rejected,) = status.checkpoints
    assert not rejected.validated
    assert "step 30: the forward pass is not what this model should give" in rejected.reason

    result = await handle.result()
    assert result.state == RunState.COMPLETED, result.failure
    (crash,) = result.interruptions
    assert (crash.cause, crash.rank) == (Cause.CRASH, 1)
    assert crash.resumed_from is not None and crash.resumed_from != 30
    judged = await handle.query(RunWorkflow.checkpoints)
    assert all("the run's own check" in c.reason for c in judged if c.validated)
    assert crash.resumed_from == 0 or any(c.step == crash.resumed_from and c.validated for c in judged)
