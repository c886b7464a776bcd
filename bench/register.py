"""A whole cluster's node agents registering at once, for real: farms of NodeHub + NodeAgent pairs
(sim/hub_farm.py), each agent with its own Temporal client as deployed, before the real supervisor
worker and FleetWorkflow on `temporal server start-dev`. Measured:

    register     from spawning the farms (their own start-up included) to the fleet listing every
                 node's hub (query `hubs`)
    resent       registrations an agent had to send again (its log's "not sent; retrying")
    query        the fleet's `hubs` query, p50 of QUERIES, once every agent is in, as a ratio to the
                 same query on the same fleet before any agent started (the baseline, this run)

Bars: every agent listed within 60 s, none sent again, and the fleet answers within 5× its idle time.

    python -m bench.register [--quick] [--nodes N]      # --quick: 512 nodes; default 2,056 (2,048 + 8 spares)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from temporalio.service import RPCError

from stayalive.sim.hub_farm import farm_command, node_name, until
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.secret import create_secret
from stayalive.workers.temporal import connect, plain
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle

QUERIES = 20
# Four farm processes at 2,056: registration needs no ranks, and fewer processes leave the two cores
# to the agents, the supervisor and the server.
NODES_PER_FARM = 514
REGISTER_WITHIN_S = 60.0
QUERY_RATIO_BAR = 5.0


async def query_p50(stack: DevStack, nodes: list[str]) -> float:
    fleet = fleet_handle(await connect(plain(stack.address)))
    took = []
    for _ in range(QUERIES):
        began = time.monotonic()
        await fleet.query(FleetWorkflow.hubs, nodes)
        took.append(time.monotonic() - began)
        await asyncio.sleep(0.1)
    return statistics.median(took)


def measure(nodes: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix=f"bench-register-{nodes}-"))
    names = [node_name(i) for i in range(nodes)]
    stack = DevStack(state_dir=root, nodes=names, ui_port=None, port=free_port(), metrics_port=free_port())
    create_secret(stack.secret_file)
    try:
        stack.start_temporal()
        stack.start_supervisor()
        asyncio.run(_fleet_up(stack))
        idle = asyncio.run(query_p50(stack, names))
        began = time.monotonic()
        for farm, first in enumerate(range(0, nodes, NODES_PER_FARM)):
            count = min(NODES_PER_FARM, nodes - first)
            stack.spawn(f"farm-{farm}", farm_command(stack, first, count, nodes, root / f"farm-{farm}.jsonl"))
        asyncio.run(stack.ready(timeout=600))
        registered = time.monotonic() - began
        busy = asyncio.run(query_p50(stack, names))
    finally:
        stack.stop()
    resent = sum(log.read_text().count("not sent; retrying") for log in (root / "logs").glob("farm-*.log"))
    return {"register_s": round(registered, 1), "resent": resent, "query_ratio": round(busy / idle, 2)}


async def _fleet_up(stack: DevStack) -> None:
    """The supervisor starts the fleet: wait until it answers a query."""
    fleet = fleet_handle(await connect(plain(stack.address)))

    async def answers() -> bool:
        try:
            await fleet.query(FleetWorkflow.hubs, [])
        except RPCError:  # not started yet
            return False
        return True

    await until(answers, 60, "the fleet workflow")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.register", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="512 nodes (about a minute)")
    parser.add_argument("--nodes", type=int, help="how many agents (default 2,056; --quick 512)")
    args = parser.parse_args()
    nodes = args.nodes or (512 if args.quick else 2056)
    figures = measure(nodes)
    bar = (
        figures["register_s"] <= REGISTER_WITHIN_S
        and figures["resent"] == 0
        and figures["query_ratio"] <= QUERY_RATIO_BAR
    )
    print(json.dumps({"bench": "register", "nodes": nodes, **figures, "bar": bar}))


if __name__ == "__main__":
    main()
