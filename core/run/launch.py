"""How a generation of ranks is laid out on nodes, and the environment each rank starts with.

Ranks get exactly the environment torchrun gives its workers (so any torchrun script runs
unchanged), plus `STAYALIVE_*` variables that `training.supervision` reads. A generation is described
once (`Launch`: the group's nodes in rank order and what every rank shares); each node agent gets
only its own part of it (`NodeLaunch`), so nothing a launch sends grows with the square of the width.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel

from stayalive.core.run.faults import HardwareFault
from stayalive.core.run.spec import Backend, RunSpec

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

    @classmethod
    def parse(cls, address: str) -> Endpoint:
        host, port = address.rsplit(":", 1)
        return cls(host=host, port=int(port))


class Launch(BaseModel):
    """One generation, as the workflow decides it: the supervisor's `launch` activity sends each node
    its part. The group is `nodes` in rank order: node i runs ranks i·R … i·R + R − 1; the first
    node's agent hosts the generation's fresh rendezvous store."""

    run_id: str
    generation: int
    nodes: list[str]
    ranks_per_node: int
    backend: Backend = "gloo"
    entrypoint: list[str]
    workdir: str | None = None
    env: dict[str, str]  # the same for every rank of the generation (the spec's env and STAYALIVE_*)
    # After a hold the survivors keep their processes: on each node the live ranks of the last
    # generation take this generation's ranks in order; only the ranks nobody holds start fresh.
    rejoin: bool = False
    newcomers: bool = False  # with `rejoin`: ranks start fresh beside the survivors (a spare took a node's place)
    # The run's simulated hardware (fault plan: `broken_node`, GPU telemetry faults); each agent keeps
    # what concerns its node for the rest of its life, as real hardware would stay broken.
    hardware: list[HardwareFault] = []
    answer_within: float  # seconds an agent has to answer before its node counts as lost
    # Where the launch raises the run's fence to this generation (core/decisions/fencing.py); None: no fence.
    checkpoint_dir: str | None = None
    fence_after: float | None = None  # HealthSpec.partition_fence: an agent unread this long fences itself

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.ranks_per_node

    def ranks_of(self, index: int) -> list[int]:
        return list(range(index * self.ranks_per_node, (index + 1) * self.ranks_per_node))

    def origin(self) -> str:
        """Where the generation's state comes from, for a person reading the history."""
        if self.rejoin:
            return "survivors rejoin in place" + (", newcomers load the held checkpoint" if self.newcomers else "")
        resume = self.env.get("STAYALIVE_RESUME_FROM")
        return f"from checkpoint {resume.rstrip('/').rsplit('/', 1)[-1]}" if resume else "from scratch"


class NodeLaunch(BaseModel):
    """One node's part of a Launch: what its agent needs to start (or rejoin) its ranks."""

    run_id: str
    node: str
    generation: int
    ranks: list[int]
    world_size: int
    rendezvous: Endpoint  # the hub of the agent that hosts the generation's store
    entrypoint: list[str]
    workdir: str | None = None
    env: dict[str, str]
    rejoin: bool = False
    hardware: list[HardwareFault] = []
    fence_after: float | None = None  # unread by the run's monitor this long, the agent stops these ranks

    @classmethod
    def of(cls, launch: Launch, index: int, rendezvous: Endpoint) -> NodeLaunch:
        return cls(
            run_id=launch.run_id,
            node=launch.nodes[index],
            generation=launch.generation,
            ranks=launch.ranks_of(index),
            world_size=launch.world_size,
            rendezvous=rendezvous,
            entrypoint=launch.entrypoint,
            workdir=launch.workdir,
            env=launch.env,
            rejoin=launch.rejoin,
            hardware=launch.hardware,
            fence_after=launch.fence_after,
        )


class Launched(BaseModel):
    """What the `launch` activity reports: the generation started on every node; or the nodes whose
    agents did not answer in time (then nothing was started, or what was started waits in vain for
    them and is stopped by the next launch); or the nodes that answered they cannot run it (then
    nothing was started: no other node would do better with the same spec)."""

    rendezvous: str | None = None
    unreachable: dict[str, str] = {}  # node → why, e.g. "no answer within 15s"
    refused: dict[str, str] = {}  # node → why, e.g. "backend nccl needs CUDA; torch here sees no GPU"

    @property
    def started(self) -> bool:
        return not self.unreachable and not self.refused


