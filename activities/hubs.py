"""Talking to node agents from the supervisor: one request, one answer, on a connection of its own
to the agent's hub (core.messages.control), and the same request to many agents at once, a bounded number in
flight. An agent that does not answer in time is reported by name, never raised: to a run, a node
that does not answer is a lost node. Every connection first proves it holds the fleet's secret
(core.protocol.access)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from pydantic import BaseModel, ValidationError

from stayalive.core.messages.control import AgentAnswer, Refused, agent_answer
from stayalive.core.protocol.access import knock
from stayalive.core.run.launch import Endpoint

# Requests in flight at once from one activity: enough that 2,048 agents answer in a few rounds,
# few enough that one supervisor's sockets and event loop are not swamped.
IN_FLIGHT = 256


class NoAnswer(Exception):
    """The agent could not be reached, did not answer in time, or refused."""


async def open_hub(hub: str, opening: BaseModel, key: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the hub at `hub` (host:port) that has answered its challenge with `key` and
    said `opening`. Raises OSError, or pydantic's ValidationError when what answered is no hub."""
    address = Endpoint.parse(hub)
    reader, writer = await asyncio.open_connection(address.host, address.port)
    try:
        writer.write(knock(await reader.readline(), key, opening))
        await writer.drain()
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def ask(hub: str, request: BaseModel, within: float, secret: bytes) -> AgentAnswer:
    """`request` to the agent at `hub`; its answer within `within` seconds, or NoAnswer saying why."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(within):
            reader, writer = await open_hub(hub, request, secret)
            line = await reader.readline()
    except TimeoutError:
        raise NoAnswer(f"no answer within {within:g}s") from None
    except OSError as exc:
        raise NoAnswer(f"unreachable at {hub}: {exc.strerror or exc}") from None
    except ValidationError:
        raise NoAnswer(f"what answered at {hub} is not a node agent's hub") from None
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
    hubs: dict[str, str], nodes: Iterable[str], request: Callable[[str], BaseModel], within: float, secret: bytes
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
                answers[node] = await ask(hub, request(node), within, secret)
            except NoAnswer as exc:
                missing[node] = str(exc)

    await asyncio.gather(*(one(node) for node in nodes))
    return answers, missing
