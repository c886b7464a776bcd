"""A rank's step reports, sent to its node agent a batch at a time.

One report a step cost a rank on a shared host some 50 µs of CPU (a pydantic model, its JSON and a
loopback TCP send, each cold after the step's compute): a quarter of what the training API added to
the tiny model's step (bench.api). And reading a step's loss (`loss.item()`) makes a GPU's host wait
for the device every step. So each step's figures are kept as they come (the loss as a tensor), and
every REPORT_EVERY_STEPS steps (or REPORT_EVERY_S, for slow steps) they go in one write, their
losses read in one copy. A batch costs about the same at 4 steps as at 16 (0.1–0.25 ms, most of it
for code and data the step's compute evicted), so batches of 16 took a step's share from ~60 µs of
CPU to ~15 (bench.api); at the tests' 25 ms steps they still go every 0.4 s. By step number, so
that every rank sends the same steps together: its node agent gives a step up on (core/progress.py's
LAG, twice this) once a report that much newer arrives, and ranks whose batches were cut by their
own clocks lost steps that way. At once before anything else the rank reports from its training
thread (a checkpoint, a hold, an SDC finding), so the agent sees that thread's messages in order. A
rank that dies unannounced (killed, or `os._exit`) takes its last few reports with it: its agent's
newest step for it lags by that much.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from stayalive.core.telemetry import StepReport

REPORT_EVERY_STEPS = 16
REPORT_EVERY_S = 0.5  # far inside the hang watchdog's floor (core/detectors.py), which dates a step by its `at`


class _Step(NamedTuple):
    step: int
    compute_s: float
    step_s: float
    loss: float | torch.Tensor | None
    samples: list[int]
    at: float


class StepReports:
    """One generation's reports of one rank; `send` takes a batch of messages to write at once."""

    def __init__(self, rank: int, generation: int, send: Callable[[list[StepReport]], None]) -> None:
        self.rank, self.generation, self.send = rank, generation, send
        self._steps: list[_Step] = []
        self._sent_at = -math.inf  # a generation's first step goes at once: the run waits to hear of it

    def add(
        self, step: int, compute_s: float, step_s: float, loss: float | torch.Tensor | None, samples: list[int]
    ) -> None:
        self._steps.append(_Step(step, compute_s, step_s, loss, samples, time.time()))
        if step % REPORT_EVERY_STEPS == 0 or time.perf_counter() - self._sent_at >= REPORT_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Send what is kept, now."""
        if not self._steps:
            return
        self._sent_at = time.perf_counter()
        steps, self._steps = self._steps, []
        losses = _read([s.loss for s in steps])
        self.send(
            [
                StepReport(
                    rank=self.rank,
                    generation=self.generation,
                    step=s.step,
                    compute_s=s.compute_s,
                    step_s=s.step_s,
                    loss=loss if loss is not None and math.isfinite(loss) else None,
                    samples=s.samples,
                    at=s.at,
                )
                for s, loss in zip(steps, losses, strict=True)
            ]
        )


def _read(losses: list[float | torch.Tensor | None]) -> list[float | None]:
    """The losses as numbers, the tensors among them read in one copy to the host."""
    tensors = [loss for loss in losses if isinstance(loss, torch.Tensor)]
    values = iter(torch.stack(tensors).reshape(-1).tolist() if tensors else [])
    return [next(values) if isinstance(loss, torch.Tensor) else loss for loss in losses]
