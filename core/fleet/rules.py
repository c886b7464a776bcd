"""The fleet's rules: each change a request may make to `FleetState` (core/fleet/model.py), and the check
that refuses it.

Pure: FleetWorkflow calls these from workflow code. A function either applies its change or raises
`FleetError` with a message for the person (or run) that asked, before it changes anything. Each
costs the size of its request, not of the fleet, except `release`, which looks for the run's nodes.
"""

from __future__ import annotations

import itertools
import math
import re
from datetime import datetime
from typing import TypeVar

from stayalive.core.fleet.model import (
    BASELINE_WINDOW,
    KEEP_BASELINES,
    KEEP_CLOSED_QUARANTINES,
    KEEP_ECC_POINTS,
    KEEP_ECC_TRENDS,
    KEEP_EVICTIONS,
    KEEP_RUNS_PER_QUARANTINE,
    KEEP_SELF_TESTS_PER_QUARANTINE,
    TEXT_LIMIT,
    Baseline,
    EccTrend,
    EvictionOutcome,
    FailureRate,
    FleetNode,
    FleetState,
    NodeState,
    Quarantine,
    SelfTestResult,
)

# The same rule as RunSpec's node ids: an id names a task queue (`node.<id>`) and a directory.
_NODE_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_HUB = re.compile(r"^\S+:\d{1,5}$")
NAMED_IN_ERRORS = 8  # registered nodes an "unknown node" message lists
T = TypeVar("T")


class FleetError(ValueError):
    """A request the fleet cannot carry out, with the reason in words."""


# -- checks: each change below starts with its check, so a refused request changed nothing ----------


def check_run_id(run_id: str) -> None:
    if not run_id.strip():
        raise FleetError("run_id is empty: name the run the request is for")


def known(state: FleetState, node: str) -> FleetNode:
    if node not in state.nodes:
        listed = ", ".join(itertools.islice(state.nodes, NAMED_IN_ERRORS))
        more = len(state.nodes) - NAMED_IN_ERRORS
        registered = (listed + (f", … {more} more" if more > 0 else "")) or "none yet"
        raise FleetError(f"{node!r} is not a node of this fleet (registered: {registered})")
    return state.nodes[node]


def check_register(node: str, rack: str, hub: str) -> None:
    if not _NODE_ID.match(node):
        raise FleetError(f"node id {node!r} must be lowercase letters, digits, '.', '_' or '-', e.g. 'n1'")
    if not rack.strip():
        raise FleetError(f"{node}: rack is empty; give the rack the node sits in")
    if not _HUB.match(hub):
        raise FleetError(f"{node}: hub {hub!r} is not host:port; give the address the node agent's hub listens on")


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


def check_baseline(config_digest: str, step_seconds: list[float]) -> None:
    if not config_digest.strip():
        raise FleetError("config_digest is empty: give the run spec's config_digest")
    if not step_seconds:
        raise FleetError(f"{config_digest}: no step times; give the median of at least one healthy window")
    for seconds in step_seconds:
        if not (math.isfinite(seconds) and seconds > 0):
            raise FleetError(f"step_seconds {seconds!r} is not a step time: give a positive number of seconds")


# -- the pool --------------------------------------------------------------------------------------


def register(state: FleetState, node: str, rack: str, hub: str, spare: bool, now: datetime) -> FleetNode:
    """A node agent announces itself and where its hub listens (at every start-up). A known node keeps
    its state and run: restarting an agent neither clears a quarantine nor takes a node from its run."""
    check_register(node, rack, hub)
    entry = state.nodes.get(node)
    if entry is None:
        entry = state.nodes[node] = FleetNode(id=node, rack=rack, hub=hub, state=NodeState.HEALTHY, since=now)
    entry.rack, entry.hub, entry.spare = rack, hub, spare
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
    request took it.
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
        entry.note = _brief(reason)
    return entry


# -- quarantine and self-test ----------------------------------------------------------------------


