"""The run spec: everything a user submits to start a run, validated before anything starts.

Every rejection names the field and says what to write instead, because the person reading it
is at a terminal with `temporal workflow start` in their history, not in this file.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, HttpUrl, field_validator, model_validator

from stayalive.core.judgement.detectors import HANG_STARTUP_S
from stayalive.core.run.faults import Fault

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_SCALE = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_STEPS = re.compile(r"^\s*(\d+)\s*steps?\s*$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def parse_seconds(value: object) -> float:
    """'90s', '5m', '1.5h', '250ms' or a plain number of seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '90s', '5m', '2h'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _SCALE[m.group(2)]
    else:
        raise ValueError(f"{value!r} is not a duration: write a number of seconds or '90s', '5m', '2h'")
    if seconds <= 0:
        raise ValueError(f"{value!r} must be longer than zero")
    return seconds


Seconds = Annotated[float, BeforeValidator(parse_seconds)]
# The collective backend the ranks run: each node agent refuses a launch its host cannot run.
Backend = Literal["gloo", "nccl"]


class _Spec(BaseModel):
    # Unknown keys are typos; silently ignoring `chekpoint` would start a run without the user's settings.
    model_config = ConfigDict(extra="forbid", frozen=True)


class CheckpointInterval(_Spec):
    """When ranks checkpoint: every N steps, every T seconds, or `auto` (Young/Daly from measured C and M)."""

    kind: Literal["steps", "seconds", "auto"]
    value: float | None = None

    @classmethod
    def parse(cls, raw: object) -> CheckpointInterval:
        if isinstance(raw, CheckpointInterval | dict):
            return cls.model_validate(raw)
        if raw == "auto":
            return cls(kind="auto")
        if isinstance(raw, str) and (m := _STEPS.match(raw)):
            if int(m.group(1)) < 1:
                raise ValueError("a checkpoint interval in steps must be at least '1 step'")
            return cls(kind="steps", value=int(m.group(1)))
        try:
            return cls(kind="seconds", value=parse_seconds(raw))
        except ValueError:
            raise ValueError(
                f"checkpoint interval {raw!r} is not understood: write 'auto', '200 steps' or a duration like '10m'"
            ) from None

    def __str__(self) -> str:
        if self.kind == "auto":
            return "auto"
        return f"{int(self.value or 0)} steps" if self.kind == "steps" else f"{self.value:g}s"


def argv_not_shell(field: str, value: object) -> object:
    """A command is an argv list: a shell string is refused with the list to write instead."""
    if isinstance(value, str):
        raise ValueError(
            f"{field} must be an argv list, never a shell string: write {json.dumps(value.split())} "
            f"instead of {json.dumps(value)}"
        )
    return value


class CheckpointSpec(_Spec):
    root: str = Field(description="Directory that holds this run's checkpoints (shared by every node).")
    interval: Annotated[CheckpointInterval, BeforeValidator(CheckpointInterval.parse)] = CheckpointInterval(kind="auto")
    min_interval: Seconds = 60.0
    max_interval: Seconds = 6 * 3600.0
    # The MTBF assumed before this run has measured its own (the `auto` interval, paging's failure
    # rate rule). Unset: the fleet's measured failure rate at the run's width.
    prior_mtbf: Seconds | None = None
    validation: list[str] = Field(
        default=[],
        description="A check of your own, as an argv list: the supervisor runs it on every checkpoint after its "
        "own, with the checkpoint's directory as the last argument (e.g. a module that loads it and runs a "
        "forward pass). Exit 0 accepts the checkpoint; any other exit rejects it, with its last line of "
        "stderr as the reason, and a rejected checkpoint is never resumed from. `python` is the supervisor's "
        "interpreter.",
    )

    @field_validator("validation", mode="before")
    @classmethod
    def _validation_is_argv(cls, validation: object) -> object:
        return argv_not_shell("checkpoint.validation", validation)

    @field_validator("root")
    @classmethod
    def _root_not_empty(cls, root: str) -> str:
        if not root.strip():
            raise ValueError("checkpoint.root is empty: give the directory where checkpoints are written")
        return root

    @model_validator(mode="after")
    def _bounds_ordered(self) -> CheckpointSpec:
        if self.min_interval > self.max_interval:
            raise ValueError(
                f"checkpoint.min_interval ({self.min_interval:g}s) is longer than checkpoint.max_interval "
                f"({self.max_interval:g}s): swap them"
            )
        return self


