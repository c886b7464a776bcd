"""How a generation of ranks is laid out on nodes, and the environment each rank starts with.

Ranks get exactly the environment torchrun gives its workers (so any torchrun script runs
unchanged), plus `STAYALIVE_*` variables that `training.supervision` reads.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from core.faults import HardwareFault
from core.spec import RunSpec

# A rank that cannot load the checkpoint it was told to resume from exits with this code, so the
# workflow marks that checkpoint unusable and resumes from an earlier one.
EXIT_CHECKPOINT_UNUSABLE = 3
# A rank that halted at a failed SDC check exits with this code if nobody stops it first.
EXIT_SDC = 4


class Endpoint(BaseModel):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class NodeEndpoint(BaseModel):
    """What a node agent tells the workflow when it joins a run."""

    node: str
    hub: Endpoint
    rendezvous: Endpoint | None = None  # only on the node that hosts the generation's store


class NodeLaunch(BaseModel):
    run_id: str
    node: str
    generation: int
    ranks: list[int]
    world_size: int
    rendezvous: Endpoint
    entrypoint: list[str]
    env: dict[str, str]
    # Survivors of a hold: new rank → the rank the process had. They rejoin in place; every other
    # rank of `ranks` is started fresh.
    adopt: dict[int, int] = {}
    # The run's simulated hardware (fault plan: `broken_node`, GPU telemetry faults); the agent keeps
    # what concerns its node for the rest of its life, as real hardware would stay broken.
    hardware: list[HardwareFault] = []


class Membership(BaseModel):
    """The next generation's nodes after a node leaves, and which live processes carry over."""

    nodes: list[str]
    adopt: dict[str, dict[int, int]]  # node → {new rank: old rank}
    newcomers: list[str]  # nodes whose ranks start fresh and take their state from rank 0


def without_node(nodes: list[str], drop: str, spare: str | None, ranks_per_node: int) -> Membership:
    """A spare takes `drop`'s place (every rank keeps its id); without one the group shrinks and the
    survivors are renumbered in node order."""
    before = assign_ranks(nodes, ranks_per_node)
    after_nodes = [spare if n == drop else n for n in nodes] if spare else [n for n in nodes if n != drop]
    after = assign_ranks(after_nodes, ranks_per_node)
    adopt = {n: dict(zip(after[n], before[n], strict=True)) for n in after_nodes if n in before}
    return Membership(nodes=after_nodes, adopt=adopt, newcomers=[spare] if spare else [])


def node_queue(node: str) -> str:
    """Each node agent's own task queue: work for a host goes to that host (and times out if it is gone)."""
    return f"node.{node}"


def assign_ranks(nodes: list[str], ranks_per_node: int) -> dict[str, list[int]]:
    """Contiguous global ranks per node, in node order (torchrun's group-rank layout)."""
    return {node: list(range(i * ranks_per_node, (i + 1) * ranks_per_node)) for i, node in enumerate(nodes)}


def supervision_env(
    spec: RunSpec,
    run_id: str,
    checkpoint_dir: str,
    generation: int,
    resume_from: str | None,
    checkpoint_seconds: float | None,
    endpoints: list[NodeEndpoint],
) -> dict[str, str]:
    """The STAYALIVE_* variables of one generation (the node agent adds its own address)."""
    env = {
        "STAYALIVE_HUBS": json.dumps([str(e.hub) for e in endpoints]),
        "STAYALIVE_RUN_ID": run_id,
        "STAYALIVE_GENERATION": str(generation),
        "STAYALIVE_TARGET_STEP": str(spec.target_step or 0),
        "STAYALIVE_CONFIG_DIGEST": spec.config_digest,
        "STAYALIVE_CHECKPOINT_DIR": checkpoint_dir,
        "STAYALIVE_FAULTS": "[" + ",".join(f.model_dump_json() for f in spec.faults) + "]",
        "STAYALIVE_SDC": spec.sdc.model_dump_json(),
    }
    interval = spec.checkpoint.interval
    if interval.kind == "steps":
        env["STAYALIVE_CHECKPOINT_EVERY_STEPS"] = str(int(interval.value or 0))
    elif checkpoint_seconds is not None:
        env["STAYALIVE_CHECKPOINT_EVERY_SECONDS"] = f"{checkpoint_seconds:.3f}"
    if resume_from:
        env["STAYALIVE_RESUME_FROM"] = resume_from
    return env


def rank_env(launch: NodeLaunch, local_rank: int) -> dict[str, str]:
    rank = launch.ranks[local_rank]
    return {
        **launch.env,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(launch.world_size),
        "LOCAL_WORLD_SIZE": str(len(launch.ranks)),
        "GROUP_RANK": str(rank // max(1, len(launch.ranks))),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(launch.world_size),
        "MASTER_ADDR": launch.rendezvous.host,
        "MASTER_PORT": str(launch.rendezvous.port),
        # The node agent hosts the store, as torchrun's agent does; the restart count gives every
        # generation a fresh key namespace, which is what makes gloo re-rendezvous reliable.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(launch.generation),
        "TORCHELASTIC_RUN_ID": launch.run_id,
    }
