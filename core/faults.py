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
    """The rank's process exits abruptly (as on an OOM kill or a GPU fell off the bus)."""

    kind: Literal["crash"] = "crash"
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)
    exit_code: int = Field(default=137, ge=1, le=255)


# One member for now; each fault kind joins this union as its detector lands.
Fault = Annotated[Union[Crash], Field(discriminator="kind")]  # noqa: UP007
