"""FleetClient against a stand-in fleet: answers come back typed, a refusal is an exception with the
fleet's reason, many waiting requests share each look at the `answers` query, and one never answered
times out with its name."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from pydantic_core import to_jsonable_python
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from stayalive.activities.fleet import LOOK_FOR, FleetClient, FleetRefused
from stayalive.core.fleet.model import FleetAnswer
from stayalive.core.fleet.requests import Acquire, FleetRequest, Grant, Release, TakeSpare


class StandInFleet:
    """Answers what it is sent, at once or never; counts the looks it was asked for answers."""

    def __init__(self, answer: bool = True, busy_looks: int = 0) -> None:
        self.answered: dict[str, FleetAnswer[Any]] = {}
        self.looks: list[int] = []  # how many ids each look asked about
        self.answer = answer
        self.busy_looks = busy_looks  # looks refused first, as a busy server does

    async def signal(self, name: str, request: FleetRequest) -> None:
        assert name == "request"
        if not self.answer:
            return
        match request.op:
            case Acquire(run_id=" "):
                self.answered[request.id] = FleetAnswer(error="run_id is empty: name the run the request is for")
            case Acquire():
                result = Grant(granted=request.op.wanted, refused={})
                self.answered[request.id] = FleetAnswer(result=to_jsonable_python(result))
            case Release():
                self.answered[request.id] = FleetAnswer(result=[])
            case _:
                self.answered[request.id] = FleetAnswer(result=None)

    async def query(self, name: str, ids: list[str], result_type: object) -> dict[str, FleetAnswer[Any]]:
        assert name == "answers"
        self.looks.append(len(ids))
        if self.busy_looks:
            self.busy_looks -= 1
            raise RPCError("query buffer full", RPCStatusCode.RESOURCE_EXHAUSTED, b"")
        return {id: self.answered[id] for id in ids if id in self.answered}


def client(fleet: StandInFleet) -> FleetClient:
    return FleetClient(cast(WorkflowHandle[Any, Any], fleet))


async def test_the_answer_comes_back_typed() -> None:
    assert await client(StandInFleet()).ask(Acquire(run_id="r1", wanted=["n1"])) == Grant(granted=["n1"], refused={})
    assert await client(StandInFleet()).ask(TakeSpare(run_id="r1", candidates=[])) is None


async def test_a_refusal_raises_the_fleets_reason() -> None:
    with pytest.raises(FleetRefused, match=r"^run_id is empty: name the run the request is for$"):
        await client(StandInFleet()).ask(Acquire(run_id=" ", wanted=["n1"]))


async def test_waiting_requests_share_each_look_and_a_busy_fleet_is_asked_again() -> None:
    fleet = StandInFleet(busy_looks=2)
    asking = client(fleet)
    results = await asyncio.gather(*(asking.ask(Release(run_id=f"r{i}")) for i in range(3 * LOOK_FOR)))
    assert results == [[]] * (3 * LOOK_FOR)
    assert len(fleet.looks) <= 2 + 3 + 2  # the busy looks, three of LOOK_FOR each, a little slack
    assert max(fleet.looks) == LOOK_FOR


async def test_a_request_never_answered_times_out_with_its_name() -> None:
    asking = client(StandInFleet(answer=False))
    with pytest.raises(TimeoutError, match=r"the fleet did not answer Release request r1/7 in 0.2s"):
        await asking.ask(Release(run_id="r1"), id="r1/7", within=0.2)
    assert not asking._waiting  # nothing is looked for any more