class SdcSpec(_Spec):
    """Silent data corruption checks (docs/architecture.md §10)."""

    enabled: bool = True  # off: no invariants, replays or cross-checks (what bench/sdc.py compares against)
    # Every N steps one rank (rotating) replays its micro-batch and compares bitwise: 1% of compute buys
    # a detection latency that keeps every checkpoint but the newest verified (docs/architecture.md §16).
    self_check_every: int = Field(default=100, ge=1)
    # Every ~10N steps two ranks compute the same micro-batch: catches a deterministically wrong GPU.
    cross_check_every: int = Field(default=1000, ge=1)
    # The largest relative gradient difference two healthy ranks may show; "auto": 5 × the spread the
    # ranks show on one calibration batch at start-up, at least 1e-6.
    cross_check_tolerance: Literal["auto"] | float = "auto"
    grad_spike_factor: float = Field(default=10.0, gt=1.0)  # × the running p99 of the gradient norm


class PagingSpec(_Spec):
    """Where pages go besides the structured log (docs/architecture.md §12). Every interruption is written to the
    JSONL file, the independent ones too: that file is the daily digest. Only CORRELATED and
    DETERMINISTIC pages go to the webhook."""

    jsonl: str | None = None  # a path on the supervisor worker's host
    webhook: HttpUrl | None = None  # receives each page as a JSON POST, retried; never blocks the run
    # When the run ends, how long pages still on their way to the webhook may take before they are
    # given up (each is in the JSONL digest): nothing of a closed run is left running.
    webhook_grace: Seconds = 30.0


# The longest a live run monitor's readers may be away: its activity's heartbeat timeout (workflows/calls.py)
# plus a worker's pick-up of the retry.
MONITOR_HANDOVER_S = 15.0


class HealthSpec(_Spec):
    step_timeout: Literal["auto"] | Seconds = "auto"  # auto: 3 × p99 of the step time, at least 10 s
    # How long a generation may take to its first step (imports, rendezvous, a checkpoint's load,
    # compilation, cold caches) before it counts as hung; the step timeout holds from then on.
    startup_timeout: Seconds = HANG_STARTUP_S
    straggler_sigma: float = Field(default=3.0, gt=0)  # robust z of a rank's compute time (docs/architecture.md §9)
    straggler_steps: int = Field(default=20, ge=1)  # ... for this many consecutive steps
    baseline_windows: int = Field(default=10, ge=1)  # healthy 50-step windows reported to the fleet at a time
    # How often a known straggler's or slowdown's cost so far reaches the workflow (the goodput ledger).
    slowness_tally: Seconds = 30.0
    # While the ranks step and nothing else is reported: how often the run's numbers (step, loss, step
    # times, slowest rank) reach the workflow, so `health`, /metrics and the web UI's details are never
    # older than this (plus a signal's delivery). One signal each: about 4 history events, whatever the
    # step rate or the width.
    progress_refresh: Seconds = 30.0
    # How long a node agent may stay silent before its node counts as dead.
    node_heartbeat_timeout: Seconds = 15.0
    # How long a node agent whose ranks run may go unread by the run's monitor before it takes itself
    # for cut off: it stops the run's ranks there and reports a partition when it can (core/decisions/fencing.py).
    # Longer than the heartbeat timeout, so the run has taken the node for lost first.
    partition_fence: Seconds = 60.0
    # NCCL (backend nccl): a collective that has not completed in this long is aborted by NCCL's
    # watchdog and fails in its rank (training/accelerator.py), a hang the run's monitor missed included.
    collective_timeout: Seconds = 600.0
    # Once a rank has finished (exited cleanly, or said it reached the target), how long the others
    # have to exit. Those still running then are stopped and the run completes: a process that
    # lingers after its work (stuck in a destructor at exit) must not hold a finished run open.
    exit_grace: Seconds = Field(default=30.0, gt=0)
    # Once the server suggests continue-as-new, a run does it where the next generation starts; a
    # healthy generation that runs on this long past the suggestion continues as new in its middle,
    # the next workflow segment re-attaching to the running ranks (no restart, no step lost).
    reattach_after: Seconds = 600.0

    @model_validator(mode="after")
    def _fence_outlasts_a_monitor_handover(self) -> HealthSpec:
        # A run monitor whose worker died is read again only once its activity's heartbeat timeout
        # (10 s) has passed and a worker has picked it up: every agent goes unread that long, alive
        # and connected. A fence shorter than that stops healthy nodes' ranks as if cut off.
        least = self.node_heartbeat_timeout + MONITOR_HANDOVER_S
        if self.partition_fence < least:
            raise ValueError(
                f"health.partition_fence ({self.partition_fence:g}s) must be at least node_heartbeat_timeout + "
                f"{MONITOR_HANDOVER_S:g}s ({least:g}s): a monitor replaced after its worker died reads the nodes "
                "again only after that long, and a shorter fence would stop healthy nodes. Raise it"
            )
        return self


class FailureLimit(_Spec):
    """When a run gives up (FAILED): more than `failures` failures within any `window`. A rate, not a
    count: at 16,384 GPUs a month brings ~233 failures (Llama 3's rate), and no run may die of its length.
    Drains, pauses and rollbacks were asked for and never count. The default gives up when failures
    come ten times faster than Llama 3's 3.1 h MTBF for six hours: restarts then eat the run
    (docs/architecture.md §6, §16)."""

    failures: int = Field(default=20, ge=1)
    window: Seconds = 6 * 3600.0


