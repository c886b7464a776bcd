"""Run spec validation: every bad input is rejected with a message naming the field and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from stayalive.core.run.launch import supervision_env
from stayalive.core.run.spec import CheckpointInterval, RunSpec, parse_seconds

ROOT = Path(__file__).resolve().parents[2]


def valid() -> dict[str, object]:
    return {
        "name": "gpt",
        "world_size": 4,
        "ranks_per_node": 2,
        "nodes": ["n1", "n2"],
        "entrypoint": ["python", "-m", "stayalive.training.train"],
        "target_step": 100,
        "checkpoint": {"root": "/tmp/ckpt"},
    }


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.json")), ids=lambda p: p.name)
def test_shipped_examples_are_valid(example: Path) -> None:
    RunSpec.model_validate(json.loads(example.read_text()))


INVALID = [
    ("missing field", {"target_step": None, "name": "gpt"}, "name", None),
    ("world size vs nodes", {"world_size": 6}, "", "set world_size to 4"),
    ("entrypoint as a string", {"entrypoint": "python -m stayalive.training.train"}, "entrypoint", "argv list"),
    ("unknown fault kind", {"faults": [{"kind": "meteor", "rank": 0}]}, "faults.0", "meteor"),
    (
        "fault on a rank that does not exist",
        {"faults": [{"kind": "crash", "rank": 9, "at_step": 5}]},
        "",
        "ranks are 0..3",
    ),
    ("fault after the target", {"faults": [{"kind": "crash", "rank": 0, "at_step": 500}]}, "", "never fires"),
    ("typo in a field", {"chekpoint": {"root": "/x"}}, "chekpoint", None),
    ("node listed twice", {"nodes": ["n1", "n1"]}, "nodes", "list each node once"),
    ("spare also active", {"spare_nodes": ["n2"]}, "", "both nodes and spare_nodes"),
    ("bad name", {"name": "GPT run!"}, "name", "lowercase"),
    ("bad interval", {"checkpoint": {"root": "/x", "interval": "often"}}, "checkpoint.interval", "'auto'"),
    ("negative duration", {"health": {"step_timeout": "-5s"}}, "health.step_timeout", None),
    ("the retired max_restarts", {"max_restarts": 100}, "", "set failure_limit"),
    ("a failure limit of none", {"failure_limit": {"failures": 0}}, "failure_limit.failures", None),
    ("a failure window of none", {"failure_limit": {"window": "0s"}}, "failure_limit.window", None),
    ("a backend torch has not", {"backend": "mpi"}, "backend", None),
    (
        "a fence shorter than a monitor handover",
        {"health": {"node_heartbeat_timeout": "5s", "partition_fence": "8s"}},
        "health",
        "at least node_heartbeat_timeout + 15s (20s)",
    ),
]


@pytest.mark.parametrize(("case", "change", "field", "hint"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_names_the_field_and_the_fix(
    case: str, change: dict[str, object], field: str, hint: str | None
) -> None:
    raw = valid() | change
    if case == "missing field":
        del raw["name"]
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate(raw)
    errors = caught.value.errors()
    assert any(".".join(str(p) for p in e["loc"]).startswith(field) for e in errors), errors
    if hint is not None:
        assert hint in str(caught.value)


@pytest.mark.parametrize("entrypoint", [None, ["python", "my_train.py"]], ids=["built-in trainer", "one's own"])
def test_nccl_is_accepted_for_any_trainer(entrypoint: list[str] | None) -> None:
    """Both put the model on the GPU LOCAL_RANK names (training/accelerator.py)."""
    raw = valid() | {"backend": "nccl"} | ({"entrypoint": entrypoint} if entrypoint else {})
    assert RunSpec.model_validate(raw).backend == "nccl"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, {}),
        ({"backend": "nccl"}, {"STAYALIVE_COLLECTIVE_TIMEOUT": "600", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}),
        (
            {
                "backend": "nccl",
                "health": {"collective_timeout": "90s"},
                "env": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"},
            },
            {"STAYALIVE_COLLECTIVE_TIMEOUT": "90"},
        ),
    ],
    ids=["gloo", "nccl", "nccl, the spec's own error handling"],
)
def test_an_nccl_generation_gets_its_timeout_and_error_handling(
    change: dict[str, object], expected: dict[str, str]
) -> None:
    """A collective that fails raises in its rank, which keeps its process; the spec's own setting wins."""
    spec = RunSpec.model_validate(valid() | change)
    env = spec.env | supervision_env(spec, "r/1", "/ckpt", 0, None, None)
    nccl = {k: v for k, v in env.items() if k in ("STAYALIVE_COLLECTIVE_TIMEOUT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    assert nccl == expected | ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"} if "env" in change else {})


def test_hooks_off_needs_no_target_but_allows_no_faults() -> None:
    plain = valid() | {"hooks": False, "target_step": None}
    assert RunSpec.model_validate(plain).target_step is None
    with pytest.raises(ValidationError, match="needs hooks"):
        RunSpec.model_validate(plain | {"faults": [{"kind": "crash", "rank": 0, "at_step": 5}]})


@pytest.mark.parametrize(
    ("raw", "seconds"), [("90s", 90.0), ("5m", 300.0), ("1.5h", 5400.0), ("250ms", 0.25), (12, 12.0)]
)
def test_durations(raw: object, seconds: float) -> None:
    assert parse_seconds(raw) == seconds


@pytest.mark.parametrize(
    ("raw", "kind", "value"),
    [("auto", "auto", None), ("200 steps", "steps", 200), ("1 step", "steps", 1), ("10m", "seconds", 600)],
)
def test_checkpoint_intervals(raw: str, kind: str, value: float | None) -> None:
    interval = CheckpointInterval.parse(raw)
    assert (interval.kind, interval.value) == (kind, value)
