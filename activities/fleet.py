"""The supervisor's side of the fleet: FleetClient, the one way anybody changes it (the run's
activities below, node agents registering, the CLI, tests), and the run's fleet activities built on it.

A workflow cannot send another workflow a request and wait for the answer, so RunWorkflow reaches
its fleet through these activities (FleetWorkflow decides; this only asks).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from pydantic import TypeAdapter
from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from stayalive.core.fleet.model import Baseline, EvictionOutcome, FailureRate, FleetAnswer
from stayalive.core.fleet.requests import (
    Acquire,
    FleetOp,
    FleetRequest,
    Grant,
    MarkSuspect,
    RecordEviction,
    RecordExposure,
    RecordWindows,
    Release,
    Replace,
    Replacement,
    TakeSpare,
    fleet_id,
)

R = TypeVar("R")

ASK_WITHIN = 60.0  # seconds for the fleet to answer a request


@dataclass(frozen=True)
class Looks:
    """How often a client looks for its answers: the first wait is drawn at random from `first`, so
    that senders spread out, and each look that finds nothing doubles it, up to `most`."""

    first: tuple[float, float]
    most: float


PROMPT = Looks(first=(0.02, 0.05), most=1.0)  # a run's requests: a relaunch waits on them
# A node agent's ECC reports: each agent has a client of its own, none is in a hurry, and every look
# is a query the fleet's worker answers before its next workflow task (at 2,048 agents a look a second
# each kept the fleet's tasks from completing; registrations therefore wait for no answer at all).
PATIENT = Looks(first=(1.0, 5.0), most=20.0)
LOOK_FOR = 256  # requests one look asks about (the longest waiting): it keeps each query small
# Signals one client has in flight. The server takes a workflow's signals one at a time, under the same
# lock as the fleet's task completions: more from one process only queue there and hold up the fleet's
# workflow tasks behind them. Worse, a server fails the workflow task in flight once 100 events have
# buffered during it (FORCE_CLOSE_COMMAND) and retries it seconds later with all that arrived meanwhile:
# 2,048 registrations at 64 in flight tripped it and ended in one 2,000-signal task of 0.9-1.1 s; at 16
# every task stays near 0.1 s, and the whole burst is no slower (4.1-4.9 s on two cores).
SENDING_AT_ONCE = 16


class FleetRefused(Exception):
    """The fleet refused a request; the message says why (the rule it broke). Nothing changed."""


class FleetClient:
    """How anybody changes the fleet: `ask` sends one request as a `request` signal and waits for its
    answer. Every request this client waits on shares one look at the `answers` query, so a burst of
    them costs one query a round, not one each (a dev server on two cores answers about 100 queries a
    second); a look that finds nothing backs off, so that many agents, each with a client of its own,
    do not flood the supervisor with queries either."""

    def __init__(self, fleet: WorkflowHandle[Any, Any], looks: Looks = PROMPT) -> None:
        self.handle = fleet
        self.looks = looks
        self._waiting: dict[str, asyncio.Future[FleetAnswer[Any]]] = {}  # request id → its answer, once in
        self._looking: asyncio.Task[None] | None = None
        self._sending = asyncio.Semaphore(SENDING_AT_ONCE)

    async def ask(
        self,
        op: FleetOp[R],
        *,
        id: str | None = None,
        within: float = ASK_WITHIN,
    ) -> R:
        """Send `op` and return the fleet's result, or raise FleetRefused with the reason.

        `id` names the request: pass one that is the same on every attempt where a retry must not
        apply it twice; the default is a fresh one. TimeoutError if no answer comes within `within`
        seconds.
        """
        request = FleetRequest(id=id or str(uuid.uuid4()), op=op)
        async with self._sending:
            await self.handle.signal("request", request)
        answer = await self._answer(request.id, within, f"{type(op).__name__} request {request.id}")
        if answer.error is not None:
            raise FleetRefused(answer.error)
        return cast(R, _adapter(op.answer_type()).validate_python(answer.result))

    async def _answer(self, request_id: str, within: float, request: str) -> FleetAnswer[Any]:
        answer = self._waiting.setdefault(request_id, asyncio.get_running_loop().create_future())
        if self._looking is None or self._looking.done():
            self._looking = asyncio.create_task(self._look_for_answers())
        try:
            return await asyncio.wait_for(asyncio.shield(answer), within)
        except TimeoutError:
            raise TimeoutError(f"the fleet did not answer {request} in {within:g}s") from None
        finally:
            if self._waiting.get(request_id) is answer:
                del self._waiting[request_id]

    async def _look_for_answers(self) -> None:
        misses = 0
        while self._waiting:
            await asyncio.sleep(min(random.uniform(*self.looks.first) * 2**misses, self.looks.most))
            try:
                longest_waiting = list(itertools.islice(self._waiting, LOOK_FOR))
                answers = await self.handle.query("answers", longest_waiting, result_type=_Answers)
            except RPCError:
                answers = {}  # not answerable this moment (the fleet starting, a busy worker): look again
            except Exception as exc:  # an answer that cannot be read will not become readable
                self._fail_all(exc)
                return
            for request_id, answer in answers.items():
                if (waiting := self._waiting.pop(request_id, None)) is not None and not waiting.done():
                    waiting.set_result(answer)
            misses = 0 if answers else misses + 1

    def _fail_all(self, exc: Exception) -> None:
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(exc)
        self._waiting.clear()


_Answers = dict[str, FleetAnswer[Any]]  # the `answers` query's result: request id → its answer


@functools.cache
def _adapter(answer_type: Any) -> TypeAdapter[Any]:
    return TypeAdapter(answer_type)


class FleetActivities:
    """The run's fleet requests, as activities. Each request's id is its activity's (workflow, run,
    activity id), the same on every attempt: a retried attempt gets the first one's answer."""

    def __init__(self, client: Client, cluster: str = "default") -> None:
        self.fleet = FleetClient(client.get_workflow_handle(fleet_id(cluster)))

    async def _ask(self, op: FleetOp[R]) -> R:
        info = activity.info()
        try:
            return await self.fleet.ask(op, id=f"{info.workflow_id}/{info.workflow_run_id}/{info.activity_id}")
        except FleetRefused as refused:
            # Another attempt asks with the same id and gets the same answer: no retry can help.
            raise ApplicationError(str(refused), type="FleetRefused", non_retryable=True) from None

    def activities(self) -> list[Callable[..., Any]]:
        """Every activity here, for a worker to register."""
        return [
            self.acquire_nodes,
            self.replace_node,
            self.take_spare,
            self.release_nodes,
            self.baseline,
            self.record_baseline,
            self.failure_rate,
            self.record_exposure,
            self.mark_suspect,
            self.eviction_outcomes,
            self.record_eviction,
        ]

    async def hubs(self, nodes: list[str]) -> dict[str, str]:
        """Where these nodes' agents listen (host:port), for activities that reach them; unregistered
        nodes are left out. Not an activity: a helper for the supervisor's own."""
        hubs: dict[str, str] = await self.fleet.handle.query("hubs", nodes)
        return hubs

    @activity.defn
    async def acquire_nodes(self, request: Acquire) -> Grant:
        return await self._ask(request)

    @activity.defn
    async def replace_node(self, request: Replace) -> Replacement:
        """Quarantine the node (its self-test starts) and take a spare in its place, if one is free."""
        return await self._ask(request)

    @activity.defn
    async def take_spare(self, request: TakeSpare) -> str | None:
        return await self._ask(request)

    @activity.defn
    async def release_nodes(self, request: Release) -> list[str]:
        return await self._ask(request)

    @activity.defn
    async def baseline(self, config_digest: str) -> list[float]:
        """Healthy runs' window medians for this configuration: what the absolute slowdown check compares to."""
        known: Baseline | None = await self.fleet.handle.query("baseline", config_digest, result_type=Baseline)
        return list(known.step_seconds) if known else []

    @activity.defn
    async def record_baseline(self, request: RecordWindows) -> int:
        return await self._ask(request)

    @activity.defn
    async def failure_rate(self) -> FailureRate:
        """The fleet's failures per GPU-hour: the baseline a run's failure rate is paged against."""
        rate: FailureRate = await self.fleet.handle.query("failure_rate", result_type=FailureRate)
        return rate

    @activity.defn
    async def record_exposure(self, request: RecordExposure) -> FailureRate:
        return await self._ask(request)

    @activity.defn
    async def mark_suspect(self, request: MarkSuspect) -> None:
        await self._ask(request)

    @activity.defn
    async def eviction_outcomes(self) -> list[EvictionOutcome]:
        """What the fleet's past straggler evictions did: P(healthy) of the eviction payback."""
        outcomes: list[EvictionOutcome] = await self.fleet.handle.query("evictions", result_type=list[EvictionOutcome])
        return outcomes

    @activity.defn
    async def record_eviction(self, request: RecordEviction) -> EvictionOutcome:
        return await self._ask(request)