class RunSpec(_Spec):
    """A training run. `nodes × ranks_per_node` ranks train; `spare_nodes` wait, warm, to replace one."""

    name: str
    world_size: int = Field(ge=1)
    ranks_per_node: int = Field(ge=1)
    nodes: list[str] = Field(min_length=1)
    spare_nodes: list[str] = []
    min_nodes: int = Field(default=1, ge=1, description="Below this many nodes the run waits for one to come back.")
    entrypoint: list[str] = Field(min_length=1)
    workdir: str | None = Field(
        default=None,
        description="The entrypoint's working directory on every node (relative: to the node agent's), as "
        "torchrun's is wherever it was started; by default the agent's.",
    )
    env: dict[str, str] = {}
    hooks: bool = Field(
        default=True,
        description="The entrypoint uses training.supervision (step telemetry, control commands, stayalive "
        "checkpoints). False runs any torchrun script the way `torchrun --max-restarts` would.",
    )
    backend: Backend = "gloo"
    target_step: int | None = Field(default=None, ge=1, description="Required with hooks; a plain script stops itself.")
    checkpoint: CheckpointSpec
    health: HealthSpec = HealthSpec()
    sdc: SdcSpec = SdcSpec()
    paging: PagingSpec = PagingSpec()
    failure_limit: FailureLimit = FailureLimit()
    faults: list[Fault] = []

    @model_validator(mode="before")
    @classmethod
    def _no_max_restarts(cls, raw: object) -> object:
        if isinstance(raw, dict) and "max_restarts" in raw:
            raise ValueError(
                "max_restarts is gone: a count of restarts fails every long run at scale. Remove it and, if "
                "the default (20 failures within 6h) does not suit, set failure_limit, e.g. "
                '{"failures": 20, "window": "6h"}'
            )
        return raw

    @field_validator("name")
    @classmethod
    def _name_is_an_id(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(
                f"name {name!r} must be lowercase letters, digits, '.', '_' or '-' (it becomes the workflow id "
                "and a directory name), e.g. 'gpt-small'"
            )
        return name

    @field_validator("entrypoint", mode="before")
    @classmethod
    def _entrypoint_is_argv(cls, entrypoint: object) -> object:
        return argv_not_shell("entrypoint", entrypoint)

    @field_validator("nodes", "spare_nodes")
    @classmethod
    def _node_ids(cls, nodes: list[str]) -> list[str]:
        for node in nodes:
            if not _NAME.match(node):
                raise ValueError(f"node id {node!r} must be lowercase letters, digits, '.', '_' or '-'")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node ids repeat in {nodes}: list each node once")
        return nodes

    @model_validator(mode="after")
    def _consistent(self) -> RunSpec:
        ranks = len(self.nodes) * self.ranks_per_node
        if ranks != self.world_size:
            raise ValueError(
                f"world_size is {self.world_size} but {len(self.nodes)} nodes × ranks_per_node "
                f"{self.ranks_per_node} give {ranks} ranks: set world_size to {ranks}, or change nodes"
            )
        if self.min_nodes > len(self.nodes):
            raise ValueError(f"min_nodes {self.min_nodes} is more than the {len(self.nodes)} nodes listed: lower it")
        if self.hooks and self.target_step is None:
            raise ValueError("target_step is missing: a run with hooks trains to a target step (e.g. 1000)")
        if overlap := set(self.nodes) & set(self.spare_nodes):
            raise ValueError(f"{sorted(overlap)} are listed in both nodes and spare_nodes: a spare is not in the group")
        for fault in self.faults:
            if (node := getattr(fault, "node", None)) is not None and node not in self.nodes + self.spare_nodes:
                raise ValueError(f"fault {fault.kind} targets node {node}, which is neither in nodes nor spare_nodes")
            if (rank := getattr(fault, "rank", None)) is not None and rank >= self.world_size:
                raise ValueError(f"fault {fault.kind} targets rank {rank}, but ranks are 0..{self.world_size - 1}")
            if not self.hooks:
                raise ValueError(f"fault {fault.kind} needs hooks: a plain script has no stayalive fault injection")
            if (step := getattr(fault, "at_step", None)) is not None and step > (self.target_step or 0):
                raise ValueError(
                    f"fault {fault.kind} at step {step} never fires: the run stops at target_step {self.target_step}"
                )
        return self

    @property
    def config_digest(self) -> str:
        """Identity of the training job for step-time baselines: same code and per-node shape, same digest."""
        job = {"entrypoint": self.entrypoint, "workdir": self.workdir, "env": self.env}
        key = json.dumps(job | {"ranks_per_node": self.ranks_per_node})
        return hashlib.sha256(key.encode()).hexdigest()[:16]
