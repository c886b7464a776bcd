"""The detection tests' runs: the tiny GPT with simulated device time, checkpointed every 50 steps."""

from __future__ import annotations

from pathlib import Path

from harness.tiny import TINY_ENTRYPOINT
from stayalive.core.run.spec import RunSpec
from tests.helpers import tiny_spec

HEALTH: dict[str, object] = {"baseline_windows": 2, "straggler_steps": 20}


# Simulated device time per step makes compute times as steady as a GPU's (see --device-ms): four
# or eight ranks sharing two cores otherwise jitter by tens of percent. 30 ms makes compute about
# three quarters of a step, as on a GPU, so a slowdown of compute shows in the step time.
def detection_spec(root: Path, device_ms: int = 30, health: dict[str, object] = HEALTH, **overrides: object) -> RunSpec:
    return tiny_spec(
        root,
        entrypoint=[*TINY_ENTRYPOINT[:-1], str(device_ms)],
        checkpoint={"root": str(root), "interval": "50 steps"},
        health=health,
        **overrides,
    )
