"""What the supervisor asks node agents, and what they answer.

A request goes to an agent's hub as one JSON line on a connection of its own, and the agent answers
with one JSON line (`t` names each). Node agents are not Temporal workers: at 2,048 nodes, a poller
per agent would pass the server's limit of concurrent polls per namespace, and an activity per node
per generation would pass a workflow's limit of pending activities. The supervisor's activities
(activities/nodes.py) carry each request to many agents at once, and their inputs and results are
here too, so workflows import them without importing torch.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field, TypeAdapter

from stayalive.core.fleet.model import SelfTestResult
from stayalive.core.judgement.hangs import CollectiveProgress
from stayalive.core.protocol.telemetry import Command
from stayalive.core.run.launch import Endpoint, NodeLaunch
from stayalive.core.run.spec import Backend

# -- one agent: requests and answers on its hub -------------------------------------------------------


class Prepare(BaseModel):
    """Are you there, and can you run this? The node hosting the generation's rendezvous opens a
    fresh store."""

    t: Literal["prepare"] = "prepare"
    run_id: str
    generation: int
    open_store: bool
    backend: Backend = "gloo"
    ranks_per_node: int = 1
    workdir: str | None = None


class Prepared(BaseModel):
    t: Literal["prepared"] = "prepared"
    rendezvous: Endpoint | None = None  # the hub through which the store it opened is reached
    refused: str | None = None  # why this node cannot run the generation (e.g. NCCL without CUDA)


class StartRanks(BaseModel):
    """Start this node's ranks of a generation (or hand its held survivors their new places)."""

    t: Literal["start"] = "start"
    launch: NodeLaunch


class Started(BaseModel):
    t: Literal["started"] = "started"
    pids: dict[int, int]  # rank → pid
    rejoined: list[int] = []  # ranks whose process carried over from the last generation


class SendCommand(BaseModel):
    t: Literal["command"] = "command"
    run_id: str
    command: Command


class Sent(BaseModel):
    t: Literal["sent"] = "sent"
    reached: int  # ranks the command was written to


class DumpStacks(BaseModel):
    """Every live rank of the run here dumps its Python stacks (faulthandler, on SIGUSR1)."""

    t: Literal["stacks"] = "stacks"
    run_id: str


class StackDump(BaseModel):
    t: Literal["stack_dump"] = "stack_dump"
    stacks: dict[int, str]  # rank → its newest dump
    progress: dict[int, CollectiveProgress] = {}  # rank → its collective counts, from ranks that keep them


class ReleaseRun(BaseModel):
    """The run is over here: stop its ranks, close its store, free its host memory."""

    t: Literal["release"] = "release"
    run_id: str


class Released(BaseModel):
    t: Literal["released"] = "released"
    stopped: int  # ranks that were still running


class RunSelfTest(BaseModel):
    """Vacate the node (stop every rank still on it) and run the self-test's checks."""

    t: Literal["self_test"] = "self_test"
    node: str


class SelfTested(BaseModel):
    t: Literal["self_tested"] = "self_tested"
    result: SelfTestResult


class Refused(BaseModel):
    """The agent could not do what was asked; `error` says why."""

    t: Literal["refused"] = "refused"
    error: str


AgentRequest = Annotated[
    Union[Prepare, StartRanks, SendCommand, DumpStacks, ReleaseRun, RunSelfTest],  # noqa: UP007
    Field(discriminator="t"),
]
AgentAnswer = Annotated[
    Union[Prepared, Started, Sent, StackDump, Released, SelfTested, Refused],  # noqa: UP007
    Field(discriminator="t"),
]
agent_answer = TypeAdapter(AgentAnswer)

# -- many agents: the supervisor's activities ---------------------------------------------------------


class CommandRanks(BaseModel):
    """A command for every rank of the run on `nodes` (they agree among themselves on the step)."""

    run_id: str
    nodes: list[str]
    command: Command


class ReleaseRanks(BaseModel):
    run_id: str
    nodes: list[str]


class HangInput(BaseModel):
    """Dump every rank's stacks and collective counts, name the culprit they point at, keep them all
    in one file."""

    run_id: str
    nodes: list[str]
    ranks_per_node: int
    generation: int
    step: int
    directory: str  # the run's checkpoint directory: the artifact goes under it, on shared storage


class HangStacks(BaseModel):
    """What the stacks and counts of a hung generation say: one artifact for a person, and the
    finding (core/judgement/hangs.py)."""

    culprit: int | None  # the one rank the evidence names (it never entered the collective, or its stack differs)
    suspects: list[int]  # the ranks it points at (several: no single culprit), at most a few
    ranks_dumped: int
    artifact: str | None  # every distinct stack with the ranks that share it; None if nothing was dumped
    summary: str  # one line for the timeline
