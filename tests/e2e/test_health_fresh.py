"""`health` is fresh: while the ranks step, its step, loss and step times are never older than the
spec's health.progress_refresh (plus a signal's delivery), it says when they were measured, and the
history pays for that with one signal per refresh, not one per step."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from temporalio.client import Client

from stayalive.core.messages.events import MonitorReport
from stayalive.core.run.lifecycle import RunState
from stayalive.workers.devstack import DevStack
from stayalive.workflows.run import RunWorkflow
from tests.helpers import start, tiny_spec

REFRESH_S = 2.0
DELIVERY_S = 3.0  # a signal's way to the workflow, and its task, on a loaded two-core machine


async def test_health_is_never_older_than_its_refresh_and_history_grows_with_time_not_steps(
    client: Client, stack: DevStack, checkpoint_root: Path
) -> None:
    spec = tiny_spec(
        checkpoint_root,
        target_step=450,
        health={"progress_refresh": f"{REFRESH_S}s"},
        # No checkpoint until the end: every number health shows comes from the monitor's reports.
        checkpoint={"root": str(checkpoint_root), "interval": "1000 steps"},
    )
    handle = await start(client, spec, "fresh-health")
    seen: list[tuple[int, float | None, float]] = []  # (step, its loss, its age when read)
    running_since: float | None = None
    while True:
        health = await handle.query(RunWorkflow.health)
        if health.state != RunState.RUNNING.value:
            if running_since is not None:
                break
            await asyncio.sleep(0.2)
            continue
        running_since = running_since or time.monotonic()
        if health.as_of is not None:
            seen.append((health.step, health.loss, (datetime.now(UTC) - health.as_of).total_seconds()))
        await asyncio.sleep(0.5)
    running_s = time.monotonic() - running_since
    result = await handle.result()
    assert result.state == RunState.COMPLETED and result.final_step == 450

    assert running_s > 4 * REFRESH_S, f"the run trained only {running_s:.1f}s: too short to see refreshes"
    steps = sorted({step for step, _, _ in seen})
    assert len(steps) >= running_s / REFRESH_S / 2, f"health refreshed only {len(steps)} times in {running_s:.0f}s"
    assert all(loss is not None for _, loss, _ in seen)
    stale = [(step, round(age, 1)) for step, _, age in seen[2:] if age > REFRESH_S + DELIVERY_S]
    assert not stale, f"health older than {REFRESH_S + DELIVERY_S}s: {stale}"
    assert health.fresh_within_s == REFRESH_S

    # The CLI reads the same run, for a script: `watch --json` prints its result.
    watched = subprocess.run(
        [str(Path(sys.executable).parent / "stayalive"), "--address", stack.address, "watch", handle.id, "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(watched.stdout)["final_step"] == 450

    kinds: Counter[str] = Counter()
    async for event in handle.fetch_history_events():
        signal = event.workflow_execution_signaled_event_attributes
        if signal.signal_name == "monitor_report":
            (report,) = await client.data_converter.decode(signal.input.payloads, [MonitorReport])
            kinds[report.event.kind] += 1
    assert kinds["progress"] >= 2
    assert kinds.total() <= running_s / REFRESH_S + 5, f"{dict(kinds)} for 450 steps in {running_s:.0f}s"
