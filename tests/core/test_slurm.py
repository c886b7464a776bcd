"""Slurm's side of a run as plain decisions: placement, the requeue-proof id, drained nodes."""

from __future__ import annotations

import pytest

from stayalive.core.decisions.slurm import (
    Placement,
    SlurmNode,
    drains_to_ask,
    parse_scontrol_node,
    parse_sinfo,
    place,
    placed,
    rack_of,
    run_workflow_id,
)
from stayalive.core.run.spec import RunSpec

GPUS = [f"gpu{n:03d}" for n in range(130)]


@pytest.mark.parametrize(
    ("allocated", "train", "placement"),
    [
        (["c1", "c2", "c3"], 2, Placement(train=["c1", "c2"], spares=["c3"])),
        (["c1", "c2"], 2, Placement(train=["c1", "c2"], spares=[])),
        # The allocation: 130 nodes, 128 train, two spares, in Slurm's order.
        (GPUS, 128, Placement(train=GPUS[:128], spares=["gpu128", "gpu129"])),
    ],
)
def test_the_first_nodes_train_and_the_rest_are_spares(allocated: list[str], train: int, placement: Placement) -> None:
    assert place(allocated, train) == placement


@pytest.mark.parametrize(
    ("allocated", "train", "says"),
    [
        (["c1"], 2, "ask sbatch for at least 2 (-N 2)"),
        (["c1", "c1"], 1, "lists a node twice"),
        (["c1"], 0, "at least one node"),
    ],
)
def test_an_allocation_that_cannot_hold_the_run_is_refused_with_what_to_do(
    allocated: list[str], train: int, says: str
) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        place(allocated, train)


def spec(**overrides: object) -> RunSpec:
    raw: dict[str, object] = {
        "name": "gpt",
        "world_size": 16,
        "ranks_per_node": 8,
        "nodes": ["a", "b"],
        "entrypoint": ["python", "train.py"],
        "target_step": 100,
        "checkpoint": {"root": "/ckpt", "interval": "10m"},
    }
    return RunSpec.model_validate(raw | overrides)


def test_the_spec_moves_onto_the_allocations_nodes_and_keeps_everything_else() -> None:
    moved = placed(spec(spare_nodes=["z"]), Placement(train=["c7", "c8"], spares=["c9"]))
    assert (moved.nodes, moved.spare_nodes) == (["c7", "c8"], ["c9"])
    assert moved.model_dump(exclude={"nodes", "spare_nodes"}) == spec().model_dump(exclude={"nodes", "spare_nodes"})


def test_a_placement_whose_width_does_not_fit_the_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size is 16 but 3 nodes"):
        placed(spec(), Placement(train=["c1", "c2", "c3"], spares=[]))


def test_the_workflow_id_is_the_same_for_every_start_of_a_job() -> None:
    assert run_workflow_id("gpt", "4242") == run_workflow_id("gpt", "4242") == "gpt-slurm-4242"
    assert run_workflow_id("gpt", "4243") != run_workflow_id("gpt", "4242")


SINFO = """c1|mixed|none
c2|draining|fan failing
c3|drained|ECC errors
c4|idle|none
c4|idle|none
c5|failing|GPU fell off the bus
c6|down|Not responding
"""


def test_sinfo_lines_are_read_once_per_node_with_their_reasons() -> None:
    nodes = {n.name: n for n in parse_sinfo(SINFO)}
    assert list(nodes) == ["c1", "c2", "c3", "c4", "c5", "c6"]
    assert nodes["c2"] == SlurmNode(name="c2", state="draining", reason="fan failing")
    assert nodes["c1"].reason == ""
    assert [n for n, node in nodes.items() if node.out_of_service] == ["c2", "c3", "c5"]


@pytest.mark.parametrize(
    ("run_nodes", "state", "asked"),
    [
        (["c1", "c2"], "RUNNING", ["c2"]),  # a node of the run Slurm drains
        (["c1", "c2", "c3", "c5"], "RUNNING", ["c2", "c3", "c5"]),  # drained, and failing
        (["c1", "c4"], "RUNNING", []),  # the drained nodes are spares or out already
        (["c1", "c2"], "RESUMING", []),  # asked again once the run is RUNNING
        (["c1", "c6"], "RUNNING", []),  # down is a lost node: the run sees its agent fall silent
    ],
)
def test_nodes_slurm_took_out_are_drained_from_the_run(run_nodes: list[str], state: str, asked: list[str]) -> None:
    assert [n.name for n in drains_to_ask(parse_sinfo(SINFO), run_nodes, state)] == asked


def test_scontrol_node_fields_keep_a_reason_with_spaces() -> None:
    line = "NodeName=c2 NodeAddr=10.0.0.3 AvailableFeatures=gpu,rack-b7 State=IDLE+DRAIN Reason=fan failing [root@x]"
    fields = parse_scontrol_node(line)
    assert (fields["NodeAddr"], fields["AvailableFeatures"]) == ("10.0.0.3", "gpu,rack-b7")
    assert fields["Reason"] == "fan failing [root@x]"
    assert rack_of(fields["AvailableFeatures"], "rack-a") == "rack-b7"
    assert rack_of("gpu,h100", "rack-a") == "rack-a"
