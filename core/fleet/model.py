"""What the fleet knows: every node of one cluster (its state, its run, where its agent's hub
listens), quarantine records, what it has learned from past runs (eviction outcomes, healthy
step-time baselines), the nodes whose GPUs correct the most ECC errors, and its answers to recent
requests.

FleetWorkflow carries `FleetState` whole across continue-as-new, so everything in it is bounded and
it is carried compactly: at 2,048 nodes and every cap full it stays well under a payload's 256 KiB
(tests/core/test_fleet_size.py measures it). The changes to it are in core/fleet/rules.py.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, Field, field_serializer, field_validator
from pydantic_core import to_json

R = TypeVar("R")

BASELINE_WINDOW = 200  # healthy-run window medians kept per config digest
KEEP_BASELINES = 8  # config digests, the most recently taught
KEEP_EVICTIONS = 64  # plenty for P(healthy); older outcomes say little about today's fleet
KEEP_CLOSED_QUARANTINES = 12  # the full story of older ones is in the runs' histories and logs
KEEP_RUNS_PER_QUARANTINE = 8  # run ids listed on one record; older ones are counted
KEEP_SELF_TESTS_PER_QUARANTINE = 4  # results kept on one record; older ones are counted
TEXT_LIMIT = 160  # characters of a reason, note or self-test detail the fleet keeps
# Enough for every agent of a 2,048-node fleet registering at once to find its own answer, twice over.
KEEP_ANSWERS = 4096
KEEP_ECC_TRENDS = 16  # nodes whose corrected-ECC trend the fleet keeps: those with the most errors
KEEP_ECC_POINTS = 8  # readings kept per node: its first and the newest
# Across continue-as-new, which waits until every sender has had time to read its answer, only a
# retry needs one: the newest answers that fit this budget go along.
CARRIED_ANSWER_BYTES = 12 * 1024
MAD_TO_SIGMA = 1.4826  # scales the median absolute deviation to a standard deviation for normal data


class NodeState(StrEnum):
    HEALTHY = "healthy"  # in the pool; may be assigned to a run
    SPARE = "spare"  # healthy, idle, a designated hot spare: agent up and warm, in no group
    SUSPECT = "suspect"  # flagged by a detector; still usable, watched
    QUARANTINED = "quarantined"  # never receives ranks
    TESTING = "testing"  # its self-test is running; never receives ranks either

    @property
    def usable(self) -> bool:
        return self in (NodeState.HEALTHY, NodeState.SPARE, NodeState.SUSPECT)


class FleetNode(BaseModel):
    id: str
    rack: str
    hub: str  # host:port where the node agent's hub listens: how the supervisor's activities reach it
    state: NodeState
    run_id: str | None = None
    since: datetime  # when it entered its current state or assignment
    # A designated hot spare lends itself to a run as HEALTHY and becomes SPARE again when released
    # (or when it passes a self-test), so the designation outlives any one assignment.
    spare: bool = False
    note: str = ""  # why it is suspect


class SelfTestResult(BaseModel):
    node: str
    passed: bool
    checks: dict[str, bool]  # by name (agent/selftest.py): "gemm", "repeatability", …; empty: it never ran
    detail: str
    at: datetime


class Quarantine(BaseModel):
    """One fault of one node: open while the node is out of the pool, closed when it passes a self-test.
    Bounded however long the node stays out: the newest runs and results, and counts of the rest."""

    node: str
    reason: str
    since: datetime
    run_ids_affected: list[str] = []  # the newest KEEP_RUNS_PER_QUARANTINE, oldest first
    earlier_runs: int = 0  # affected runs no longer listed
    released_at: datetime | None = None  # None while the node is out of the pool
    self_tests: list[SelfTestResult] = []  # the newest KEEP_SELF_TESTS_PER_QUARANTINE, oldest first
    earlier_self_tests: int = 0  # results no longer kept

    @property
    def open(self) -> bool:
        return self.released_at is None

    def cause(self) -> str:
        """'crash in rank 3 (run r1)': the reason as a refused run reads it."""
        runs = self.run_ids_affected
        if not runs:
            return self.reason
        earlier = f" and {self.earlier_runs} earlier" if self.earlier_runs else ""
        plural = len(runs) + self.earlier_runs > 1
        return f"{self.reason} ({'runs' if plural else 'run'} {', '.join(runs)}{earlier})"


class EvictionOutcome(BaseModel):
    node: str
    run_id: str
    at: datetime
    resolved: bool  # the run was healthy again after the node was evicted


def p_healthy(outcomes: list[EvictionOutcome], prior_resolved: int = 1, prior_total: int = 2) -> float:
    """The chance that evicting a suspected node makes the run healthy again, from past evictions.

    A Laplace-style prior keeps a short history from deciding alone: with none it is 0.5.
    """
    resolved = sum(o.resolved for o in outcomes)
    return (resolved + prior_resolved) / (len(outcomes) + prior_total)


class Baseline(BaseModel):
    """Step time of healthy runs of one configuration, for the absolute slowness check."""

    config_digest: str
    step_seconds: list[float] = Field(min_length=1)  # window medians, oldest first

    @property
    def median(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def mad(self) -> float:
        """Median absolute deviation, scaled to estimate σ: one slow window cannot move it."""
        center = self.median
        return MAD_TO_SIGMA * statistics.median(abs(s - center) for s in self.step_seconds)


# The published baseline a young fleet starts from: Llama 3 405B, 419 unexpected interruptions in
# 54 days on 16,384 GPUs (3.1 h MTBF at that width), weighing as PRIOR_FAILURES failures.
PUBLISHED_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16_384)
PRIOR_FAILURES = 5


class FailureRate(BaseModel):
    """The fleet's measured failure rate (paging's baseline, docs/architecture.md §12): failures over GPU-hours of runs
    that could fail (running, not idle), summed over every run."""

    gpu_hours: float = 0.0
    failures: int = 0

    def per_gpu_hour(self) -> float:
        """Gamma-Poisson mean with the published rate as its prior: a fleet with little history pages
        by what others measured, and its own history takes over as it grows."""
        prior_hours = PRIOR_FAILURES / PUBLISHED_FAILURES_PER_GPU_HOUR
        return (self.failures + PRIOR_FAILURES) / (self.gpu_hours + prior_hours)

    def mtbf_s(self, gpus: int) -> float:
        """A synchronous job of `gpus` GPUs fails when any of them does: its MTBF in seconds."""
        return 3600.0 / (self.per_gpu_hour() * max(gpus, 1))


class EccTrend(BaseModel):
    """One node's corrected (single-bit) ECC errors over time, summed over its GPUs, as its agent read
    them from NVML. A corrected error costs nothing today, but a count that keeps rising is memory
    wearing out: the history an operator reads before pulling a node, and the one an uncorrectable
    error is read against. The counter is NVML's volatile one (since the driver loaded): a count that
    falls is a reboot, and the trend starts over."""

    node: str
    points: list[tuple[int, int]] = Field(min_length=1)  # (Unix seconds, corrected errors), oldest first

    def per_day(self) -> float:
        """Corrected errors a day from the first reading kept to the newest (0 from one reading)."""
        (t0, c0), (t1, c1) = self.points[0], self.points[-1]
        return (c1 - c0) * 86_400 / (t1 - t0) if t1 > t0 else 0.0

    @property
    def corrected(self) -> int:
        return self.points[-1][1]


class FleetAnswer(BaseModel, Generic[R]):
    """What the fleet answered one request: the operation's result, or why it was refused (then
    nothing changed)."""

    error: str | None = None  # the rule the request broke, in words
    result: R | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class NodeGroup(BaseModel):
    """Nodes alike in state, run, spare designation and note, as FleetState carries them: one row per
    node of what is its own (id, rack, hub, since in Unix seconds). A full model per node would take
    2,048 nodes past a payload's 256 KiB."""

    state: NodeState
    run_id: str | None = None
    spare: bool = False
    note: str = ""
    rows: list[tuple[str, str, str, int]]


