"""The fault plan: failures a run injects into itself, for tests, the demo and benchmarks.

Each fault fires in one generation (the launch it belongs to, 0 = the first), so that re-running
the same steps after a restart does not crash again; `generation: null` fires in every generation,
which is how a deterministic failure (a bad batch, a code bug) looks.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Fault(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: int | None = Field(default=0, ge=0)

    def fires_in(self, generation: int) -> bool:
        return self.generation is None or self.generation == generation


class Crash(_Fault):
    """The rank's process exits abruptly (as on an OOM kill or a GPU fell off the bus): in the middle
    of a step, or while its checkpoint writer is halfway through the shard of `at_step`."""

    kind: Literal["crash"] = "crash"
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)
    during: Literal["step", "checkpoint_write"] = "step"
    exit_code: int = Field(default=137, ge=1, le=255)

    def __str__(self) -> str:
        where = "" if self.during == "step" else " while writing its checkpoint"
        return f"crash of rank {self.rank} at step {self.at_step}{where}"


class CorruptCheckpoint(_Fault):
    """Storage damages the checkpoint of `at_step` right after it is committed (bit rot, a torn write,
    a lost file), before validation sees it."""

    kind: Literal["corrupt_checkpoint"] = "corrupt_checkpoint"
    at_step: int = Field(ge=1)
    damage: Literal["truncate_shard", "flip_byte", "delete_shard", "delete_manifest", "edit_manifest"]
    shard: int = Field(default=0, ge=0)

    def __str__(self) -> str:
        return f"{self.damage.replace('_', ' ')} in the checkpoint of step {self.at_step}"


class BrokenNode(_Fault):
    """The node's hardware is bad in a way its self-test sees: the GEMM unit returns a wrong element,
    or its collectives a wrong value. It stays bad for the rest of the node agent's life."""

    kind: Literal["broken_node"] = "broken_node"
    node: str
    part: Literal["gemm", "collective"] = "gemm"

    def __str__(self) -> str:
        return f"broken {self.part} on {self.node}"


# Each fault kind joins this union as the detector that catches it lands.
Fault = Annotated[Union[Crash, CorruptCheckpoint, BrokenNode], Field(discriminator="kind")]  # noqa: UP007
