"""FleetWorkflow: the node pool of one cluster, an entity workflow that never ends on its own.

It answers which nodes a run may have, knows where each node agent's hub listens, takes a faulty
node out of the pool and lets it back in only after the node passes a self-test, and keeps what the
fleet learns across runs: eviction outcomes and healthy step-time baselines.

Every change arrives as one `request` signal (core/fleet/requests.py) and is answered under the
request's id, for the `answers` query; activities/fleet.py's FleetClient sends requests and waits for
their answers. A signal because a whole fleet's agents register at once and a workflow takes at most 10
updates in flight. The handler does not await: each request is applied within its activation by
core/fleet/rules.py, whose checks come first, so a refused request changes nothing and none
interleave. A request costs the size of the request, never of the fleet, and the web UI's details
are drawn once per activation, however many requests it applied. The only thing that waits is a
self-test, which runs as a background task and touches the state once, when its result is in.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel
    from pydantic_core import to_jsonable_python

    from stayalive.core.fleet import rules
    from stayalive.core.fleet.model import (
        Baseline,
        EccTrend,
        EvictionOutcome,
        FailureRate,
        FleetAnswer,
        FleetNode,
        FleetState,
        NodeState,
        Quarantine,
        SelfTestResult,
    )
    from stayalive.core.fleet.requests import (
        Acquire,
        FleetOperation,
        FleetRequest,
        Grant,
        MarkSuspect,
        QuarantineNode,
        RecordCorrectedErrors,
        RecordEviction,
        RecordExposure,
        RecordWindows,
        RegisterNode,
        Release,
        Replace,
        Replacement,
        Retest,
        SelfTestInput,
        TakeSpare,
        fleet_id,
    )
    from stayalive.core.fleet.rules import FleetError

SHOWN_PER_STATE = 8  # node ids listed per state in the web UI's current details
# Before continuing as new, the fleet waits this long without a request: a run's activities (looking
# at least every second) have read their answers by then. A node agent's ECC report looks less often
# (activities/fleet.py PATIENT): its answer may be among those carried, or it asks again with the same
# id, and a reading applied twice changes nothing. Registrations wait for no answer.
ANSWER_GRACE = timedelta(seconds=5)
# ...but not for ever: requests that never pause (a whole cluster's agents registering) would carry the
# history to the server's hard limits (10,000 signals, 51,200 events), after which it refuses every
# request. Past this many events the fleet hands over at once.
HANDOVER_HISTORY = 8_000


class FleetInput(BaseModel):
    state: FleetState | None = None  # None: a new, empty fleet; else what the last segment carried
    # A node agent its self-test cannot reach within this long is down: the node stays quarantined.
    self_test_pickup_seconds: float = 300.0
    max_history: int | None = None  # for tests: continue-as-new past this many history events
    handover_history: int = HANDOVER_HISTORY  # for tests: past this many, without waiting for a quiet moment


# Unsandboxed: the sandbox costs about 250 µs per signal on two cores (its proxies in the SDK's own
# handling of each job), which at 2,048 registrations in one workflow task is more than the rest of the
# task together (measured: 1.1-1.3 s sandboxed, 0.5-0.7 s not). This module is small, imports only
# core's pure models and rules, and reads time and randomness only through `workflow`.
@workflow.defn(sandboxed=False)
class FleetWorkflow:
    @workflow.init
    def __init__(self, input: FleetInput) -> None:
        self.fleet = input.state or FleetState()
        self.settings = input
        self.self_tests: dict[str, asyncio.Task[None]] = {}  # node → its self-test in flight
        self.changed = True  # the web UI's details are out of date
        self.last_request_at = workflow.now()

    @workflow.run
    async def run(self, input: FleetInput) -> None:
        self.redrawing = asyncio.create_task(self._show_changes())  # held here: an unheld task may be collected
        await workflow.wait_condition(self._history_is_long)
        await self._settle()
        workflow.logger.info("continuing as new with %d nodes", len(self.fleet.nodes))
        workflow.continue_as_new(self.settings.model_copy(update={"state": self.fleet.carried()}))

    # -- requests -------------------------------------------------------------------------------

    @workflow.signal
    def request(self, request: FleetRequest) -> None:
        """Every change to the fleet. A request already answered (a retry) is not applied again."""
        if request.id in self.fleet.answers:
            return
        self.fleet.keep_answer(request.id, self._answer(request.op))
        self.last_request_at = workflow.now()
        self.changed = True

    def _answer(self, op: FleetOperation) -> FleetAnswer[Any]:
        try:
            result = self._apply(op, self._now())
        except FleetError as refused:
            return FleetAnswer(error=str(refused))
        return FleetAnswer(result=to_jsonable_python(result))

    def _apply(self, op: FleetOperation, now: datetime) -> object:
        fleet = self.fleet
        match op:
            case RegisterNode():
                return self._register(op, now)
            case Acquire():
                granted, refused = rules.acquire(fleet, op.run_id, op.wanted, now)
                return Grant(granted=granted, refused=refused)
            case TakeSpare():
                return rules.take_spare(fleet, op.run_id, op.candidates, now)
            case Replace():
                record = self._quarantine(op.node, op.reason, op.run_id, now)
                # The quarantine checked the run id, take_spare's only check: a refused replace changed nothing.
                return Replacement(quarantine=record, spare=rules.take_spare(fleet, op.run_id, op.candidates, now))
            case Release():
                return rules.release(fleet, op.run_id, now)
            case MarkSuspect():
                return rules.mark_suspect(fleet, op.node, op.reason, now)
            case QuarantineNode():
                return self._quarantine(op.node, op.reason, op.run_id, now)
            case Retest():
                self._start_self_test(op.node, now, "retest requested; ")
                return None
            case RecordEviction():
                return rules.record_eviction(fleet, op.node, op.run_id, op.resolved, now)
            case RecordWindows():
                rules.record_baseline(fleet, op.config_digest, op.medians)
                return len(op.medians)
            case RecordExposure():
                return rules.record_exposure(fleet, op.gpu_hours, op.failures)
            case RecordCorrectedErrors():
                return rules.record_corrected_errors(fleet, op.node, op.at, op.corrected)

    def _register(self, op: RegisterNode, now: datetime) -> FleetNode:
        node = rules.register(self.fleet, op.node, op.rack, op.hub, op.spare, now)
        if node.state == NodeState.QUARANTINED:
            # Its agent is evidently up again (after a repair, or after missing its last self-test).
            self._start_self_test(op.node, now, "agent registered again; ")
        return node

    def _quarantine(self, node: str, reason: str, run_id: str | None, now: datetime) -> Quarantine:
        """Out of the pool at once; a newly quarantined node's self-test starts in the background."""
        opens = node not in self.fleet.quarantined
        record = rules.quarantine(self.fleet, node, reason, run_id, now)
        if opens:
            self._start_self_test(node, now)
        return record

    # -- self-test ------------------------------------------------------------------------------

    def _start_self_test(self, node: str, now: datetime, trigger: str = "") -> None:
        rules.start_self_test(self.fleet, node, now)
        summary = f"self-test {node} ({trigger}quarantined: {self.fleet.quarantined[node].reason})"
        self.self_tests[node] = asyncio.create_task(self._self_test(node, self.fleet.nodes[node].hub, summary))

    async def _self_test(self, node: str, hub: str, summary: str) -> None:
        pickup = self.settings.self_test_pickup_seconds
        try:
            result = await workflow.execute_activity(
                "self_test",
                # An agent it cannot reach within `pickup` answers a failed, not-started test.
                SelfTestInput(node=node, hub=hub, answer_within=pickup),
                result_type=SelfTestResult,
                task_queue=workflow.info().task_queue,
                start_to_close_timeout=timedelta(seconds=pickup) + timedelta(minutes=10),
                heartbeat_timeout=timedelta(seconds=30),
                # The activity answers a failed test itself when the agent cannot run it. What it
                # raises is the tester's own worker gone mid-test (a supervisor killed: heartbeat
                # timeout): that node was never judged, so the test runs again on another worker.
                retry_policy=RetryPolicy(maximum_attempts=3),
                summary=summary,
            )
        except ActivityError as exc:
            detail = f"self-test did not complete: {exc.cause or exc}"
            result = SelfTestResult(node=node, passed=False, checks={}, detail=detail, at=self._now())
        try:
            rules.finish_self_test(self.fleet, result, self._now())
        finally:
            del self.self_tests[node]
            self.changed = True
        workflow.logger.info("self-test of %s %s: %s", node, "passed" if result.passed else "failed", result.detail)

    # -- queries --------------------------------------------------------------------------------

    @workflow.query
    def answers(self, ids: list[str]) -> dict[str, FleetAnswer[Any]]:
        """The answers to these requests; one not yet applied (or too old to keep) is left out."""
        return {id: self.fleet.answers[id] for id in ids if id in self.fleet.answers}

    @workflow.query
    def hubs(self, nodes: list[str]) -> dict[str, str]:
        """Where each of these nodes' agents listens (host:port); unregistered nodes are left out."""
        return {node: self.fleet.nodes[node].hub for node in nodes if node in self.fleet.nodes}

    @workflow.query
    def nodes(self) -> list[FleetNode]:
        return sorted(self.fleet.nodes.values(), key=lambda n: n.id)

    @workflow.query
    def quarantines(self) -> list[Quarantine]:
        return self.fleet.quarantines()

    @workflow.query
    def baseline(self, config_digest: str) -> Baseline | None:
        return self.fleet.baselines.get(config_digest)

    @workflow.query
    def failure_rate(self) -> FailureRate:
        """Failures per GPU-hour over every run's exposure: the baseline paging compares a run with."""
        return self.fleet.failure_rate

    @workflow.query
    def ecc_trends(self) -> list[EccTrend]:
        """Nodes' corrected-ECC trends, the fastest-rising first."""
        return sorted(self.fleet.ecc_trends.values(), key=lambda t: (-t.per_day(), -t.corrected, t.node))

    @workflow.query
    def evictions(self) -> list[EvictionOutcome]:
        return self.fleet.evictions

    @workflow.query
    def state(self) -> FleetState:
        return self.fleet

    # -- helpers --------------------------------------------------------------------------------

    def _now(self) -> datetime:
        """The fleet's clock ticks in whole seconds: all `since` needs, and what its carried rows keep."""
        return workflow.now().replace(microsecond=0)

    def _history_is_long(self) -> bool:
        info = workflow.info()
        limit = self.settings.max_history
        return info.is_continue_as_new_suggested() or (limit is not None and info.get_current_history_length() > limit)

    def _history_is_full(self) -> bool:
        return workflow.info().get_current_history_length() > self.settings.handover_history

    async def _settle(self) -> None:
        """Finish what this segment started before handing over: self-tests report back to this
        segment and would be lost after it, and senders read their answers here. Requests that came
        in the same activation as the last check were applied before it (their handlers run first)."""
        while True:
            await workflow.wait_condition(lambda: workflow.all_handlers_finished() and not self.self_tests)
            quiet = workflow.now() - self.last_request_at
            if quiet >= ANSWER_GRACE or self._history_is_full():
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await workflow.wait_condition(self._history_is_full, timeout=ANSWER_GRACE - quiet)

    async def _show_changes(self) -> None:
        """Redraw the web UI's details after each activation that changed the fleet: once, however
        many requests it applied."""
        while True:
            await workflow.wait_condition(lambda: self.changed)
            self.changed = False
            self._show()

    def _show(self) -> None:
        """The web UI's current details: a table of states, the nodes in each (a few, for a big fleet)."""
        by_state: dict[NodeState, list[str]] = {}
        for n in self.fleet.nodes.values():
            by_state.setdefault(n.state, []).append(n.id)
        rows = ["| state | nodes |", "|---|---|"]
        for state in NodeState:
            ids = sorted(by_state.get(state, []))
            if ids:
                more = f", … +{len(ids) - SHOWN_PER_STATE}" if len(ids) > SHOWN_PER_STATE else ""
                rows.append(f"| {state} ({len(ids)}) | {', '.join(ids[:SHOWN_PER_STATE])}{more} |")
        workflow.set_current_details("\n".join(rows))


if __name__ == "__main__":
    raise SystemExit("FleetWorkflow runs in a worker: register it next to RunWorkflow in workers/supervisor.py")


def fleet_handle(client: Client, cluster: str = "default") -> WorkflowHandle[FleetWorkflow, None]:
    """The cluster's FleetWorkflow, for its queries and its `request` signal (activities/fleet.py's FleetClient)."""
    handle: WorkflowHandle[FleetWorkflow, None] = client.get_workflow_handle(fleet_id(cluster))
    return handle
