"""The fleet: every node of one cluster, which run holds it, which are quarantined and why, and what
the fleet has learned from past runs (eviction outcomes, healthy step-time baselines).

Pure: FleetWorkflow calls these functions from workflow code and carries `FleetState` whole across
continue-as-new. A function either applies its change or raises `FleetError` with a message for the
person (or run) that asked, and the workflow's validators call the same checks before accepting.
"""

from __future__ import annotations

import math
import re
import statistics
from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, Field

# The same rule as RunSpec's node ids: an id names a task queue (`node.<id>`) and a directory.
_NODE_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
BASELINE_WINDOW = 200  # healthy-run window medians kept per config digest
# The state rides along every continue-as-new: history lists are capped so it never outgrows a payload.
KEEP_EVICTIONS = 1000
KEEP_CLOSED_QUARANTINES = 500
MAD_TO_SIGMA = 1.4826  # scales the median absolute deviation to a standard deviation for normal data


class FleetError(ValueError):
    """A request the fleet cannot carry out, with the reason in words."""


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
    checks: dict[str, bool]  # "gemm", "repeatability", "collective"; empty when the test never ran
    detail: str
    at: datetime


class Quarantine(BaseModel):
    node: str
    reason: str
    since: datetime
    run_ids_affected: list[str] = []
    released_at: datetime | None = None  # None while the node is out of the pool
    self_tests: list[SelfTestResult] = []

    @property
    def open(self) -> bool:
        return self.released_at is None

    def cause(self) -> str:
        """'crash in rank 3 (run r1)': the reason as a refused run reads it."""
        runs = self.run_ids_affected
        if not runs:
            return self.reason
        return f"{self.reason} ({'run' if len(runs) == 1 else 'runs'} {', '.join(runs)})"


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


class FleetState(BaseModel):
    nodes: dict[str, FleetNode] = {}
    quarantines: list[Quarantine] = []
    evictions: list[EvictionOutcome] = []
    baselines: dict[str, Baseline] = {}

    def open_quarantine(self, node: str) -> Quarantine | None:
        return next((q for q in reversed(self.quarantines) if q.node == node and q.open), None)


# -- checks: each change below starts with its check, and FleetWorkflow's validators call the same
# one, so a request is refused before the workflow accepts it, never half-way through.


def check_run_id(run_id: str) -> None:
    if not run_id.strip():
        raise FleetError("run_id is empty: name the run the request is for")


def known(state: FleetState, node: str) -> FleetNode:
    if node not in state.nodes:
        registered = ", ".join(sorted(state.nodes)) or "none yet"
        raise FleetError(f"{node!r} is not a node of this fleet (registered: {registered})")
    return state.nodes[node]


def check_register(node: str, rack: str) -> None:
    if not _NODE_ID.match(node):
        raise FleetError(f"node id {node!r} must be lowercase letters, digits, '.', '_' or '-', e.g. 'n1'")
    if not rack.strip():
        raise FleetError(f"{node}: rack is empty; give the rack the node sits in")


def check_acquire(run_id: str, wanted: list[str]) -> None:
    check_run_id(run_id)
    if not wanted:
        raise FleetError(f"{run_id}: no nodes wanted; list the nodes the run needs")


def check_suspect(state: FleetState, node: str, reason: str) -> FleetNode:
    entry = known(state, node)
    if not reason.strip():
        raise FleetError(f"{node}: the reason is empty; say what the detector saw (e.g. 'slow steps, 2.1σ')")
    return entry


def check_quarantine(state: FleetState, node: str, reason: str, run_id: str | None) -> FleetNode:
    entry = known(state, node)
    if not reason.strip():
        raise FleetError(f"{node}: the quarantine reason is empty; say what was seen (e.g. 'crash in rank 3')")
    if run_id is not None:
        check_run_id(run_id)
    return entry


def check_quarantined(state: FleetState, node: str) -> FleetNode:
    """Only a quarantined node is self-tested, and one test at a time."""
    entry = known(state, node)
    if entry.state == NodeState.TESTING:
        raise FleetError(f"{node} is already being self-tested")
    if entry.state != NodeState.QUARANTINED:
        raise FleetError(f"{node} is {entry.state}: only a quarantined node is self-tested")
    return entry


