"""A node agent's hub answers only holders of a key: the fleet's secret for the supervisor's doors
(requests, subscriptions), a run's token for that run's (Hello, PutFile, GetFile, the store). A real
hub and agent on loopback; strangers that know the protocol but not the key."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from pydantic import BaseModel
from structlog.testing import capture_logs

from stayalive.activities.hubs import ask, open_hub
from stayalive.agent import relay as relay_module
from stayalive.agent.hub import NodeHub
from stayalive.agent.node import NodeAgent
from stayalive.agent.processes import start_rank
from stayalive.agent.relay import StoreRelay
from stayalive.core.messages.control import Prepare, Prepared, Refused, SendCommand, Sent
from stayalive.core.protocol.access import run_token
from stayalive.core.protocol.telemetry import Command, GetFile, Held, Hello, OpenStore, PutFile, Subscribe
from stayalive.core.run.launch import Endpoint
from stayalive.training import memory

SECRET = b"the fleet's secret, 32 bytes ok"
RUN = "tiny/0000abcd"
OTHER_RUN = "other/0000ffff"
TOKEN = run_token(SECRET, RUN)
CHECKPOINT = "step-00000010-g0"
SHARD = "__0_0.distcp"  # rank 0's DCP file
BURST = 800  # store connections at once: well past asyncio's default accept queue of 100


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[NodeAgent]:
    hub = NodeHub("n1", "127.0.0.1", tmp_path / "memory", SECRET)
    await hub.start()
    yield NodeAgent("n1", hub, tmp_path / "state")
    hub.close()


async def refusal(hub: NodeHub, opening: BaseModel, key: bytes | None, body: bytes = b"") -> Refused:
    """What the hub answers a caller that says `opening` with `key` (None: no proof at all, the way a
    caller that predates the handshake would), sending `body` after it."""
    if key is None:
        reader, writer = await asyncio.open_connection(hub.endpoint.host, hub.endpoint.port)
        await reader.readline()  # the challenge, ignored
        writer.write(opening.model_dump_json().encode() + b"\n")
    else:
        reader, writer = await open_hub(str(hub.endpoint), opening, key)
    writer.write(body)
    try:
        return Refused.model_validate_json(await reader.readline())
    finally:
        writer.close()


async def connected_rank(hub: NodeHub) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Rank 0 of RUN, connected with its token as training.channel connects."""
    rank = await open_hub(str(hub.endpoint), Hello(run_id=RUN, rank=0, generation=0, pid=1), TOKEN.encode())
    while 0 not in hub.run(RUN).ranks:
        await asyncio.sleep(0.01)
    return rank


async def next_line(reader: asyncio.StreamReader) -> bytes | None:
    """What the hub sends next (None: nothing for 0.3 s)."""
    try:
        async with asyncio.timeout(0.3):
            return await reader.readline()
    except TimeoutError:
        return None


async def test_a_strangers_command_is_refused_and_no_rank_receives_it(agent: NodeAgent) -> None:
    hub = agent.hub
    rank, _connection = await connected_rank(hub)
    command = SendCommand(run_id=RUN, command=Command(seq=1, kind="exit"))
    with capture_logs() as logs:
        no_proof = await refusal(hub, command, key=None)
        wrong = await refusal(hub, command, key=b"a guess at the fleet's secret!!")
        a_ranks = await refusal(hub, command, key=TOKEN.encode())  # a rank's token opens no supervisor door
    assert "no proof of a key" in no_proof.error
    assert "command takes the fleet's secret" in wrong.error and "command takes the fleet's secret" in a_ranks.error
    assert await next_line(rank) is None
    refused = [e for e in logs if e["event"] == "hub refused a caller"]
    assert len(refused) == 3 and all(e["log_level"] == "warning" and e["node"] == "n1" for e in refused)
    assert refused[1]["run_id"] == RUN and refused[1]["peer"].startswith("('127.0.0.1'")

    # The fleet's secret does open it: the same command reaches the rank.
    assert await ask(str(hub.endpoint), command, within=5, secret=SECRET) == Sent(reached=1)
    assert json.loads(await rank.readline())["kind"] == "exit"


