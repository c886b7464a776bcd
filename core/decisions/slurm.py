"""A run inside a Slurm allocation, as plain decisions: which of the allocation's nodes train and
which wait as hot spares, the workflow id a requeued job finds its run under again, and which of
the nodes Slurm has taken out (drained, failing) the run should drain.

workers/slurm.py asks Slurm (`scontrol show hostnames`, `sinfo`) and acts on these answers.
"""

from __future__ import annotations

from pydantic import BaseModel

from stayalive.core.run.spec import RunSpec

# `sinfo %T` states of a node an administrator (or a health check) has taken out of service: a node
# still running jobs is DRAINING (or FAILING) until they end, and DRAINED (or FAIL) after.
OUT_OF_SERVICE = ("drain", "fail")


class Placement(BaseModel):
    """The allocation's nodes in Slurm's order: the first `train` nodes train, the rest are spares."""

    train: list[str]
    spares: list[str]


def place(allocated: list[str], train_nodes: int) -> Placement:
    """The first `train_nodes` of the allocation train; every node past them is a hot spare."""
    if train_nodes < 1:
        raise ValueError(f"--train-nodes {train_nodes}: a run trains on at least one node")
    if len(set(allocated)) != len(allocated):
        raise ValueError(f"the allocation lists a node twice: {', '.join(allocated)}")
    if len(allocated) < train_nodes:
        raise ValueError(
            f"the run trains on {train_nodes} nodes but the allocation has {len(allocated)} "
            f"({', '.join(allocated) or 'none'}): ask sbatch for at least {train_nodes} (-N {train_nodes}), "
            "or lower --train-nodes"
        )
    return Placement(train=allocated[:train_nodes], spares=allocated[train_nodes:])


def placed(spec: RunSpec, placement: Placement) -> RunSpec:
    """The spec on the allocation's nodes; the spec's own node names are for runs outside Slurm. Checked
    again as a whole, so a width that does not fit (world_size, ranks_per_node) is refused here."""
    raw = spec.model_dump(mode="json") | {"nodes": placement.train, "spare_nodes": placement.spares}
    return RunSpec.model_validate(raw)


def run_workflow_id(spec_name: str, job_id: str) -> str:
    """The same for every start of the job: a requeued job (same job id) finds its run, never a new one."""
    return f"{spec_name}-slurm-{job_id}"


class SlurmNode(BaseModel):
    name: str
    state: str  # sinfo's long state: idle, allocated, mixed, draining, drained, failing, down, …
    reason: str = ""

    @property
    def out_of_service(self) -> bool:
        return any(word in self.state for word in OUT_OF_SERVICE)


SINFO_FORMAT = "%N|%T|%E"  # name, long state, reason: one line per node with `sinfo -h -N`


def parse_sinfo(text: str) -> list[SlurmNode]:
    """`sinfo -h -N -o '%N|%T|%E'` lines; a node in several partitions is listed once."""
    nodes: dict[str, SlurmNode] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, state, reason = [*line.split("|", 2), "", ""][:3]
        reason = "" if reason.strip() == "none" else reason.strip()
        nodes.setdefault(name.strip(), SlurmNode(name=name.strip(), state=state.strip().lower(), reason=reason))
    return list(nodes.values())


def drains_to_ask(slurm: list[SlurmNode], run_nodes: list[str], run_state: str) -> list[SlurmNode]:
    """The nodes Slurm took out that the run still trains on. A run that is not RUNNING is asked once
    it is (its drain_node update refuses otherwise); a spare, or a node already out, needs nothing."""
    if run_state != "RUNNING":
        return []
    return [node for node in slurm if node.out_of_service and node.name in run_nodes]


def drain_reason(node: SlurmNode) -> str:
    return f"Slurm took {node.name} out ({node.state}): {node.reason or 'no reason given'}"


def parse_scontrol_node(text: str) -> dict[str, str]:
    """`scontrol show node -o NAME`: one line of Key=Value fields (values without spaces, but Reason=
    runs to the end of the line)."""
    head, _, reason = text.strip().partition(" Reason=")
    fields = dict(part.split("=", 1) for part in head.split() if "=" in part)
    if reason:
        fields["Reason"] = reason
    return fields


def rack_of(features: str, default: str) -> str:
    """A node's failure domain from its Slurm features: the first feature named `rack-…`, else `default`."""
    racks = [feature for feature in features.split(",") if feature.startswith("rack-")]
    return racks[0] if racks else default
