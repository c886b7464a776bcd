"""One generation's activities: `run_ranks` on every node, and the run monitor, which reports what it
finds and each checkpoint's verdict by signal.

A generation starts one of three ways: fresh ranks restoring a checkpoint (the first launch, or
after a crash), survivors rejoining in place after a hold (drain, pause), or re-attaching to ranks
that never stopped (the next segment after continue-as-new).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from temporalio import workflow
from temporalio.workflow import ActivityHandle

from workflows import calls

with workflow.unsafe.imports_passed_through():
    from core.events import KeeperInput, MonitorInput, NodeOutcome
    from core.faults import HARDWARE
    from core.launch import NodeEndpoint, NodeLaunch, assign_ranks, supervision_env
    from core.run import RunStatus


@dataclass
class Generation:
    number: int
    nodes: dict[str, ActivityHandle[NodeOutcome]]
    # Runs until cancelled; what it finds, and each checkpoint's verdict, arrive as signals. None for a
    # plain script (no hooks): no telemetry, no checkpoints of ours.
    monitor: ActivityHandle[None] | None
    finished: set[str] = field(default_factory=set)

    def waiting(self) -> list[asyncio.Future]:
        return [task for node, task in self.nodes.items() if node not in self.finished]

    async def cancel(self) -> None:
        """Stop watching. The ranks themselves keep running until an activity stops them."""
        live = [h for h in [*self.nodes.values(), self.monitor] if h is not None and not h.done()]
        for handle in live:
            handle.cancel()
        await asyncio.gather(*live, return_exceptions=True)


def monitor(status: RunStatus, first_step: bool, checkpoint_steps: float) -> ActivityHandle[None]:
    resume = status.latest_valid_checkpoint()
    spec = status.spec
    health = spec.health
    assert status.started_at is not None
    return calls.monitor(
        MonitorInput(
            run_id=status.run_id,
            generation=status.generation,
            world_size=status.world_size,
            endpoints=status.endpoints,
            resume_step=resume.step if resume else 0,
            await_first_step=first_step,
            after=status.telemetry_cursor,
            step_timeout=None if health.step_timeout == "auto" else health.step_timeout,
            straggler_sigma=health.straggler_sigma,
            straggler_steps=health.straggler_steps,
            baseline=status.baseline,
            known_stragglers=status.known_stragglers(),  # what this generation found is not reported again
            slowdown_known=status.slowdown_known(),
            healthy_windows=health.baseline_windows,
            tally_s=health.slowness_tally,
            keeper=KeeperInput(
                root=spec.checkpoint.root,
                after=status.checkpoint_cursor,
                checkpoints=[c for c in status.checkpoints if not c.deleted],
                verified_step=status.verified_step,
                started_at=status.started_at,
                sdc_check_steps=spec.sdc.self_check_every,
                checkpoint_steps=checkpoint_steps,
            ),
        )
    )


async def endpoints(status: RunStatus, fresh_store: bool) -> list[NodeEndpoint]:
    """Every node's agent, in node order. Asked only of nodes new to the run and, for a fresh rendezvous
    store (every generation but a re-attach), of the node that hosts it: a newcomer when there is one,
    since it is asked anyway, else the first node."""
    known = {e.node: e for e in status.endpoints}
    newcomers = [n for n in status.nodes if n not in known]
    for node in newcomers:  # new to the run, or back: its agent numbers the run's records from 1 again
        status.telemetry_cursor.pop(node, None)
        status.checkpoint_cursor.pop(node, None)
    host = next(iter(newcomers), status.nodes[0]) if fresh_store else None
    asked = newcomers + ([host] if host is not None and host not in newcomers else [])
    answer_within = status.spec.health.node_heartbeat_timeout
    answers = await asyncio.gather(
        *(calls.prepare(status.run_id, status.generation, n, n == host, answer_within) for n in asked)
    )
    if host is not None:  # the last generation's store is not this one's
        known = {n: e.model_copy(update={"rendezvous": None}) for n, e in known.items()}
    known |= {e.node: e for e in answers}
    return [known[n] for n in status.nodes]


def start(status: RunStatus, checkpoint_seconds: float | None, checkpoint_steps: float) -> Generation:
    """Start (or re-attach to) the generation `status` describes; its endpoints are already known."""
    spec = status.spec
    rendezvous = next((e.rendezvous for e in status.endpoints if e.rendezvous is not None), None)
    assert rendezvous is not None, "one node hosts the generation's rendezvous store"
    membership = status.membership
    resume = status.latest_valid_checkpoint()
    env = spec.env | supervision_env(
        spec,
        status.run_id,
        status.checkpoint_dir,
        status.generation,
        resume.path if resume and membership is None else None,
        checkpoint_seconds,
        status.endpoints,
    )
    if membership is not None and membership.newcomers:
        env["STAYALIVE_STATE_FROM_RANK0"] = "1"
    if status.reattach:
        origin = "re-attached after continue-as-new"
    elif membership is not None:
        origin = "survivors rejoin in place" + (
            f", {', '.join(membership.newcomers)} joins" if membership.newcomers else ""
        )
    else:
        origin = f"from checkpoint step {resume.step}" if resume else "from scratch"
    nodes = {
        node: calls.run_ranks(
            NodeLaunch(
                run_id=status.run_id,
                node=node,
                generation=status.generation,
                ranks=ranks,
                world_size=status.world_size,
                rendezvous=rendezvous,
                entrypoint=spec.entrypoint,
                env=env,
                adopt=membership.adopt.get(node, {}) if membership else {},
                hardware=[f for f in spec.faults if isinstance(f, HARDWARE)],
            ),
            origin,
            spec.health.node_heartbeat_timeout,
        )
        for node, ranks in assign_ranks(status.nodes, spec.ranks_per_node).items()
    }
    watched = monitor(status, not status.reattach, checkpoint_steps) if spec.hooks else None
    return Generation(number=status.generation, nodes=nodes, monitor=watched)
