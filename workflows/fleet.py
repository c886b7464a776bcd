"""FleetWorkflow: the node pool of one cluster, an entity workflow that never ends on its own.

It answers which nodes a run may have, takes a faulty node out of the pool, and lets it back in
only after the node's own agent passes a self-test (activities/selftest.py). It also keeps what
the fleet learns across runs: eviction outcomes and healthy step-time baselines.

Every change is an update with a validator that runs the same check as the change itself
(core/fleet.py), so a bad request is rejected before it is accepted, with the reason. The update
handlers do not await: each applies its change within one workflow activation, so no two
interleave and no lock is needed. The only thing that waits is a self-test, which runs as a
background task and touches the state once, when its result is in.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, TimeoutType
from temporalio.exceptions import TimeoutError as ActivityTimeout

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from core import fleet
    from core.fleet import Baseline, EvictionOutcome, FleetNode, FleetState, NodeState, Quarantine, SelfTestResult
    from core.fleet_requests import (
        Acquire,
        Grant,
        MarkSuspect,
        QuarantineNode,
        RecordBaseline,
        RecordEviction,
        RegisterNode,
        Release,
        Retest,
        SelfTestInput,
        TakeSpare,
        fleet_id,
    )

SHOWN_PER_STATE = 8  # node ids listed per state in the web UI's current details


class FleetInput(BaseModel):
    state: FleetState | None = None  # None: a new, empty fleet; else what the last segment carried
    # A node agent that does not pick up its self-test within this long is down: the node stays quarantined.
    self_test_pickup_seconds: float = 300.0
    max_history: int | None = None  # for tests: continue-as-new past this many history events


@workflow.defn
class FleetWorkflow:
    @workflow.init
    def __init__(self, input: FleetInput) -> None:
        self.fleet = input.state or FleetState()
        self.settings = input
        self.self_tests: dict[str, asyncio.Task[None]] = {}  # node → its self-test in flight

    @workflow.run
    async def run(self, input: FleetInput) -> None:
        self._show()
        await workflow.wait_condition(self._history_is_long)
        # Finish what this segment started: accepted updates, and self-tests, whose results come
        # back to this segment and would be lost after it.
        await workflow.wait_condition(lambda: workflow.all_handlers_finished() and not self.self_tests)
        workflow.logger.info("continuing as new with %d nodes", len(self.fleet.nodes))
        workflow.continue_as_new(self.settings.model_copy(update={"state": self.fleet}))

    # -- the pool -------------------------------------------------------------------------------

    @workflow.update
    def register(self, input: RegisterNode) -> FleetNode:
        """A node agent announces itself at start-up; its node keeps whatever state it had."""
        node = fleet.register(self.fleet, input.node, input.rack, input.spare, workflow.now())
        if node.state == NodeState.QUARANTINED:
            # Its agent is evidently up again (after a repair, or after missing its last self-test).
            self._start_self_test(input.node, "agent registered again; ")
        self._show()
        return node

    @register.validator
    def _check_register(self, input: RegisterNode) -> None:
        fleet.check_register(input.node, input.rack)

    @workflow.update
    def acquire(self, input: Acquire) -> Grant:
        granted, refused = fleet.acquire(self.fleet, input.run_id, input.wanted, workflow.now())
        self._show()
        return Grant(granted=granted, refused=refused)

    @acquire.validator
    def _check_acquire(self, input: Acquire) -> None:
        fleet.check_acquire(input.run_id, input.wanted)

    @workflow.update
    def take_spare(self, input: TakeSpare) -> str | None:
        spare = fleet.take_spare(self.fleet, input.run_id, input.candidates, workflow.now())
        self._show()
        return spare

    @take_spare.validator
    def _check_take_spare(self, input: TakeSpare) -> None:
        fleet.check_run_id(input.run_id)

    @workflow.update
    def release(self, input: Release) -> list[str]:
        released = fleet.release(self.fleet, input.run_id, workflow.now())
        self._show()
        return released

    @release.validator
    def _check_release(self, input: Release) -> None:
        fleet.check_run_id(input.run_id)

    @workflow.update
    def mark_suspect(self, input: MarkSuspect) -> FleetNode:
        node = fleet.mark_suspect(self.fleet, input.node, input.reason, workflow.now())
        self._show()
        return node

    @mark_suspect.validator
    def _check_mark_suspect(self, input: MarkSuspect) -> None:
        fleet.check_suspect(self.fleet, input.node, input.reason)

    # -- quarantine and self-test ---------------------------------------------------------------

    @workflow.update
    def quarantine(self, input: QuarantineNode) -> Quarantine:
        """Out of the pool at once; the node's self-test starts in the background, and this returns
        as soon as the quarantine is recorded."""
        opens = self.fleet.open_quarantine(input.node) is None
        record = fleet.quarantine(self.fleet, input.node, input.reason, input.run_id, workflow.now())
        if opens:
            self._start_self_test(input.node)
        self._show()
        return record

    @quarantine.validator
    def _check_quarantine(self, input: QuarantineNode) -> None:
        fleet.check_quarantine(self.fleet, input.node, input.reason, input.run_id)

    @workflow.update
    def retest(self, input: Retest) -> None:
        """An operator asks for another self-test (after a repair, say); the result shows in `nodes`."""
        self._start_self_test(input.node, "retest requested; ")
        self._show()

    @retest.validator
    def _check_retest(self, input: Retest) -> None:
        fleet.check_quarantined(self.fleet, input.node)

    def _start_self_test(self, node: str, trigger: str = "") -> None:
        record = self.fleet.open_quarantine(node)
        summary = f"self-test {node} ({trigger}quarantined: {record.reason if record else '?'})"
        fleet.start_self_test(self.fleet, node, workflow.now())
        self.self_tests[node] = asyncio.create_task(self._self_test(node, summary))

    async def _self_test(self, node: str, summary: str) -> None:
        pickup = self.settings.self_test_pickup_seconds
        try:
            result = await workflow.execute_activity(
                "self_test",
                # A dead agent never answers: after `pickup` the node simply stays quarantined.
                SelfTestInput(node=node, hub="", answer_within=pickup),
                result_type=SelfTestResult,
                start_to_close_timeout=timedelta(seconds=pickup) + timedelta(minutes=10),
                heartbeat_timeout=timedelta(seconds=30),
                # One attempt: a test that could not finish is a failed test; the node stays out
                # until its agent registers again or an operator asks for a retest.
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary=summary,
            )
        except ActivityError as exc:
            result = SelfTestResult(node=node, passed=False, checks={}, detail=_not_run(exc, pickup), at=workflow.now())
        try:
            fleet.finish_self_test(self.fleet, result, workflow.now())
        finally:
            del self.self_tests[node]
        workflow.logger.info("self-test of %s %s: %s", node, "passed" if result.passed else "failed", result.detail)
        self._show()

    # -- what the fleet learns ------------------------------------------------------------------

    @workflow.update
    def record_eviction(self, input: RecordEviction) -> EvictionOutcome:
        return fleet.record_eviction(self.fleet, input.node, input.run_id, input.resolved, workflow.now())

    @record_eviction.validator
    def _check_record_eviction(self, input: RecordEviction) -> None:
        fleet.check_eviction(self.fleet, input.node, input.run_id)

    @workflow.update
    def record_baseline(self, input: RecordBaseline) -> Baseline:
        return fleet.record_baseline(self.fleet, input.config_digest, input.step_seconds)

    @record_baseline.validator
    def _check_record_baseline(self, input: RecordBaseline) -> None:
        fleet.check_baseline(input.config_digest, input.step_seconds)

    # -- queries --------------------------------------------------------------------------------

    @workflow.query
    def nodes(self) -> list[FleetNode]:
        return sorted(self.fleet.nodes.values(), key=lambda n: n.id)

    @workflow.query
    def quarantines(self) -> list[Quarantine]:
        return self.fleet.quarantines

    @workflow.query
    def baseline(self, config_digest: str) -> Baseline | None:
        return self.fleet.baselines.get(config_digest)

    @workflow.query
    def state(self) -> FleetState:
        return self.fleet

    # -- helpers --------------------------------------------------------------------------------

    def _history_is_long(self) -> bool:
        info = workflow.info()
        limit = self.settings.max_history
        return info.is_continue_as_new_suggested() or (limit is not None and info.get_current_history_length() > limit)

    def _show(self) -> None:
        """The web UI's current details: a table of states, the nodes in each (a few, for a big fleet)."""
        rows = ["| state | nodes |", "|---|---|"]
        for state in NodeState:
            ids = sorted(n.id for n in self.fleet.nodes.values() if n.state == state)
            if ids:
                more = f", … +{len(ids) - SHOWN_PER_STATE}" if len(ids) > SHOWN_PER_STATE else ""
                rows.append(f"| {state} ({len(ids)}) | {', '.join(ids[:SHOWN_PER_STATE])}{more} |")
        workflow.set_current_details("\n".join(rows))


def _not_run(exc: ActivityError, pickup: float) -> str:
    cause = exc.cause
    if isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.SCHEDULE_TO_START:
        return f"self-test not started: the node agent did not pick it up within {pickup:g}s (agent down?)"
    return f"self-test did not complete: {cause or exc}"


if __name__ == "__main__":
    raise SystemExit("FleetWorkflow runs in a worker: register it next to RunWorkflow in workers/supervisor.py")


def fleet_handle(client: Client, cluster: str = "default") -> WorkflowHandle[FleetWorkflow, None]:
    """The cluster's FleetWorkflow, for its queries and updates."""
    handle: WorkflowHandle[FleetWorkflow, None] = client.get_workflow_handle(fleet_id(cluster))
    return handle
