"""`--json`: the commands that show a run's or the fleet's data can print it as JSON instead, on plain
stdout, and what they print parses back into the same records."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import TypeAdapter

from stayalive.core.fleet.model import EccTrend, FleetNode, NodeState, Quarantine
from stayalive.core.run.status import CheckpointRecord
from stayalive.core.run.timeline import Cause, Interruption
from stayalive.workers import cli
from stayalive.workflows.fleet import FleetWorkflow
from stayalive.workflows.run import RunWorkflow
from tests.core.runs import checkpoint, interruption

AT = datetime(2026, 1, 1, 13, 16, 42, tzinfo=UTC)


@pytest.mark.parametrize(
    "argv",
    [
        ["timeline", "r1"],
        ["health", "r1"],
        ["checkpoints", "r1"],
        ["watch", "r1"],
        ["fleet"],
        ["run", "spec.json", "--follow"],
        ["run", "spec.json"],
    ],
)
def test_json_is_a_flag_of_every_command_that_shows_data(argv: list[str]) -> None:
    assert cli.parser().parse_args([*argv, "--json"]).json is True
    assert cli.parser().parse_args(argv).json is False


@pytest.mark.parametrize("argv", [["checkpoint", "r1"], ["resume", "r1"], ["pause", "r1"], ["check", "spec.json"]])
def test_commands_that_only_act_have_no_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parser().parse_args([*argv, "--json"])
    assert "unrecognized arguments: --json" in capsys.readouterr().err


class Handle:
    """A workflow handle that answers queries from a table."""

    def __init__(self, answers: dict[Any, Any]) -> None:
        self.answers = answers

    async def query(self, query: Any) -> Any:
        return self.answers[query]


def answering(monkeypatch: pytest.MonkeyPatch, answers: dict[Any, Any]) -> None:
    async def client(_: object) -> Any:
        return SimpleNamespace(get_workflow_handle=lambda _id: Handle(answers))

    monkeypatch.setattr(cli, "_client", client)
    monkeypatch.setattr(cli, "fleet_handle", lambda _client: Handle(answers))


def test_timeline_and_checkpoints_print_records_that_parse_back(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    interruptions = [interruption(AT, Cause.CRASH, "n1", step=170, restored_from="memory", restart_seconds=4.5)]
    records = [checkpoint(AT, step=150).model_copy(update={"validated": None})]
    answering(monkeypatch, {RunWorkflow.timeline: interruptions, RunWorkflow.checkpoints: records})

    assert cli.main(["timeline", "r1", "--json"]) == 0
    printed = capsys.readouterr().out
    assert TypeAdapter(list[Interruption]).validate_json(printed) == interruptions
    assert "Interruption timeline" not in printed, "data only, no table"

    assert cli.main(["checkpoints", "r1", "--json"]) == 0
    assert TypeAdapter(list[CheckpointRecord]).validate_json(capsys.readouterr().out) == records

    assert cli.main(["timeline", "r1"]) == 0
    assert "Interruption timeline" in capsys.readouterr().out, "without --json, the table"


def test_fleet_prints_nodes_and_quarantines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = [FleetNode(id="n1", rack="rack-a", hub="127.0.0.1:1", state=NodeState.QUARANTINED, since=AT)]
    records = [Quarantine(node="n1", reason="ECC errors", since=AT, run_ids_affected=["r1"])]
    start = int(AT.timestamp())
    trends = [EccTrend(node="n1", points=[(start, 100), (start + 6 * 3600, 130)])]
    answering(
        monkeypatch, {FleetWorkflow.nodes: nodes, FleetWorkflow.quarantines: records, FleetWorkflow.ecc_trends: trends}
    )
    assert cli.main(["fleet", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert TypeAdapter(list[FleetNode]).validate_python(printed["nodes"]) == nodes
    assert TypeAdapter(list[Quarantine]).validate_python(printed["quarantines"]) == records
    assert TypeAdapter(list[EccTrend]).validate_python(printed["ecc_trends"]) == trends

    assert cli.main(["fleet"]) == 0
    table = capsys.readouterr().out
    assert "Corrected ECC errors" in table
    row = next(line.replace("│", " ").split() for line in table.splitlines() if "130" in line)
    assert row == ["n1", "130", "120.0", "01-01", "13:16", "01-01", "19:16"], "node, errors, per day, first and last"
