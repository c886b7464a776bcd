"""Progress of one generation, folded from per-rank step reports (the run monitor's live summary)."""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np

from core.run import Progress
from core.telemetry import StepReport

_WINDOW = 50  # steps over which rates and step-time percentiles are taken


class ProgressTracker:
    def __init__(self, world_size: int, generation: int) -> None:
        self.world_size = world_size
        self.generation = generation
        self.last: dict[int, StepReport] = {}
        self._completions: deque[tuple[int, float]] = deque(maxlen=_WINDOW)  # (step, time all ranks had it)
        self._step_seconds: deque[float] = deque(maxlen=_WINDOW * 8)

    def observe(self, report: StepReport) -> int | None:
        """Fold in one report; return the step every rank has now completed, when that advanced."""
        if report.generation != self.generation:
            return None
        before = self.step
        self.last[report.rank] = report
        self._step_seconds.append(report.step_s)
        after = self.step
        if after > before:
            self._completions.append((after, max(r.at for r in self.last.values())))
            return after
        return None

    @property
    def step(self) -> int:
        """The newest step completed by every rank (synchronous training: all ranks are within one step)."""
        if len(self.last) < self.world_size:
            return 0
        return min(r.step for r in self.last.values())

    def summary(self) -> Progress:
        rate = 0.0
        if len(self._completions) >= 2:
            (s0, t0), (s1, t1) = self._completions[0], self._completions[-1]
            rate = (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0
        slowest = max(self.last.values(), key=lambda r: r.compute_s, default=None)
        losses = [r.loss for r in self.last.values() if r.loss is not None]
        return Progress(
            step=self.step,
            loss=statistics.fmean(losses) if losses else None,
            steps_per_second=rate,
            step_seconds_p50=statistics.median(self._step_seconds) if self._step_seconds else 0.0,
            step_seconds_max=max(self._step_seconds, default=0.0),
            slowest_rank=slowest.rank if slowest else None,
            at=self._completions[-1][1] if self._completions else 0.0,
        )


class StepVectors:
    """Per-step vectors of every rank's compute and step seconds, in rank order, for the detectors.

    A step is complete when every rank has reported it; a rank whose report was lost (telemetry is
    best-effort) leaves a NaN once `lag` newer steps are complete, so memory stays bounded."""

    def __init__(self, world_size: int, lag: int = 4) -> None:
        self.world_size = world_size
        self.lag = lag
        self._compute: dict[int, np.ndarray] = {}
        self._step: dict[int, np.ndarray] = {}
        self._seen: dict[int, int] = {}
        self._emitted = 0

    def add(self, report: StepReport) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Fold in one report; return (step, compute seconds, step seconds) of the steps now complete."""
        step = report.step
        if step <= self._emitted or not 0 <= report.rank < self.world_size:
            return []
        if step not in self._compute:
            self._compute[step] = np.full(self.world_size, np.nan)
            self._step[step] = np.full(self.world_size, np.nan)
            self._seen[step] = 0
        self._compute[step][report.rank] = report.compute_s
        self._step[step][report.rank] = report.step_s
        self._seen[step] += 1
        ready = [s for s in sorted(self._compute) if self._seen[s] == self.world_size or s <= step - self.lag]
        out = []
        for s in ready:
            if s <= self._emitted:
                continue
            out.append((s, self._compute.pop(s), self._step.pop(s)))
            del self._seen[s]
            self._emitted = s
        for stale in [s for s in self._compute if s <= self._emitted]:  # overtaken by a complete newer step
            del self._compute[stale], self._step[stale], self._seen[stale]
        return out
