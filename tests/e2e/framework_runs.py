"""What the framework adapters' tests share (tests/e2e/test_lightning.py, test_hf_trainer.py): a
training script of the framework's own, with stayalive's callback, run under the real workflow, a
rank killed after a validated checkpoint, and the run compared with an uninterrupted one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from temporalio.client import Client

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.timeline import Cause
from tests.helpers import rank_pids, start, wait_until

TARGET = 24  # 4 epochs of 6 steps at 4 ranks: checkpoints mid-epoch (4, 8, 16, 20) and between epochs (12)


def framework_spec(script: str, checkpoint_root: Path, out: Path, samples: Path) -> RunSpec:
    """As tests/e2e/test_user_loop.py's: 4 ranks on n1 and n2, n3 spare, gloo; 60 ms a step keeps the
    run going past the kill, which comes a few steps after a checkpoint is validated."""
    entrypoint = ["python", script, "--out", str(out), "--samples", str(samples), "--steps", str(TARGET)]
    spec: dict[str, object] = {
        "name": Path(script).stem.replace("_", "-"),
        "world_size": 4,
        "ranks_per_node": 2,
        "nodes": ["n1", "n2"],
        "spare_nodes": ["n3"],
        "min_nodes": 2,
        "entrypoint": [*entrypoint, "--step-ms", "60"],
        "target_step": TARGET,
        "checkpoint": {"root": str(checkpoint_root), "interval": "4 steps"},
    }
    return RunSpec.model_validate(spec)


def trained_samples(path: Path) -> dict[tuple[int, int], str]:
    """(step, rank) → the samples of the step as it stands: a step trained again after a restart
    replaces what the lost generation trained at it."""
    lines = [line.split(" ", 2) for line in path.read_text().splitlines()]
    return {(int(step), int(rank)): samples for step, rank, samples in lines}


async def uninterrupted(
    client: Client, script: str, tmp_path: Path
) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int], str]]:
    """The same script under the same launcher with nothing going wrong: its final weights and samples."""
    out, samples = tmp_path / "reference.pt", tmp_path / "reference-samples.txt"
    spec = framework_spec(script, tmp_path / "reference", out, samples)
    result = await (await start(client, spec, f"{spec.name}-ref")).result()
    assert result.state == RunState.COMPLETED and not result.interruptions, result.failure
    return torch.load(out, weights_only=True), trained_samples(samples)


async def a_killed_rank_resumes_exactly(client: Client, script: str, tmp_path: Path) -> None:
    """Rank 3 SIGKILLed after a validated checkpoint: the run completes, the crash is that rank's and
    resumed from host memory, and every rank trained the reference's samples at every step, to the
    reference's final weights bit for bit."""
    out, samples = tmp_path / "final.pt", tmp_path / "samples.txt"
    spec = framework_spec(script, tmp_path / "checkpoints", out, samples)
    handle = await start(client, spec, f"{spec.name}-kill")
    await wait_until(handle, lambda s: any(c.validated and c.step >= 8 for c in s.checkpoints), every=0.1)
    os.kill((await rank_pids(client, handle))["n2"][3], signal.SIGKILL)

    result = await handle.result()
    assert result.state == RunState.COMPLETED, result.failure
    (crash,) = result.interruptions
    assert (crash.cause, crash.rank, crash.restored_from) == (Cause.CRASH, 3, "memory")
    assert crash.resumed_from is not None and 8 <= crash.resumed_from < TARGET
    weights, reference_samples = await uninterrupted(client, script, tmp_path)
    final = torch.load(out, weights_only=True)
    assert trained_samples(samples) == reference_samples, "a sample was lost, repeated or out of order"
    assert final.keys() == weights.keys()
    assert [k for k in final if not torch.equal(final[k], weights[k])] == [], "final weights differ from the reference"
