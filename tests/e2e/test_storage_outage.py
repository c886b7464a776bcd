"""Storage that goes away during a checkpoint write is ridden through (halting the job for it would
turn a storage incident into a training incident: docs/architecture.md §8): no rank crashes, training
goes on with its checkpoints in host memory, the newest one reaches storage once it is back and is
validated, and an outage that lasts pages a person."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from temporalio.client import Client

from harness.records import RecordCollector
from harness.tiny import REFERENCE_STEPS as TARGET
from harness.tiny import final_state
from stayalive.core.protocol.telemetry import RankExited, StorageUnavailable
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import PagingClass
from stayalive.workflows.run import RunWorkflow
from tests.helpers import Webhook, assert_bitwise_equal, start, tiny_spec

# From halfway through step 20's write. The run's 60 steps take a second or two, so storage comes back
# after the last one: the final checkpoint waits for it, and every checkpoint between supersedes the
# one before. The page is due after three checkpoint intervals (10 steps each), well within it.
OUTAGE_S = 4.0


@pytest.mark.parametrize("kind", ["storage_outage", "disk_full"])
async def test_a_storage_outage_during_a_write_is_ridden_through_without_a_rank_crash(
    client: Client, checkpoint_root: Path, reference_run: dict[str, torch.Tensor], webhook: Webhook, kind: str
) -> None:
    faults = [{"kind": kind, "at_step": 20, "seconds": OUTAGE_S}]
    # The pager is down through the second run: its page is still being retried when the run ends.
    webhook.status = 200 if kind == "storage_outage" else 503
    paging = {"webhook": webhook.url, "webhook_grace": "2s"}
    spec = tiny_spec(checkpoint_root, target_step=TARGET, faults=faults, paging=paging)
    handle = await start(client, spec, f"storage-{kind}")
    collector = RecordCollector(client, handle, nodes=spec.nodes)
    result = await handle.result()
    records = [r.message for r in await collector.stop()]

    assert result.state == RunState.COMPLETED, result.failure
    assert result.interruptions == []
    status = await handle.query(RunWorkflow.status_query)
    assert status.generation == 0, "no restart"
    exits = [m for m in records if isinstance(m, RankExited)]
    assert sorted(e.rank for e in exits) == [0, 1, 2, 3] and all(e.exit_code == 0 for e in exits)
    outages = [m for m in records if isinstance(m, StorageUnavailable)]
    assert outages and min(o.step for o in outages) == 20, "the ranks told of the write that failed"

    # One detection, paged, closed by the checkpoint that landed once storage was back: written
    # during the outage, on storage now, and validated.
    [detection] = [d for d in status.detections if d.kind == "storage_outage"]
    assert detection.step == 20 and detection.paging is not None
    assert (detection.paging.paging, detection.paging.rule) == (PagingClass.CORRELATED, "storage outage")
    landed = re.fullmatch(r"storage back after \d+s: the checkpoint of step (\d+) landed", detection.actions[-1])
    assert landed is not None, detection.actions
    checkpoints = await handle.query(RunWorkflow.checkpoints)
    assert any(c.step == int(landed.group(1)) > 20 and c.validated for c in checkpoints)
    assert status.storage_outage is None
    run_dir = checkpoint_root / status.run_id
    assert not list(run_dir.glob(".*")), "no partial write left behind"

    # Training went on undisturbed: the run ends bit for bit where an uninterrupted one does.
    assert_bitwise_equal(final_state(checkpoints), reference_run)

    # Every activity of the run is over with it: the page was delivered before it closed, or (the
    # pager down) given up after webhook_grace, each try the same page.
    described = await handle.describe()
    assert [a.activity_type.name for a in described.raw_description.pending_activities] == []
    pages = [json.loads(body) for _, body in webhook.received]
    assert len(pages) == 1 if kind == "storage_outage" else len(pages) >= 1
    page = pages[0]
    assert all(p == page for p in pages)
    assert (page["paging"], page["rule"]) == ("correlated", "storage outage")
    assert "unavailable since" in page["summary"]