def quarantine(state: FleetState, node: str, reason: str, run_id: str | None, now: datetime) -> Quarantine:
    """Take the node out of the pool. A node already out (quarantined or under test) keeps its one
    open record, which gains the run id: one fault, one record, every run it hurt."""
    entry = check_quarantine(state, node, reason, run_id)
    record = state.quarantined.get(node)
    if record is None:
        record = state.quarantined[node] = Quarantine(node=node, reason=_brief(reason), since=now)
    # The run holding the node loses it too, even when someone else reported the fault.
    for affected in (run_id, entry.run_id):
        if affected is not None and affected not in record.run_ids_affected:
            record.run_ids_affected.append(affected)
    record.earlier_runs += _drop_oldest(record.run_ids_affected, KEEP_RUNS_PER_QUARANTINE)
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
    record = state.quarantined[result.node]  # a node under test always has its open record
    record.self_tests.append(result.model_copy(update={"detail": _brief(result.detail)}))
    record.earlier_self_tests += _drop_oldest(record.self_tests, KEEP_SELF_TESTS_PER_QUARANTINE)
    if result.passed:
        record.released_at = now
        state.released.append(state.quarantined.pop(result.node))
        _drop_oldest(state.released, KEEP_CLOSED_QUARANTINES)
        entry.note = ""
        _move(entry, _idle_state(entry), now)
    else:
        _move(entry, NodeState.QUARANTINED, now)
    return record


# -- what the fleet learns -------------------------------------------------------------------------


def record_eviction(state: FleetState, node: str, run_id: str, resolved: bool, now: datetime) -> EvictionOutcome:
    check_eviction(state, node, run_id)
    outcome = EvictionOutcome(node=node, run_id=run_id, at=now, resolved=resolved)
    state.evictions.append(outcome)
    _drop_oldest(state.evictions, KEEP_EVICTIONS)
    return outcome


def record_baseline(state: FleetState, config_digest: str, step_seconds: list[float]) -> Baseline:
    """Add healthy windows' median step times; the newest BASELINE_WINDOW are kept, for the
    KEEP_BASELINES configurations taught most recently. Kept to the microsecond: plenty for a step
    time, and a third of the bytes of a full float."""
    check_baseline(config_digest, step_seconds)
    medians = [round(seconds, 6) for seconds in step_seconds]
    baseline = state.baselines.pop(config_digest, None)  # taught now: it moves to the newest end
    if baseline is None:
        baseline = Baseline(config_digest=config_digest, step_seconds=medians)
    else:
        baseline.step_seconds.extend(medians)
        _drop_oldest(baseline.step_seconds, BASELINE_WINDOW)
    state.baselines[config_digest] = baseline
    for stale in list(state.baselines)[:-KEEP_BASELINES]:
        del state.baselines[stale]
    return baseline


def record_exposure(state: FleetState, gpu_hours: float, failures: int) -> FailureRate:
    """A run's exposure since its last report joins the fleet's failure rate."""
    rate = state.failure_rate
    rate.gpu_hours += gpu_hours
    rate.failures += failures
    return rate


def record_corrected_errors(state: FleetState, node: str, at: datetime, corrected: int) -> EccTrend | None:
    """A node's count of corrected ECC errors joins its trend; its first reading stays, so the rate
    spans the whole trend. The fleet keeps the KEEP_ECC_TRENDS nodes with the most errors: answered
    with the node's trend, or None when it has too few to be kept. A reading no newer than the trend's
    newest (a retry, a late one) changes nothing."""
    known(state, node)
    reading = (int(at.timestamp()), corrected)
    trend = state.ecc_trends.get(node)
    if trend is not None and reading[0] <= trend.points[-1][0]:
        return trend
    if trend is None or corrected < trend.corrected:  # the first, or the driver reloaded: a new count
        trend = state.ecc_trends[node] = EccTrend(node=node, points=[reading])
    else:
        trend.points.append(reading)
        del trend.points[1 : -(KEEP_ECC_POINTS - 1)]
    if len(state.ecc_trends) > KEEP_ECC_TRENDS:
        fewest = min(state.ecc_trends.values(), key=lambda t: (t.corrected, t.points[-1][0]))
        del state.ecc_trends[fewest.node]
    return state.ecc_trends.get(node)


# -- helpers ---------------------------------------------------------------------------------------


def _unavailable(state: FleetState, entry: FleetNode, run_id: str) -> str | None:
    if entry.state in (NodeState.QUARANTINED, NodeState.TESTING):
        record = state.quarantined.get(entry.id)
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


def _drop_oldest(items: list[T], keep: int) -> int:
    """Keep the newest `keep` items of an oldest-first list; returns how many were dropped."""
    dropped = max(0, len(items) - keep)
    del items[:dropped]
    return dropped


def _brief(text: str) -> str:
    """Free text as the fleet keeps it: at most TEXT_LIMIT characters, so every record stays bounded."""
    return text if len(text) <= TEXT_LIMIT else text[: TEXT_LIMIT - 1] + "…"
