"""The hooks that make a training loop supervised: telemetry up, agreed control decisions down.

The node agent launches a rank with `STAYALIVE_*` variables; `SupervisionConfig.from_env` reads them.
Commands reach ranks on different nodes at slightly different times, so after every step all
ranks take the maximum of what each has seen (one tiny all-reduce): every rank then checkpoints,
holds or stops at the same step, which is what keeps a checkpoint consistent across ranks.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import BaseModel, TypeAdapter

from core.faults import Fault
from core.telemetry import Command, Rejoin
from training import memory
from training.channel import AgentChannel
from training.checkpointer import MemoryTier

_faults = TypeAdapter(list[Fault])
_KINDS = ("checkpoint", "hold", "exit")


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
    state_from_rank0: bool = False  # this generation has newcomers: rank 0 hands everyone the live state
    faults: list[Fault] = field(default_factory=list)
    memory_dir: Path | None = None
    hubs: list[str] = field(default_factory=list)  # every node's agent, in node order

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
            state_from_rank0=env.get("STAYALIVE_STATE_FROM_RANK0") == "1",
            faults=_faults.validate_json(env.get("STAYALIVE_FAULTS", "[]")),
            memory_dir=Path(env["STAYALIVE_MEMORY_DIR"]) if env.get("STAYALIVE_MEMORY_DIR") else None,
            hubs=json.loads(env.get("STAYALIVE_HUBS", "[]")),
        )

    def memory_tier(self, rank: int, world_size: int, ranks_per_node: int) -> MemoryTier | None:
        """This rank's view of the host-memory tier: its node's directory, the replica's node, the others."""
        if self.memory_dir is None:
            return None
        node = rank // ranks_per_node
        others = [hub for i, hub in enumerate(self.hubs) if i != node]
        replica_node = memory.holder(rank, world_size) // ranks_per_node
        replica = self.hubs[replica_node] if replica_node != node and replica_node < len(self.hubs) else None
        return MemoryTier(directory=self.memory_dir, replica_hub=replica, hubs=others)


@dataclass(frozen=True)
class Decision:
    checkpoint: bool
    hold: bool
    stop: bool


class Supervision:
    """One generation's view: this rank, this group, the agent's channel (which outlives generations)."""

    def __init__(self, config: SupervisionConfig, rank: int, world_size: int, channel: AgentChannel | None) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.channel = channel
        self._seen = dict.fromkeys(_KINDS, 0)  # highest command seq received, per kind
        self._acted = dict.fromkeys(_KINDS, 0)  # highest command seq all ranks acted on
        self._last_checkpoint = time.monotonic()

    def decide(self, step: int) -> Decision:
        """After `step`, agree with every rank whether to checkpoint now, hold, or stop."""
        if self.channel is not None:
            for message in self.channel.received():
                if isinstance(message, Command):
                    self._seen[message.kind] = max(self._seen[message.kind], message.seq)
        every = self.config.every_seconds
        due_by_time = every is not None and time.monotonic() - self._last_checkpoint >= every
        votes = torch.tensor([*(self._seen[k] for k in _KINDS), int(due_by_time)], dtype=torch.int64)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        checkpoint_seq, hold_seq, exit_seq, due = (int(v) for v in votes)
        every_steps = self.config.every_steps
        hold = hold_seq > self._acted["hold"]
        checkpoint = (
            hold
            or checkpoint_seq > self._acted["checkpoint"]
            or bool(due)
            or (every_steps is not None and step % every_steps == 0)
            or step == self.config.target_step
        )
        stop = exit_seq > self._acted["exit"]
        self._acted = {"checkpoint": checkpoint_seq, "hold": hold_seq, "exit": exit_seq}
        if checkpoint:
            self._last_checkpoint = time.monotonic()
        return Decision(checkpoint=checkpoint, hold=hold, stop=stop)

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
