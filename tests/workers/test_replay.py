"""The workflow code still replays the histories of real runs (tests/histories, recorded by
`python -m harness.histories`): what a supervisor worker deployed under a live run does with that
run's history. A change that makes one fail would stop supervising every run started on the old
code: guard it with `workflow.patched`, or record the corpus again once no such run is live."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from stayalive.workflows.fleet import FleetWorkflow
from stayalive.workflows.run import RunWorkflow

HISTORIES = Path(__file__).resolve().parent.parent / "histories"
CORPUS = sorted(HISTORIES.glob("*.json.gz"))


def test_the_corpus_holds_every_kind_of_history() -> None:
    """A crash, a drain, an operator's pause, checkpoint and rollback, a chain continued as new, a
    lost node, a GPU fault that quarantines its node, and the fleet's: the chain over three executions."""
    names = {path.name.rsplit("-", 1)[0] for path in CORPUS}
    assert names == {"crash", "drain", "operator", "chain", "node-lost", "gpu-fault", "fleet-default"}, names
    assert sum(path.name.startswith("chain-") for path in CORPUS) >= 3, "the chain continued as new twice"


@pytest.mark.parametrize("path", CORPUS, ids=[path.name.removesuffix(".json.gz") for path in CORPUS])
async def test_the_workflow_code_replays_a_recorded_history(path: Path) -> None:
    history = WorkflowHistory.from_json(path.name.rsplit("-", 1)[0], gzip.decompress(path.read_bytes()).decode())
    replayer = Replayer(workflows=[RunWorkflow, FleetWorkflow], data_converter=pydantic_data_converter)
    replayed = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert replayed.replay_failure is None, f"{path.name} no longer replays: {replayed.replay_failure}"