def check_eviction(state: FleetState, node: str, run_id: str) -> None:
    known(state, node)
    check_run_id(run_id)


def check_baseline(config_digest: str, step_seconds: float) -> None:
    if not config_digest.strip():
        raise FleetError("config_digest is empty: give the run spec's config_digest")
    if not (math.isfinite(step_seconds) and step_seconds > 0):
        raise FleetError(f"step_seconds {step_seconds!r} is not a step time: give a positive number of seconds")


# -- the pool --------------------------------------------------------------------------------------


def register(state: FleetState, node: str, rack: str, spare: bool, now: datetime) -> FleetNode:
    """A node agent announces itself (at every start-up). A known node keeps its state and run:
    restarting an agent neither clears a quarantine nor takes a node from its run."""
    check_register(node, rack)
    entry = state.nodes.get(node)
    if entry is None:
        entry = state.nodes[node] = FleetNode(id=node, rack=rack, state=NodeState.HEALTHY, since=now)
    entry.rack, entry.spare = rack, spare
    if entry.state in (NodeState.HEALTHY, NodeState.SPARE) and entry.run_id is None:
        _move(entry, _idle_state(entry), now)
    return entry


def acquire(state: FleetState, run_id: str, wanted: list[str], now: datetime) -> tuple[list[str], dict[str, str]]:
    """Assign to `run_id` each wanted node that is usable and free (or already its own).

    Returns the granted nodes and, for each refused one, the reason. The grant is partial: the run
    decides whether to go ahead, take spares or give the nodes back.
    """
    check_acquire(run_id, wanted)
    granted, refused = [], {}
    for node in dict.fromkeys(wanted):
        entry = state.nodes.get(node)
        if entry is None:
            refused[node] = f"{node} is not registered: its node agent has not started"
        elif reason := _unavailable(state, entry, run_id):
            refused[node] = reason
        else:
            _assign(entry, run_id, now)
            granted.append(node)
    return granted, refused


def take_spare(state: FleetState, run_id: str, candidates: list[str], now: datetime) -> str | None:
    """Assign the first candidate that is a spare or idle healthy node; None if none is.

    Unknown candidates are skipped, not refused: a listed spare whose agent never started is simply
    not available, and the run still wants the next one. A candidate already assigned to this run is
    taken again: candidates are nodes outside the run's group, so an earlier attempt of this same
    request (a local activity run again after its workflow task failed) took it.
    """
    check_run_id(run_id)
    for node in candidates:
        entry = state.nodes.get(node)
        if entry is not None and entry.run_id in (None, run_id) and entry.state in (NodeState.SPARE, NodeState.HEALTHY):
            _assign(entry, run_id, now)
            return node
    return None


def release(state: FleetState, run_id: str, now: datetime) -> list[str]:
    """Unassign every node of the run; a designated spare becomes SPARE again. Returns the nodes."""
    check_run_id(run_id)
    released = sorted(n.id for n in state.nodes.values() if n.run_id == run_id)
    for node in released:
        entry = state.nodes[node]
        entry.run_id = None
        if entry.state == NodeState.HEALTHY:
            _move(entry, _idle_state(entry), now)
        else:
            entry.since = now
    return released


def mark_suspect(state: FleetState, node: str, reason: str, now: datetime) -> FleetNode:
    """A detector flags the node: it stays in its run and the pool, watched. A node already out of
    the pool stays out."""
    entry = check_suspect(state, node, reason)
    if entry.state.usable:
        _move(entry, NodeState.SUSPECT, now)
        entry.note = reason
    return entry


# -- quarantine and self-test ----------------------------------------------------------------------


