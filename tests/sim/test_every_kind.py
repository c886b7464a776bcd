"""One run of 128 nodes × 8 ranks through every kind of interruption (sim/scenario.py): the real
RunWorkflow and FleetWorkflow, the real fleet and paging activities, the simulated nodes, on
`temporal server start-dev`. One run, shared by the tests below, each checking one promise."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Cause
from stayalive.sim import history, scenario
from stayalive.sim.scenario import Ran
from stayalive.workers.devstack import SEARCH_ATTRIBUTES, temporal_binary
from stayalive.workflows.fleet import FleetWorkflow
from stayalive.workflows.run import RunWorkflow

NODES = 128
BUDGET = 50  # history events per interruption, over every execution it touches (docs/architecture.md §4)
STALL_S = 240


@pytest.fixture(scope="module")
async def ran(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Ran]:
    async with await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(temporal_binary()),
        data_converter=pydantic_data_converter,
        dev_server_extra_args=[arg for attribute in SEARCH_ATTRIBUTES for arg in ("--search-attribute", attribute)],
    ) as env:
        ran = await scenario.every_kind(env.client, NODES, tmp_path_factory.mktemp("checkpoints"), stall_s=STALL_S)
    print("\n" + "\n".join(f"{c.what:>22}: {c.events} events, {c.bytes / 1024:.1f} KiB" for c in ran.costs))
    yield ran


def test_the_run_completes_through_every_kind(ran: Ran) -> None:
    assert ran.result.state == RunState.COMPLETED, ran.result.failure
    assert ran.result.final_step == scenario.TARGET
    assert [i.cause for i in ran.result.interruptions] == scenario.CAUSES


def test_each_culprit_node_is_the_one_quarantined(ran: Ran) -> None:
    quarantined = {q.node for q in ran.quarantines}
    for interruption in ran.result.interruptions:
        if interruption.cause in (Cause.CRASH, Cause.NODE_LOST, Cause.HANG, Cause.SDC, Cause.DRAIN):
            assert interruption.node is not None and interruption.node in quarantined, interruption.line()
            assert interruption.node not in ran.status.nodes, f"{interruption.node} is still in the group"
    assert len(ran.status.nodes) == NODES, "every quarantined node was replaced by a spare"


def test_a_node_that_never_answers_its_launch_is_replaced_not_fatal(ran: Ran) -> None:
    lost = ran.result.interruptions[-1]
    assert (lost.cause, lost.detected_by) == (Cause.NODE_LOST, "launch: the node agent did not answer")
    assert any(action.startswith(f"replaced {lost.node} with spare") for action in lost.actions)


def test_the_straggler_climbs_to_eviction_and_the_slowdown_pages(ran: Ran) -> None:
    straggler, slowdown = ran.status.detections
    assert straggler.kind == "straggler" and any(a.startswith("S2 after") for a in straggler.actions)
    assert any("s3_replace" in a for a in straggler.actions), straggler.actions
    eviction = ran.result.interruptions[4]
    assert (eviction.detected_by, eviction.node) == ("straggler escalation", straggler.node)
    assert (
        slowdown.kind == "slowdown" and slowdown.paging is not None and slowdown.paging.rule == "environmental slowdown"
    )


def test_no_interruption_costs_more_than_its_budget(ran: Ran) -> None:
    worst = max(ran.costs, key=lambda c: c.events)
    assert len(ran.costs) == len(scenario.CAUSES) + 2  # the straggler's and the slowdown's findings are marked too
    assert worst.events <= BUDGET, [(c.what, c.events) for c in ran.costs]


def test_no_payload_or_pending_activities_grow_with_the_width(ran: Ran) -> None:
    events = [e for chain in (*ran.run, *ran.fleet) for e in chain]
    assert history.largest_payload(events) < 256 * 1024
    assert max(history.most_pending_activities(s) for s in (*ran.run, *ran.fleet)) <= 5


def test_a_failure_leads_to_the_next_launch_within_a_second(ran: Ran) -> None:
    assert ran.relaunch_s and max(ran.relaunch_s) < 1.0, ran.relaunch_s


async def test_every_history_replays_to_the_same_decisions(ran: Ran) -> None:
    """A worker that restarts replays each workflow from its history: the code must decide the same
    way, whatever arrived together in one workflow task the first time."""
    replayer = Replayer(workflows=[RunWorkflow, FleetWorkflow], data_converter=pydantic_data_converter)
    for workflow_id, chain in (("every-kind-128", ran.run), ("fleet-default", ran.fleet)):
        for events in chain:
            replayed = await replayer.replay_workflow(
                WorkflowHistory(workflow_id, events), raise_on_replay_failure=False
            )
            assert replayed.replay_failure is None, replayed.replay_failure