class FleetState(BaseModel):
    nodes: dict[str, FleetNode] = {}
    quarantined: dict[str, Quarantine] = {}  # node → its open record: one per node out of the pool
    released: list[Quarantine] = []  # closed records, oldest first
    evictions: list[EvictionOutcome] = []  # oldest first
    baselines: dict[str, Baseline] = {}  # least recently taught first
    failure_rate: FailureRate = FailureRate()
    ecc_trends: dict[str, EccTrend] = {}  # node → its trend: the KEEP_ECC_TRENDS with the most errors
    answers: OrderedDict[str, FleetAnswer[Any]] = OrderedDict()  # request id → its answer, oldest first

    def quarantines(self) -> list[Quarantine]:
        """Every record, closed ones first, each part oldest first."""
        return [*self.released, *self.quarantined.values()]

    def keep_answer(self, request_id: str, answer: FleetAnswer[Any]) -> None:
        self.answers[request_id] = answer
        while len(self.answers) > KEEP_ANSWERS:
            self.answers.popitem(last=False)

    def carried(self) -> FleetState:
        """This state as the next segment gets it: the newest answers within CARRIED_ANSWER_BYTES."""
        kept: list[str] = []
        size = 0
        for request_id in reversed(self.answers):
            size += len(request_id) + len(to_json(self.answers[request_id])) + 6  # quotes, colon, comma
            if size > CARRIED_ANSWER_BYTES:
                break
            kept.append(request_id)
        answers = OrderedDict((request_id, self.answers[request_id]) for request_id in reversed(kept))
        return self.model_copy(update={"answers": answers})

    @field_serializer("nodes")
    def _nodes_as_groups(self, nodes: dict[str, FleetNode]) -> list[NodeGroup]:
        groups: dict[tuple[NodeState, str | None, bool, str], list[tuple[str, str, str, int]]] = {}
        for n in nodes.values():
            row = (n.id, n.rack, n.hub, int(n.since.timestamp()))
            groups.setdefault((n.state, n.run_id, n.spare, n.note), []).append(row)
        return [
            NodeGroup(state=state, run_id=run_id, spare=spare, note=note, rows=rows)
            for (state, run_id, spare, note), rows in groups.items()
        ]

    @field_validator("nodes", mode="before")
    @classmethod
    def _nodes_from_groups(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value  # nodes by id, as built in memory
        nodes = {}
        for group in map(NodeGroup.model_validate, value):
            for node, rack, hub, since in group.rows:
                nodes[node] = FleetNode(
                    id=node,
                    rack=rack,
                    hub=hub,
                    state=group.state,
                    run_id=group.run_id,
                    since=datetime.fromtimestamp(since, UTC),
                    spare=group.spare,
                    note=group.note,
                )
        return nodes
