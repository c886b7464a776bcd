"""Talking to node agents from the supervisor: one request, one answer, on a connection of its own
to the agent's hub (core.control), and the same request to many agents at once, a bounded number in
flight. An agent that does not answer in time is reported by name, never raised: to a run, a node
that does not answer is a lost node."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from pydantic import BaseModel

from core.control import AgentAnswer, Refused, agent_answer
from core.launch import Endpoint

# Requests in flight at once from one activity: enough that 2,048 agents answer in a few rounds,
# few enough that one supervisor's sockets and event loop are not swamped.
IN_FLIGHT = 256


class NoAnswer(Exception):
    """The agent could not be reached, did not answer in time, or refused."""


async def ask(hub: str, request: BaseModel, within: float) -> AgentAnswer:
    """`request` to the agent at `hub`; its answer within `within` seconds, or NoAnswer saying why."""
    address = Endpoint.parse(hub)
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(within):
            reader, writer = await asyncio.open_connection(address.host, address.port)
            writer.write(request.model_dump_json().encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
    except TimeoutError:
        raise NoAnswer(f"no answer within {within:g}s") from None
    except OSError as exc:
        raise NoAnswer(f"unreachable at {hub}: {exc.strerror or exc}") from None
    finally:
        if writer is not None:
            writer.close()
    if not line:
        raise NoAnswer(f"the agent at {hub} hung up without an answer")
    answer = agent_answer.validate_json(line)
    if isinstance(answer, Refused):
        raise NoAnswer(answer.error)
    return answer


async def ask_each(
    hubs: dict[str, str], nodes: Iterable[str], request: Callable[[str], BaseModel], within: float
) -> tuple[dict[str, AgentAnswer], dict[str, str]]:
    """`request(node)` to every node's agent, IN_FLIGHT at a time: the answers, and for every node
    that gave none (or has no known hub) the reason."""
    limit = asyncio.Semaphore(IN_FLIGHT)
    answers: dict[str, AgentAnswer] = {}
    missing: dict[str, str] = {}

    async def one(node: str) -> None:
        hub = hubs.get(node)
        if hub is None:
            missing[node] = "its agent never registered with the fleet"
            return
        async with limit:
            try:
                answers[node] = await ask(hub, request(node), within)
            except NoAnswer as exc:
                missing[node] = str(exc)

    await asyncio.gather(*(one(node) for node in nodes))
    return answers, missing
