"""A node agent that stops while the run monitor still reads its hub ends quietly: its process's
event loop cancels the hub's open connections, and that is no error to log."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from stayalive.activities.hubs import open_hub
from stayalive.agent.hub import NodeHub
from stayalive.core.protocol.telemetry import Subscribe

SECRET = b"the fleet's secret, 32 bytes ok"


async def serve_one_reader(memory: Path) -> None:
    """A hub with a reader streaming from it when the loop ends (asyncio.run cancels what is left)."""
    hub = NodeHub("n1", "127.0.0.1", memory, SECRET)
    await hub.start()
    reader, _ = await open_hub(str(hub.endpoint), Subscribe(run_id="tiny/0000abcd"), SECRET)
    assert json.loads(await reader.readline())["t"] == "beat"


def test_a_hub_stopped_with_a_reader_connected_logs_no_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(serve_one_reader(tmp_path / "memory"))
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]
