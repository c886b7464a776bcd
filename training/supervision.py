"""The hooks that make a training loop supervised: telemetry up, agreed control decisions down.

The node agent launches a rank with `STAYALIVE_*` variables; `SupervisionConfig.from_env` reads them.
Commands reach ranks on different nodes at slightly different times, so every step all ranks pool
what each has received, in a few extra slots of the gradient all-reduce (no collective of its
own): every rank then checkpoints, holds or stops at the same step, which is what keeps a
checkpoint consistent across ranks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import BaseModel, TypeAdapter

from stayalive.core.judgement.hangs import Site
from stayalive.core.protocol.telemetry import Command, Rejoin
from stayalive.core.run.faults import Fault
from stayalive.core.run.spec import SdcSpec
from stayalive.training import collectives, hub_names, memory
from stayalive.training.channel import AgentChannel
from stayalive.training.memory import MemoryTier

_faults = TypeAdapter(list[Fault])
_KINDS = ("checkpoint", "hold", "exit", "rebalance", "interval")
VOTES = len(_KINDS) + 1  # the slots `Supervision.votes` adds to the gradient all-reduce


@dataclass(frozen=True)
class SupervisionConfig:
    run_id: str
    generation: int
    target_step: int
    checkpoint_dir: Path
    config_digest: str = ""
    agent: str | None = None
    every_steps: int | None = None
    every_seconds: float | None = None
    resume_from: Path | None = None
    faults: list[Fault] = field(default_factory=list)
    sdc: SdcSpec = field(default_factory=SdcSpec)
    memory_dir: Path | None = None
    run_token: str = ""  # what opens this run's doors at node agents' hubs (core.protocol.access)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> SupervisionConfig:
        env = dict(os.environ if env is None else env)
        missing = [k for k in ("STAYALIVE_RUN_ID", "STAYALIVE_TARGET_STEP", "STAYALIVE_CHECKPOINT_DIR") if k not in env]
        if missing:
            raise SystemExit(f"not launched by stayalive: {', '.join(missing)} unset (run it through a RunSpec)")
        return cls(
            run_id=env["STAYALIVE_RUN_ID"],
            generation=int(env.get("STAYALIVE_GENERATION", "0")),
            target_step=int(env["STAYALIVE_TARGET_STEP"]),
            checkpoint_dir=Path(env["STAYALIVE_CHECKPOINT_DIR"]),
            config_digest=env.get("STAYALIVE_CONFIG_DIGEST", ""),
            agent=env.get("STAYALIVE_AGENT"),
            every_steps=int(env["STAYALIVE_CHECKPOINT_EVERY_STEPS"])
            if "STAYALIVE_CHECKPOINT_EVERY_STEPS" in env
            else None,
            every_seconds=float(env["STAYALIVE_CHECKPOINT_EVERY_SECONDS"])
            if "STAYALIVE_CHECKPOINT_EVERY_SECONDS" in env
            else None,
            resume_from=Path(env["STAYALIVE_RESUME_FROM"]) if env.get("STAYALIVE_RESUME_FROM") else None,
            faults=_faults.validate_json(env.get("STAYALIVE_FAULTS", "[]")),
            sdc=SdcSpec.model_validate_json(env.get("STAYALIVE_SDC", "{}")),
            memory_dir=Path(env["STAYALIVE_MEMORY_DIR"]) if env.get("STAYALIVE_MEMORY_DIR") else None,
            run_token=env.get("STAYALIVE_RUN_TOKEN", ""),
        )

    def memory_tier(self, store: dist.Store, rank: int, world_size: int, ranks_per_node: int) -> MemoryTier | None:
        """This rank's view of the host-memory tier: its node's directory and agent, and the agent of its
        replica's node, as that node published it in the generation's store."""
        if self.memory_dir is None or self.agent is None:
            return None
        node = rank // ranks_per_node
        replica_node = memory.holder(rank, world_size) // ranks_per_node
        replica = hub_names.lookup_hub(store, replica_node) if replica_node != node else None
        return MemoryTier(directory=self.memory_dir, hub=self.agent, replica_hub=replica, token=self.run_token)


@dataclass(frozen=True)
class Decision:
    checkpoint: bool
    hold: bool
    stop: bool
    speeds: list[float] | None = None  # rebalance from the next step on, by these relative speeds


NOTHING = Decision(checkpoint=False, hold=False, stop=False)


class Supervision:
    """One generation's view: this rank, this group, the agent's channel (which outlives generations)."""

    def __init__(
        self,
        config: SupervisionConfig,
        rank: int,
        world_size: int,
        channel: AgentChannel | None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """`group`: where ranks agree on a command's payload (None: the default group)."""
        self.config = config
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.channel = channel
        self._seqs: set[int] = set()  # of the commands received: a retried delivery is not a new command
        self._seen = dict.fromkeys(_KINDS, 0)  # commands received, per kind
        self._acted = dict.fromkeys(_KINDS, 0)  # commands all ranks acted on, per kind
        self._last_checkpoint = time.monotonic()
        self.every_seconds = config.every_seconds  # the checkpoint interval in force (an `interval` command moves it)
        self._speeds: list[float] = []  # of the newest rebalance command received
        self._seconds = 0.0  # of the newest interval command received
        self._due_by_time = False
        self._vote = torch.zeros(VOTES)
        self._settled = [0.0] * len(_KINDS)  # summed counts that hold no news: most steps' again

    def votes(self) -> torch.Tensor:
        """This rank's vote, to ride the gradient all-reduce (SUM): how many commands of each kind it has
        received, and whether its checkpoint clock is due. Riding it costs no collective."""
        received = self.channel.received() if self.channel is not None else []
        for message in received:
            if isinstance(message, Command) and message.seq not in self._seqs:
                self._seqs.add(message.seq)
                self._seen[message.kind] += 1
                if message.kind == "rebalance":
                    self._speeds = message.speeds
                elif message.kind == "interval" and message.seconds is not None:
                    self._seconds = message.seconds
        every = self.every_seconds
        due_by_time = every is not None and time.monotonic() - self._last_checkpoint >= every
        if received or due_by_time != self._due_by_time:  # most steps the vote is last step's: reused
            self._due_by_time = due_by_time
            self._vote = torch.tensor([*(float(self._seen[k]) for k in _KINDS), float(due_by_time)])
        return self._vote

    def decide(self, step: int, votes: list[float]) -> Decision:
        """After `step`, from every rank's `votes` summed: checkpoint now, hold, stop, rebalance.

        Commands reach ranks at different times, so a kind has news when its summed counts exceed
        what all ranks acted on (W × acted): one rank's sighting is enough, and every rank sees the
        same sum, so all act at this step. Afterwards `acted` is the sum's ceiling share (at most the
        largest count): the same command seen later by the others is not news again, a newer one is,
        and no command is acted on more often than commands were sent."""
        world, every_steps = self.world_size, self.config.every_steps
        *counts, due_by_time = votes
        scheduled = (every_steps is not None and step % every_steps == 0) or step == self.config.target_step
        if counts == self._settled and not (due_by_time or scheduled):
            return NOTHING  # most steps
        sums = {kind: round(count) for kind, count in zip(_KINDS, counts, strict=True)}
        news = {kind: sums[kind] > world * self._acted[kind] for kind in _KINDS}
        checkpoint = news["hold"] or news["checkpoint"] or due_by_time > 0 or scheduled
        speeds = self._agree_on_newest("rebalance", self._speeds, self.world_size) if news["rebalance"] else None
        if news["interval"] and (seconds := self._agree_on_newest("interval", [self._seconds], 1)[0]) > 0:
            self.every_seconds = seconds
        self._acted = {kind: -(-sums[kind] // world) if news[kind] else self._acted[kind] for kind in _KINDS}
        self._settled = counts  # with `acted` as it is now, these counts hold no news
        if checkpoint:
            self._last_checkpoint = time.monotonic()
        return Decision(checkpoint=checkpoint, hold=news["hold"], stop=news["exit"], speeds=speeds)

    def _agree_on_newest(self, kind: str, payload: list[float], size: int) -> list[float]:
        """A rebalance or an interval carries a payload that ranks which have not received it yet cannot
        vote on (rare: two small collectives). The newest command of `kind` any rank has received wins
        (the most received); the ranks that have it contribute its (positive) payload of `size`
        values, the rest zeros; the MAX is its."""
        newest = torch.tensor([self._seen[kind]], dtype=torch.int64)
        collectives.all_reduce(newest, Site.AGREEMENT, op=dist.ReduceOp.MAX, group=self.group)
        values = torch.zeros(size, dtype=torch.float64)
        if self._seen[kind] == int(newest) and len(payload) == size:
            values[:] = torch.tensor(payload, dtype=torch.float64)
        collectives.all_reduce(values, Site.AGREEMENT, op=dist.ReduceOp.MAX, group=self.group)
        return [float(v) for v in values]

    def await_rejoin(self, timeout: float = 3600.0) -> Rejoin | None:
        """Holding: wait for the next generation's membership; None means exit (told to, or nobody called)."""
        deadline = time.monotonic() + timeout
        while self.channel is not None and (left := deadline - time.monotonic()) > 0:
            message = self.channel.next(timeout=left)
            if isinstance(message, Rejoin):
                return message
            if isinstance(message, Command) and message.kind == "exit":
                return None
        return None

    def report(self, message: BaseModel) -> None:
        if self.channel is not None:
            self.channel.send(message)