def quarantine(state: FleetState, node: str, reason: str, run_id: str | None, now: datetime) -> Quarantine:
    """Take the node out of the pool. A node already out (quarantined or under test) keeps its one
    open record, which gains the run id: one fault, one record, every run it hurt."""
    entry = check_quarantine(state, node, reason, run_id)
    record = state.open_quarantine(node)
    if record is None:
        record = Quarantine(node=node, reason=reason, since=now)
        state.quarantines.append(record)
    # The run holding the node loses it too, even when someone else reported the fault.
    for affected in (run_id, entry.run_id):
        if affected is not None and affected not in record.run_ids_affected:
            record.run_ids_affected.append(affected)
    entry.run_id = None
    if entry.state != NodeState.TESTING:
        _move(entry, NodeState.QUARANTINED, now)
    return record


def start_self_test(state: FleetState, node: str, now: datetime) -> None:
    _move(check_quarantined(state, node), NodeState.TESTING, now)


def finish_self_test(state: FleetState, result: SelfTestResult, now: datetime) -> Quarantine:
    """A passed test returns the node to the pool (as a spare if it is one) and closes its record;
    a failed one (or one that never ran) keeps it quarantined with the result on its record."""
    entry = known(state, result.node)
    if entry.state != NodeState.TESTING:
        raise FleetError(f"{result.node} is {entry.state}, not under test: a self-test result has nowhere to go")
    record = state.open_quarantine(result.node)
    assert record is not None, f"{result.node} is under test without an open quarantine"
    record.self_tests.append(result)
    if result.passed:
        record.released_at = now
        entry.note = ""
        _move(entry, _idle_state(entry), now)
        _trim_closed_quarantines(state)
    else:
        _move(entry, NodeState.QUARANTINED, now)
    return record


# -- what the fleet learns -------------------------------------------------------------------------


def record_eviction(state: FleetState, node: str, run_id: str, resolved: bool, now: datetime) -> EvictionOutcome:
    check_eviction(state, node, run_id)
    outcome = EvictionOutcome(node=node, run_id=run_id, at=now, resolved=resolved)
    state.evictions.append(outcome)
    del state.evictions[:-KEEP_EVICTIONS]
    return outcome


def record_baseline(state: FleetState, config_digest: str, step_seconds: float) -> Baseline:
    """Add one healthy window's median step time; the newest BASELINE_WINDOW are kept."""
    check_baseline(config_digest, step_seconds)
    baseline = state.baselines.get(config_digest)
    if baseline is None:
        baseline = state.baselines[config_digest] = Baseline(config_digest=config_digest, step_seconds=[step_seconds])
    else:
        baseline.step_seconds.append(step_seconds)
        del baseline.step_seconds[:-BASELINE_WINDOW]
    return baseline


# -- helpers ---------------------------------------------------------------------------------------


def _unavailable(state: FleetState, entry: FleetNode, run_id: str) -> str | None:
    if entry.state in (NodeState.QUARANTINED, NodeState.TESTING):
        record = state.open_quarantine(entry.id)
        cause = record.cause() if record else "no record"
        doing = "quarantined" if entry.state == NodeState.QUARANTINED else "under self-test after quarantine"
        return f"{entry.id} is {doing}: {cause}"
    if entry.run_id is not None and entry.run_id != run_id:
        return f"{entry.id} is running {entry.run_id}"
    return None


def _assign(entry: FleetNode, run_id: str, now: datetime) -> None:
    if entry.run_id == run_id:
        return  # already this run's (a retried request)
    entry.run_id = run_id
    entry.since = now
    if entry.state == NodeState.SPARE:
        entry.state = NodeState.HEALTHY


def _idle_state(entry: FleetNode) -> NodeState:
    return NodeState.SPARE if entry.spare else NodeState.HEALTHY


def _move(entry: FleetNode, to: NodeState, now: datetime) -> None:
    if entry.state != to:
        entry.state = to
        entry.since = now


def _trim_closed_quarantines(state: FleetState) -> None:
    """Drop the oldest closed records beyond KEEP_CLOSED_QUARANTINES; open ones always stay."""
    excess = sum(not q.open for q in state.quarantines) - KEEP_CLOSED_QUARANTINES
    kept = []
    for record in state.quarantines:
        if excess > 0 and not record.open:
            excess -= 1
        else:
            kept.append(record)
    state.quarantines = kept