class Membership(BaseModel):
    """The next generation's nodes after a hold: the survivors keep their processes (and memory),
    newcomers start fresh and load the checkpoint of the held step."""

    nodes: list[str]
    newcomers: list[str] = []


def without_node(nodes: list[str], drop: str | None, spare: str | None) -> Membership:
    """A spare takes `drop`'s place (every rank keeps its id); without one the group shrinks and the
    survivors are renumbered in node order."""
    if drop is None:
        return Membership(nodes=list(nodes))
    after = [spare if n == drop else n for n in nodes] if spare else [n for n in nodes if n != drop]
    return Membership(nodes=after, newcomers=[spare] if spare else [])


def node_of(nodes: list[str], ranks_per_node: int, rank: int) -> str | None:
    """The node that runs `rank` (contiguous ranks per node, in node order)."""
    index = rank // ranks_per_node
    return nodes[index] if rank >= 0 and index < len(nodes) else None


def assign_ranks(nodes: list[str], ranks_per_node: int) -> dict[str, list[int]]:
    """Contiguous global ranks per node, in node order (torchrun's group-rank layout)."""
    return {node: list(range(i * ranks_per_node, (i + 1) * ranks_per_node)) for i, node in enumerate(nodes)}


# A collective that fails or times out raises in its rank, which keeps its process (CleanUpOnly), so
# the rank reports and exits as a rank does, instead of NCCL tearing the process down.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def supervision_env(
    spec: RunSpec,
    run_id: str,
    checkpoint_dir: str,
    generation: int,
    resume_from: str | None,
    checkpoint_seconds: float | None,
) -> dict[str, str]:
    """The STAYALIVE_* variables of one generation (each node agent adds its own address)."""
    env = {
        "STAYALIVE_RUN_ID": run_id,
        "STAYALIVE_GENERATION": str(generation),
        "STAYALIVE_TARGET_STEP": str(spec.target_step or 0),
        "STAYALIVE_CONFIG_DIGEST": spec.config_digest,
        "STAYALIVE_BACKEND": spec.backend,
        "STAYALIVE_CHECKPOINT_DIR": checkpoint_dir,
        "STAYALIVE_FAULTS": "[" + ",".join(f.model_dump_json() for f in spec.faults) + "]",
        "STAYALIVE_SDC": spec.sdc.model_dump_json(),
    }
    if spec.backend == "nccl":
        env["STAYALIVE_COLLECTIVE_TIMEOUT"] = f"{spec.health.collective_timeout:g}"
        env |= {name: value for name, value in NCCL_ENV.items() if name not in spec.env}  # the spec's own win
    interval = spec.checkpoint.interval
    if interval.kind == "steps":
        env["STAYALIVE_CHECKPOINT_EVERY_STEPS"] = str(int(interval.value or 0))
    elif checkpoint_seconds is not None:
        env["STAYALIVE_CHECKPOINT_EVERY_SECONDS"] = f"{checkpoint_seconds:.3f}"
    if resume_from:
        env["STAYALIVE_RESUME_FROM"] = resume_from
    return env


def rank_env(
    launch: NodeLaunch, local_rank: int, store: Endpoint, inherited: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The torchrun environment of one rank; `store` is where it reaches the generation's rendezvous
    store: its own node agent's relay, not the store itself (agent/relay.py). `inherited` is the
    environment the rank gets from its agent, which this adds to."""
    rank = launch.ranks[local_rank]
    chosen = {**(inherited or {}), **launch.env}
    return {
        # torchrun's default where a node runs several ranks, unless the spec or the agent chose: one
        # OpenMP thread each, where each would otherwise take every core and the node's ranks thrash.
        **({"OMP_NUM_THREADS": "1"} if len(launch.ranks) > 1 and "OMP_NUM_THREADS" not in chosen else {}),
        **launch.env,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(launch.world_size),
        "LOCAL_WORLD_SIZE": str(len(launch.ranks)),
        "GROUP_RANK": str(rank // max(1, len(launch.ranks))),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(launch.world_size),
        "MASTER_ADDR": store.host,
        "MASTER_PORT": str(store.port),
        # The node agent hosts the store, as torchrun's agent does; the restart count gives every
        # generation a fresh key namespace, which is what makes gloo re-rendezvous reliable.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(launch.generation),
        "TORCHELASTIC_RUN_ID": launch.run_id,
    }