async def test_a_strangers_file_is_refused_and_nothing_lands_in_the_memory_tier(
    agent: NodeAgent, tmp_path: Path
) -> None:
    hub = agent.hub
    shard = tmp_path / SHARD
    shard.write_bytes(b"weights" * 1000)
    put = PutFile(run_id=RUN, checkpoint=CHECKPOINT, file=SHARD, size=shard.stat().st_size)
    for key in (None, b"not the token", run_token(SECRET, OTHER_RUN).encode(), SECRET):
        answer = await refusal(hub, put, key, body=shard.read_bytes())
        assert "not authorized" in answer.error or "no proof" in answer.error
    assert not any(p.is_file() for p in hub.memory_dir.rglob("*"))

    # Another run's token, or none, reads nothing out of the tier either; the run's own token does.
    await asyncio.to_thread(memory.put, str(hub.endpoint), TOKEN, RUN, CHECKPOINT, shard)
    assert memory.memory_path(hub.memory_dir, RUN, CHECKPOINT, SHARD).read_bytes() == shard.read_bytes()
    get = GetFile(run_id=RUN, checkpoint=CHECKPOINT, file=SHARD)
    assert "not authorized" in (await refusal(hub, get, run_token(SECRET, OTHER_RUN).encode())).error
    fetched = await asyncio.to_thread(memory.fetch, str(hub.endpoint), TOKEN, RUN, CHECKPOINT, SHARD)
    assert fetched == shard.read_bytes()
    assert await asyncio.to_thread(memory.fetch, str(hub.endpoint), "not the token", RUN, CHECKPOINT, SHARD) is None


async def test_a_runs_records_stream_only_to_the_fleets_secret(agent: NodeAgent) -> None:
    hub = agent.hub
    subscribe = Subscribe(run_id=RUN)
    assert "not authorized" in (await refusal(hub, subscribe, TOKEN.encode())).error
    reader, writer = await open_hub(str(hub.endpoint), subscribe, SECRET)
    assert json.loads(await reader.readline())["t"] == "beat"
    writer.close()


def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) with a socket listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(local.rsplit(":", 1)[0])
    return found


async def test_the_rendezvous_store_listens_on_loopback_and_opens_only_to_the_runs_token(agent: NodeAgent) -> None:
    prepared = agent.prepare(Prepare(run_id=RUN, generation=0, open_store=True))
    assert isinstance(prepared, Prepared) and prepared.rendezvous == agent.hub.endpoint
    store = agent.stores[RUN][1]
    assert listening(store.port) == {"0100007F"}, "the store must listen on 127.0.0.1 alone"

    stranger = OpenStore(run_id=RUN, generation=0)
    assert "not authorized" in (await refusal(agent.hub, stranger, run_token(SECRET, OTHER_RUN).encode())).error
    assert "not authorized" in (await refusal(agent.hub, stranger, SECRET)).error  # the fleet's is not the run's
    stale = await refusal(agent.hub, OpenStore(run_id=RUN, generation=1), TOKEN.encode())
    assert "no rendezvous store of generation 1" in stale.error

    def client(relay: StoreRelay) -> dist.TCPStore:
        port = relay.endpoint.port
        return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=3))

    relay = StoreRelay(agent.hub.endpoint, stranger, TOKEN)
    await relay.start()
    rank = await asyncio.to_thread(client, relay)
    await asyncio.to_thread(rank.set, "hello", "from a rank")
    assert await asyncio.to_thread(store.get, "hello") == b"from a rank"  # (get waits: off the relaying loop)

    wrong = StoreRelay(agent.hub.endpoint, stranger, run_token(SECRET, OTHER_RUN))
    await wrong.start()
    with capture_logs() as logs, pytest.raises(dist.DistError):
        await asyncio.to_thread(client, wrong)
    assert any(e["event"] == "rendezvous store not reached" and "not authorized" in e["error"] for e in logs)
    for r in (relay, wrong):
        r.close()


async def test_a_retried_launch_keeps_the_store_its_generations_ranks_use(agent: NodeAgent) -> None:
    """A supervisor that died after launching a generation, before recording it, launches it again
    once its workflow task is replayed: the ranks already on that generation's store must keep it
    (the soak saw them crash "Failed to recv" when it was replaced). A new generation gets a new one."""
    agent.prepare(Prepare(run_id=RUN, generation=4, open_store=True))
    first = agent.stores[RUN][1]
    await asyncio.to_thread(first.set, "rank0", "joined")
    agent.prepare(Prepare(run_id=RUN, generation=4, open_store=True))
    assert agent.stores[RUN][1] is first
    assert await asyncio.to_thread(first.get, "rank0") == b"joined"
    agent.prepare(Prepare(run_id=RUN, generation=5, open_store=True))
    assert agent.stores[RUN][1] is not first and agent.stores[RUN][0] == 5


