"""End-to-end tests share one dev stack and its fleet: each starts with the fleet settled."""

from __future__ import annotations

import pytest
from temporalio.client import Client

from tests.helpers import wait_for_fleet


@pytest.fixture(autouse=True)
async def settled_fleet(client: Client) -> None:
    """n1, n2, n3 usable and free: the self-tests and releases of earlier tests are over."""
    await wait_for_fleet(
        client, lambda nodes: all(nodes[n].state.usable and nodes[n].run_id is None for n in ("n1", "n2", "n3"))
    )
