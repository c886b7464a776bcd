"""`checkpoint.interval: "auto"` on a real run: the interval Daly's formula gives once the first
checkpoint has measured its cost reaches the ranks while they train, without a restart."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

from temporalio.client import Client

from stayalive.core.run.lifecycle import RunState
from stayalive.workflows.run import RunWorkflow
from tests.helpers import start, tiny_spec

FIRST_S = 1.0  # min_interval: the first checkpoint comes early, to measure C
THEN_S = 3.0  # max_interval: Daly's optimum for a tiny C and a 1,000 h prior MTBF is minutes; the bound holds it
# A gap read in steps at the run's late step time tells the two intervals apart by which side of their
# geometric mean it falls: on a loaded two-core host a 3 s gap has read as 1.99 s (2 × FIRST_S failed).
BETWEEN = math.sqrt(FIRST_S * THEN_S)


async def test_an_auto_interval_that_changes_mid_generation_reaches_the_running_ranks(
    client: Client, checkpoint_root: Path
) -> None:
    checkpoint = {
        "root": str(checkpoint_root),
        "interval": "auto",
        "min_interval": f"{FIRST_S}s",
        "max_interval": f"{THEN_S}s",
        "prior_mtbf": "1000h",
    }
    handle = await start(client, tiny_spec(checkpoint_root, target_step=500, checkpoint=checkpoint), "auto-interval")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert result.interruptions == [], "one generation: the new interval came by command, not by a restart"

    status = await handle.query(RunWorkflow.status_query)
    assert [i.seconds for i in status.intervals] == [FIRST_S, THEN_S]
    measured, retuned = status.intervals
    assert "measure" in measured.why and measured.cost_s is None
    assert retuned.cost_s is not None and retuned.optimum_s is not None and retuned.optimum_s > THEN_S
    assert "held to max_interval" in retuned.why

    # One sample per checkpoint judged (the target step's comes whenever the run ends). The keeper
    # judges in bursts on a loaded host, so where the ranks checkpointed is read in steps, not in the
    # times they were judged, at the wall time a step took over the run's last steps (its steps/s,
    # which counts the checkpoints' own time and the waits at the barrier; the median compute time of
    # a step counts neither, and ran ~25% short on a loaded CI host).
    samples = sorted((s for s in status.samples if s.step < 500), key=lambda s: s.step)
    step_s = 1 / status.progress.steps_per_second
    first = samples[0].step * step_s
    assert first < 2 * FIRST_S, f"the first checkpoint came {first:.2f}s of steps after the start"
    gaps = [(b.at, (b.step - a.step) * step_s) for a, b in itertools.pairwise(samples)]
    # The ranks take the new interval at a step they agree on: from the first gap at it, every gap
    # keeps it, and that gap ended after the workflow sent the command.
    switched = next((i for i, (_, gap) in enumerate(gaps) if gap > BETWEEN), len(gaps))
    after = [gap for _, gap in gaps[switched:]]
    assert len(after) >= 2, f"checkpoints after the change: {samples}"
    assert gaps[switched][0] >= retuned.at, "the longer interval came with the command, not before it"
    # Steps/s over the last steps runs ahead of the steps before them on a loaded host: 1.5, not 1.3.
    assert 0.8 * THEN_S < statistics.median(after) < 1.5 * THEN_S, after
    assert min(after) > BETWEEN, f"a checkpoint at the old interval after the ranks took the new one: {gaps}"

    health = await handle.query(RunWorkflow.health)
    assert health.checkpoint_interval_s == THEN_S and health.checkpoint_interval_why == retuned.why