async def test_a_node_back_from_a_partition_cannot_join_the_new_generations_group(agent: NodeAgent) -> None:
    """Its ranks' relay still asks for the generation it was cut off in: the store of the run's
    current generation opens to that generation only."""
    agent.prepare(Prepare(run_id=RUN, generation=0, open_store=True))
    agent.prepare(Prepare(run_id=RUN, generation=1, open_store=True))  # the run moved on without the node
    old = await refusal(agent.hub, OpenStore(run_id=RUN, generation=0), TOKEN.encode())
    assert "no rendezvous store of generation 0" in old.error


async def test_an_agent_unread_past_its_bound_fences_itself_out(agent: NodeAgent, tmp_path: Path) -> None:
    """Ranks running, and the run's monitor silent: the agent stops them and keeps a partition report."""
    process = await start_rank(0, 3, ["sleep", "60"], {}, tmp_path / "rank-0.log")
    agent.ranks[RUN] = [process]
    channel = agent.hub.run(RUN)
    agent.fence_after[RUN] = 0.5
    fencing = asyncio.create_task(agent.fence_when_cut_off(every=0.1))
    try:
        await asyncio.sleep(0.3)
        channel.read_at = time.monotonic()  # the monitor acknowledged: not cut off
        await asyncio.sleep(0.3)
        assert agent.partitions == [] and process.exit_code is None
        async with asyncio.timeout(5):
            while not agent.partitions:
                await asyncio.sleep(0.05)
    finally:
        fencing.cancel()
    (report,) = agent.partitions
    assert (report.node, report.run_id, report.generation, report.stopped) == ("n1", RUN, 3, 1)
    assert process.exit_code is not None and RUN not in agent.ranks and RUN not in agent.fence_after


async def test_held_ranks_are_not_fenced_however_long_nobody_reads(agent: NodeAgent, tmp_path: Path) -> None:
    """A pause holds every rank and the monitor stops reading until a person resumes: not a partition."""
    process = await start_rank(0, 0, ["sleep", "60"], {}, tmp_path / "rank-0.log")
    agent.ranks[RUN] = [process]
    agent.hub.run(RUN).append(Held(rank=0, generation=0, step=10))
    agent.fence_after[RUN] = 0.2
    fencing = asyncio.create_task(agent.fence_when_cut_off(every=0.05))
    try:
        await asyncio.sleep(0.6)
    finally:
        fencing.cancel()
    assert agent.partitions == [] and process.exit_code is None
    await agent.release(RUN)


async def test_a_generations_ranks_all_reach_the_store_when_they_come_at_once(agent: NodeAgent) -> None:
    """A generation's start brings every rank's store connection to the store's hub in one burst
    (16,384 at 2,048 nodes); an accept queue of asyncio's default 100 left some hanging for ever."""
    agent.prepare(Prepare(run_id=RUN, generation=0, open_store=True))
    relays = [StoreRelay(agent.hub.endpoint, OpenStore(run_id=RUN, generation=0), TOKEN) for _ in range(BURST // 8)]
    opened = await asyncio.wait_for(asyncio.gather(*(relays[i % len(relays)]._open() for i in range(BURST))), 20)
    assert len(opened) == BURST
    for _, writer in opened:
        writer.close()


async def test_a_relay_whose_store_hub_never_answers_lets_its_rank_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank must not wait in rendezvous for ever on a connection the store's hub lost: its relay
    gives up and hangs up on it, and the rank's own store client fails."""
    monkeypatch.setattr(relay_module, "OPEN_TIMEOUT_S", 0.5)
    silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    hub = Endpoint(host="127.0.0.1", port=silent.sockets[0].getsockname()[1])
    relay = StoreRelay(hub, OpenStore(run_id=RUN, generation=0), TOKEN)
    await relay.start()
    reader, writer = await asyncio.open_connection(relay.endpoint.host, relay.endpoint.port)
    with capture_logs() as logs:
        assert await asyncio.wait_for(reader.read(), 5) == b"", "the relay hangs up on its rank"
    assert [e["event"] for e in logs] == ["rendezvous store not reached"]
    writer.close()
    relay.close()
    silent.close()
