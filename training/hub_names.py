"""Which agent keeps each node's host-memory tier (training/memory.py), as a rank learns it: no rank
is told every node's agent (that would grow each launch with the node count), so each node's local
rank 0 names its own in the generation's rendezvous store, and a rank looks up only its replica's.
"""

from __future__ import annotations

from datetime import timedelta

import structlog
import torch.distributed as dist

log = structlog.get_logger()

HUBS = "stayalive/hubs"  # in the generation's store: `stayalive/hubs/{node}` → that node's agent


def publish_hub(store: dist.Store, node: int, hub: str) -> None:
    """Name `node`'s agent in this generation's store (once per node: its local rank 0 does it)."""
    dist.PrefixStore(HUBS, store).set(str(node), hub)


def lookup_hub(store: dist.Store, node: int, timeout: timedelta = timedelta(seconds=60)) -> str | None:
    """`node`'s agent, or None when it published none within `timeout` (a node without an agent)."""
    hubs = dist.PrefixStore(HUBS, store)
    try:
        hubs.wait([str(node)], timeout)
    except dist.DistStoreError:
        log.warning("node published no agent: shards replicated there have no replica", node=node)
        return None
    return hubs.get(str(node)).decode()
