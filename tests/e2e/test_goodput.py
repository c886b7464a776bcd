"""The goodput ledger end to end: a run with a straggler, a crash and forced checkpoints accounts for
every second of its wall-clock, files its pages where the spec says, and the supervisor's /metrics
serves the same numbers to Prometheus, under the names and labels the Grafana dashboard reads."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowHandle

from harness.tiny import TINY_ENTRYPOINT
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import DevStack
from stayalive.workflows.run import RunWorkflow
from tests.dashboard import dashboard_uses, exposition, load_dashboard
from tests.helpers import start, tiny_spec, wait_for_step, wait_until

# Simulated device time keeps compute steady enough on two cores for the straggler check: at 20 ms
# the real compute of four ranks sharing two cores jitters as much as a 1.5× straggler stands out.
ENTRYPOINT = [*TINY_ENTRYPOINT[:-1], "40"]
CATEGORIES = ("productive", "startup", "checkpoint", "lost", "recovery", "idle", "straggler")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def samples(text: str) -> dict[str, float]:
    """The exposition's samples, 'name{labels}' → value."""
    lines = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in lines}


def ledger_of(metrics: dict[str, float], run: str) -> dict[str, float]:
    return {c: metrics.get(f'stayalive_ledger_seconds{{category="{c}",run_id="{run}"}}', -1.0) for c in CATEGORIES}


async def scrape_run(url: str, handle: WorkflowHandle, wall_seen: float, timeout: float = 30.0) -> str:
    """The exposition, once the supervisor's exporter has refreshed the run's series (every few
    seconds) from a state at least as new as one the test has seen: its ledger covers at least
    `wall_seen` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = scrape(url)
        if sum(ledger_of(samples(text), handle.id).values()) >= wall_seen:
            return text
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} never served {handle.id}")


def dashboard_reads_what_is_served(text: str) -> None:
    """Every metric the Grafana dashboard's expressions read is one this scrape serves, and each label
    they match, group or join on, or put in a legend, is on that metric's series."""
    served = exposition(text)
    uses = dashboard_uses(load_dashboard())
    checked: set[str] = set()
    for use in uses:
        assert use.metrics <= served.names, f"{use.where} reads {sorted(use.metrics - served.names)}: not served"
        for metric in use.metrics & served.labels.keys():
            missing = use.labels - served.labels[metric]
            assert not missing, f"{use.where} needs {sorted(missing)} on {metric}: {sorted(served.labels[metric])}"
            checked |= use.labels
    assert {"run_id", "category", "cause"} <= checked
    # A metric served without series has no labels to check: only the checkpoint interval, which this
    # run fixes in steps.
    unseen = {metric for use in uses for metric in use.metrics} - served.labels.keys()
    assert unseen <= {"stayalive_checkpoint_interval_seconds"}, unseen


async def test_the_ledger_adds_up_to_wall_clock_and_metrics_serve_it(
    client: Client, stack: DevStack, checkpoint_root: Path, tmp_path: Path
) -> None:
    pages = tmp_path / "pages.jsonl"
    spec = tiny_spec(
        checkpoint_root,
        entrypoint=ENTRYPOINT,
        # 250 steps (15 s or more) after the crash: the run still trains while /metrics is scraped,
        # which serves open runs only and refreshes every 5 s.
        target_step=500,
        checkpoint={"root": str(checkpoint_root), "interval": "100 steps"},
        # 10 slow steps in a row make a straggler, not the default 20: on two cores shared with another
        # test's ranks, one step in twenty can cost the straggler its lead (a whole run without a
        # detection was seen). What this test checks is the ledger, not the detector's reach.
        health={"straggler_steps": 10, "slowness_tally": "2s"},
        paging={"jsonl": str(pages)},
        faults=[
            {"kind": "straggler", "rank": 2, "factor": 1.5, "from_step": 40},
            {"kind": "crash", "rank": 1, "at_step": 250},
        ],
    )
    handle = await start(client, spec, "ledger")
    await wait_for_step(client, handle, 10)
    await handle.signal(RunWorkflow.force_checkpoint)  # early: the crash still loses the steps since 200
    await wait_until(handle, lambda s: any(d.kind == "straggler" for d in s.detections))
    await wait_until(handle, lambda s: s.straggler_seconds > 0, timeout=30)
    seen = await wait_until(handle, lambda s: bool(s.interruptions) and s.interruptions[0].restart_seconds is not None)
    assert seen.started_at is not None
    wall_seen = (datetime.now(UTC) - seen.started_at).total_seconds()
    await handle.signal(RunWorkflow.force_checkpoint)

    # While it runs: /metrics serves the ledger, and its categories make up the wall-clock so far.
    text = await scrape_run(stack.metrics_url, handle, wall_seen)
    metrics = samples(text)
    assert metrics[f'stayalive_interruptions{{cause="crash",run_id="{handle.id}"}}'] == 1
    live = ledger_of(metrics, handle.id)
    assert all(seconds >= 0 for seconds in live.values()), live
    goodput = metrics[f'stayalive_goodput_ratio{{run_id="{handle.id}"}}']
    assert sum(live.values()) == pytest.approx(live["productive"] / goodput, rel=0.01)
    assert min(live["straggler"], live["startup"], live["lost"], live["recovery"]) > 0, live
    assert metrics[f'stayalive_step_time_p50_seconds{{run_id="{handle.id}"}}'] > 0
    dashboard_reads_what_is_served(text)

    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert [i.cause for i in result.interruptions] == [Cause.CRASH]

    # The whole run: every category measured, nothing counted twice, the sum is the wall-clock.
    book, status = result.ledger, await handle.query(RunWorkflow.status_query)
    assert status.started_at is not None and status.finished_at is not None
    wall = (status.finished_at - status.started_at).total_seconds()
    costs = book.startup + book.checkpoint + book.lost + book.recovery + book.idle + book.straggler
    assert book.wall == pytest.approx(wall, rel=0.01)
    assert costs + book.productive == pytest.approx(wall, rel=0.01), "the categories add up to wall-clock"
    assert min(book.startup, book.checkpoint, book.lost, book.recovery, book.straggler) > 0, book
    assert book.idle == 0, "nothing waited for a person or a node"
    assert book.straggler == pytest.approx(status.straggler_seconds)
    forced = [s for s in status.samples if s.step % 100 != 0]  # a sample per checkpoint judged
    assert len(forced) >= 2, "both forced checkpoints were written between the interval's"

    # The crash was paged as independent: logged and filed in the digest, nobody woken.
    (line,) = [json.loads(text) for text in pages.read_text().splitlines()]
    assert (line["paging"], line["run_id"]) == ("independent", status.run_id)
    assert "crash" in line["summary"] and line["action"].startswith("restarted automatically")
