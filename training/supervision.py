"""The hooks that make a training loop supervised: telemetry up, agreed control decisions down.

The node agent launches a rank with `STAYALIVE_*` variables; `Supervision.from_env` reads them.
Commands reach ranks on different nodes at slightly different times, so after every step all
ranks take the maximum of what each has seen (one tiny all-reduce): every rank then checkpoints
or stops at the same step, which is what keeps a checkpoint consistent across ranks.
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
from core.telemetry import Hello
from training import memory
from training.channel import AgentChannel
from training.checkpointer import MemoryTier

_faults = TypeAdapter(list[Fault])


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
    stop: bool


class Supervision:
    def __init__(self, config: SupervisionConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.channel = (
            AgentChannel(
                config.agent,
                Hello(run_id=config.run_id, rank=rank, generation=config.generation, pid=os.getpid()),
            )
            if config.agent
            else None
        )
        self._seen = {"checkpoint": 0, "exit": 0}  # highest command seq received, per kind
        self._acted = {"checkpoint": 0, "exit": 0}  # highest command seq all ranks acted on
        self._last_checkpoint = time.monotonic()

    def decide(self, step: int) -> Decision:
        """After `step`, agree with every rank whether to checkpoint now and whether to stop."""
        if self.channel is not None:
            for command in self.channel.commands():
                self._seen[command.kind] = max(self._seen[command.kind], command.seq)
        every = self.config.every_seconds
        due_by_time = every is not None and time.monotonic() - self._last_checkpoint >= every
        votes = torch.tensor([self._seen["checkpoint"], self._seen["exit"], int(due_by_time)], dtype=torch.int64)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        checkpoint_seq, exit_seq, due = (int(v) for v in votes)
        every_steps = self.config.every_steps
        checkpoint = (
            checkpoint_seq > self._acted["checkpoint"]
            or bool(due)
            or (every_steps is not None and step % every_steps == 0)
            or step == self.config.target_step
        )
        stop = exit_seq > self._acted["exit"]
        self._acted = {"checkpoint": checkpoint_seq, "exit": exit_seq}
        if checkpoint:
            self._last_checkpoint = time.monotonic()
        return Decision(checkpoint=checkpoint, stop=stop)

    def report(self, message: BaseModel) -> None:
        if self.channel is not None:
            self.channel.send(message)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
