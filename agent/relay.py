"""The rendezvous store of a generation, closed to strangers.

torch's TCPStore has no authentication, lists its keys to anyone who asks (`list_keys`), and binds
every interface of its host when left to itself. So the store a node agent opens listens on loopback
only (agent/node.py's `loopback_store`), and ranks on other hosts reach it through its agent's hub, which carries a
connection to it only for a holder of the run's token (core.protocol.telemetry.OpenStore). A rank does not
speak to the hub itself (any torchrun script must run unchanged, and its env:// rendezvous knows only
MASTER_ADDR:MASTER_PORT): its own node agent listens for it on loopback (`StoreRelay`) and knocks at
the store's hub on its behalf.
"""

from __future__ import annotations

import asyncio

import structlog
from pydantic import ValidationError

from stayalive.core.protocol.access import knock
from stayalive.core.protocol.telemetry import OpenStore, StoreOpened
from stayalive.core.run.launch import Endpoint

log = structlog.get_logger()

LOOPBACK = "127.0.0.1"
# The store's hub answers a knock in milliseconds; one that does not (a lost connection) must not
# hold its rank in rendezvous for ever: the rank sees its connection close and fails.
OPEN_TIMEOUT_S = 30.0
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def splice(a: Connection, b: Connection) -> None:
    """Carry bytes both ways between two connections until either side hangs up, then close both."""

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
        finally:
            writer.close()  # the other direction's reader then sees its end too

    await asyncio.gather(pump(a[0], b[1]), pump(b[0], a[1]), return_exceptions=True)


class StoreRelay:
    """This node's door to one generation's store: the node's ranks connect to `endpoint` (their
    MASTER_ADDR:MASTER_PORT), and each connection is carried to the store's hub with the run's token."""

    def __init__(self, hub: Endpoint, opening: OpenStore, token: str) -> None:
        self.hub = hub  # the hub of the agent that hosts the store
        self.opening = opening
        self.token = token
        self._server: asyncio.Server | None = None

    async def start(self) -> Endpoint:
        self._server = await asyncio.start_server(self._carry, LOOPBACK, 0)
        return self.endpoint

    @property
    def endpoint(self) -> Endpoint:
        assert self._server is not None, "start the relay first"
        return Endpoint(host=LOOPBACK, port=self._server.sockets[0].getsockname()[1])

    def close(self) -> None:
        """No new connections; those carried already go on until their rank or the store hangs up."""
        if self._server is not None:
            self._server.close()

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await self._open()
        except (OSError, ValidationError) as exc:
            log.warning(
                "rendezvous store not reached",
                run_id=self.opening.run_id,
                generation=self.opening.generation,
                hub=str(self.hub),
                error=str(exc),
            )
            writer.close()
            return
        await splice((reader, writer), upstream)

    async def _open(self) -> Connection:
        """A connection that the store's hub has joined to the store; ConnectionError saying why not."""
        async with asyncio.timeout(OPEN_TIMEOUT_S):  # TimeoutError is an OSError
            reader, writer = await asyncio.open_connection(self.hub.host, self.hub.port)
            try:
                writer.write(knock(await reader.readline(), self.token.encode(), self.opening))
                answer = await reader.readline()
                try:
                    StoreOpened.model_validate_json(answer)
                except ValidationError:  # a Refused line: the hub's reason
                    raise ConnectionError(answer.decode(errors="replace").strip() or "the hub hung up") from None
            except BaseException:
                writer.close()
                raise
        return reader, writer
