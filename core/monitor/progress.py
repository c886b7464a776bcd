"""Progress of one generation, folded from per-rank step reports: by each node agent into one
record per node per step (`StepBatcher`), and by the run monitor into per-step vectors of every
rank for the detectors and the live summary (`StepIngest`). Pure: no I/O.

Width decides the split (docs/architecture.md §4). At 16,384 ranks a step brings 16,384 reports; the agents turn
them into 2,048 node frames, the monitor keeps each frame as the bytes it came in (O(1)), and decodes
everything pending in one numpy pass over the joined bytes. No Python loop runs per rank, and the
work per frame is an append.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from stayalive.core.protocol.telemetry import NodeSteps, StepReport, steps_frame
from stayalive.core.run.status import Progress

_WINDOW = 50  # steps over which rates and step-time percentiles are taken
# A step still missing reports is given up on once a report this many steps newer arrives: twice what
# a rank holds back before it sends (training/step_reports.py), so a healthy rank's step is never late.
LAG = 32

# ── node agent: its ranks' reports → one NodeSteps per step ─────────────────────────────────────────


class _NodeStep:
    """The reports of one step on one node, as they arrive (a node has a handful of ranks)."""

    def __init__(self, size: int) -> None:
        self.compute_s = [math.nan] * size
        self.step_s = [math.nan] * size
        self.loss: list[float | None] = [None] * size
        self.samples: list[list[int]] = [[] for _ in range(size)]
        self.reported = [False] * size
        self.count = 0
        self.at = -math.inf

    def put(self, index: int, report: StepReport) -> None:
        if not self.reported[index]:  # a report sent twice counts once
            self.reported[index] = True
            self.count += 1
        self.compute_s[index], self.step_s[index] = report.compute_s, report.step_s
        self.loss[index], self.samples[index] = report.loss, report.samples
        self.at = max(self.at, report.at)


class StepBatcher:
    """Folds one node's ranks' StepReports (of one run and generation) into one NodeSteps per step.

    Step s goes out once every rank of the node has reported it; partial (NaN where a report is
    missing) once a newer step is complete, or once some rank is `lag` steps ahead: a lost report or
    a dead rank must not hold the node's telemetry back. Steps go out in order, each once; a report
    for a step already out is dropped. At most `lag` steps are gathered at a time, so memory is
    bounded, and a report costs O(lag) at most, independent of the run's width.
    """

    def __init__(self, generation: int, ranks: range, lag: int = LAG) -> None:
        if ranks.step != 1 or not ranks or lag < 1:
            raise ValueError("a node's ranks are a non-empty contiguous range, and lag at least 1")
        self.generation = generation
        self.ranks = ranks
        self.lag = lag
        self._pending: dict[int, _NodeStep] = {}
        self._newest = 0  # the newest step any of the node's ranks has reported
        self._emitted = 0  # every step up to here has gone out (or was given up on)

    @property
    def steps_pending(self) -> int:
        return len(self._pending)

    def add(self, report: StepReport) -> list[NodeSteps]:
        """Fold in one report; return the node's steps now ready, oldest first."""
        if report.generation != self.generation or report.rank not in self.ranks:
            return []
        step = report.step
        self._newest = max(self._newest, step)
        if step > max(self._emitted, self._newest - self.lag):
            gathering = self._pending.get(step)
            if gathering is None:
                gathering = self._pending[step] = _NodeStep(len(self.ranks))
            gathering.put(report.rank - self.ranks.start, report)
            if gathering.count == len(self.ranks):
                return self._emit_through(step)  # older steps still gathering go out partial first
        return self._emit_through(self._newest - self.lag)

    def flush(self) -> list[NodeSteps]:
        """Everything still gathering, partial, oldest first: a rank exited and will not report again."""
        return self._emit_through(max(self._pending, default=self._emitted))

    def _emit_through(self, last: int) -> list[NodeSteps]:
        ready = sorted(step for step in self._pending if step <= last)
        self._emitted = max(self._emitted, last)
        return [self._batch(step, self._pending.pop(step)) for step in ready]

    def _batch(self, step: int, gathered: _NodeStep) -> NodeSteps:
        return NodeSteps(
            generation=self.generation,
            step=step,
            first_rank=self.ranks.start,
            compute_s=gathered.compute_s,
            step_s=gathered.step_s,
            loss=gathered.loss,
            samples=gathered.samples,
            at=gathered.at,
        )


# ── run monitor: node frames → per-step vectors of every rank, and the live summary ─────────────────


@dataclass(frozen=True, eq=False)
class CompletedStep:
    """One step of every rank, indexed by rank, NaN where a rank's report never reached the monitor."""

    step: int
    at: float  # when the step's newest report was made, over every node
    compute_s: npt.NDArray[np.float64]
    step_s: npt.NDArray[np.float64]
    loss: npt.NDArray[np.float64]  # NaN also where a rank's loss was not finite
    # The run's step time: the median of the ranks' step seconds that came in (NaN if none did),
    # taken once, by one partition. It is what AbsoluteSlowdown takes of a vector and what the hang
    # watchdog and the healthy windows want; np.nanmedian over 16,384 ranks costs ~0.3 ms a call.
    step_time: float


class _Gathered:
    """One step's vectors on the monitor as node frames come in, shaped (node, rank on the node)."""

    def __init__(self, nodes: int, ranks_per_node: int) -> None:
        self.compute_s = np.full((nodes, ranks_per_node), np.nan)
        self.step_s = np.full((nodes, ranks_per_node), np.nan)
        self.loss = np.full((nodes, ranks_per_node), np.nan)
        self.seen = np.zeros(nodes, dtype=bool)
        self.nodes_in = 0
        self.at = -math.inf

    def scatter(self, frames: _Frames) -> None:
        self.compute_s[frames.node] = frames.compute_s
        self.step_s[frames.node] = frames.step_s
        self.loss[frames.node] = frames.loss
        self.seen[frames.node] = True  # a frame sent twice (a resubscription) counts once
        self.nodes_in = int(np.count_nonzero(self.seen))
        self.at = max(self.at, float(frames.at.max()))

    def completed(self, step: int) -> CompletedStep:
        step_s = self.step_s.ravel()
        present = step_s[~np.isnan(step_s)] if np.isnan(step_s).any() else step_s
        step_time = _median(present) if present.size else math.nan
        return CompletedStep(step, self.at, self.compute_s.ravel(), step_s, self.loss.ravel(), step_time)


class _Frames(NamedTuple):
    """Decoded frames, one plain array per field: indexing a structured array copies whole records
    (slow); indexing a field's view copies only that field."""

    step: np.ndarray
    node: np.ndarray
    at: np.ndarray
    compute_s: np.ndarray  # (frames, ranks_per_node), float32 as framed
    step_s: np.ndarray
    loss: np.ndarray

    def take(self, rows: np.ndarray) -> _Frames:
        return _Frames(*(field[rows] for field in self))


def _median(values: np.ndarray) -> float:
    """The median of a non-empty NaN-free vector by one partition: np.median costs several times more."""
    half = values.size // 2
    part = np.partition(values, half)
    if values.size % 2:
        return float(part[half])
    return float((part[half] + part[:half].max()) / 2)


# The summary's reductions take the plain path first and filter only when it meets a NaN: when every
# report is in, that is what they cost, and the NaN-aware versions cost several times as much.


def _finite_mean(values: np.ndarray) -> float | None:
    mean = float(values.mean())
    if math.isfinite(mean):
        return mean
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else None


def _slowest(values: np.ndarray) -> int | None:
    """The index of the largest value, ignoring NaN; None when all are NaN."""
    index = int(np.argmax(values))  # the first NaN, if there is one
    if not math.isnan(values[index]):
        return index
    return None if np.isnan(values).all() else int(np.nanargmax(values))


class StepIngest:
    """The run monitor's view of one generation's steps, from its nodes' NodeSteps frames.

    `add` keeps a frame's bytes and nothing else; `complete` decodes every frame pending in one
    `np.frombuffer`, so call it once per batch read from the sockets (or per tick), not per frame.
    A step is complete once every node's frame for it is in. One with frames missing is complete
    once a newer step is (each node sends its steps in order, so nothing more can come for it) or
    once a frame `lag` steps newer arrives (a silent node must not stall the detectors): its
    missing ranks stay NaN, and at most `lag` steps are gathered at a time.
    """

    def __init__(self, world_size: int, ranks_per_node: int, generation: int, lag: int = LAG) -> None:
        if ranks_per_node < 1 or world_size < 1 or world_size % ranks_per_node or lag < 1:
            raise ValueError("world_size must be a positive multiple of ranks_per_node, and lag at least 1")
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.nodes = world_size // ranks_per_node
        self.generation = generation
        self.lag = lag
        self._dtype = steps_frame(ranks_per_node)
        self._unread: list[bytes] = []  # frames as they came, decoded by the next `complete`
        self._pending: dict[int, _Gathered] = {}
        self._newest = 0
        self._emitted = 0
        # For the summary: the newest step out, and per step out its (step, at) and its step
        # seconds' median and maximum over ranks, for the last _WINDOW steps.
        self._last: CompletedStep | None = None
        self._completions: deque[tuple[int, float]] = deque(maxlen=_WINDOW)
        self._step_medians: deque[float] = deque(maxlen=_WINDOW)
        self._step_maxima: deque[float] = deque(maxlen=_WINDOW)

    @property
    def steps_pending(self) -> int:
        return len(self._pending)

    def add(self, frame: bytes) -> None:
        """Keep one frame (`steps_frame(ranks_per_node)` bytes) for the next `complete`."""
        self._unread.append(frame)

    def complete(self) -> list[CompletedStep]:
        """Decode the frames added since the last call; return the steps now complete, oldest first."""
        if self._unread:
            records = np.frombuffer(b"".join(self._unread), dtype=self._dtype)
            self._unread.clear()
            self._gather(records)
        return self._ready()

    def summary(self) -> Progress:
        """The live summary: the newest step out (in synchronous training every rank has completed
        it: no rank starts step s + 1 before all have finished s), the mean finite loss at it, steps/s
        over the last _WINDOW steps, the median over those steps of each step's median rank step
        seconds and the longest any rank took, and the rank of the slowest compute at the newest."""
        last = self._last
        if last is None:
            return Progress()
        rate = 0.0
        if len(self._completions) >= 2:
            (s0, t0), (s1, t1) = self._completions[0], self._completions[-1]
            rate = (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0
        return Progress(
            step=last.step,
            loss=_finite_mean(last.loss),
            steps_per_second=rate,
            step_seconds_p50=statistics.median(self._step_medians) if self._step_medians else 0.0,
            step_seconds_max=max(self._step_maxima, default=0.0),
            slowest_rank=_slowest(last.compute_s),
            at=last.at,
        )

    def _gather(self, records: np.ndarray) -> None:
        node, offset = np.divmod(records["first_rank"].astype(np.intp), self.ranks_per_node)
        frames = _Frames(records["step"], node, records["at"], records["compute"], records["step_s"], records["loss"])
        ours = (records["generation"] == self.generation) & (frames.step > self._emitted)
        ours &= (offset == 0) & (node < self.nodes)
        if not ours.all():
            frames = frames.take(np.flatnonzero(ours))
        if frames.step.size == 0:
            return
        first, newest = int(frames.step.min()), int(frames.step.max())
        self._newest = max(self._newest, newest)
        if first == newest:  # the usual batch: frames of one step
            self._gathering(newest).scatter(frames)
            return
        # A backlog holds many steps: group by step with one sort, not a pass per step over the frames.
        order = np.argsort(frames.step, kind="stable")
        steps, starts = np.unique(frames.step[order], return_index=True)
        for step, rows in zip(steps.tolist(), np.split(order, starts[1:]), strict=True):
            self._gathering(step).scatter(frames.take(rows))

    def _gathering(self, step: int) -> _Gathered:
        if step not in self._pending:
            self._pending[step] = _Gathered(self.nodes, self.ranks_per_node)
        return self._pending[step]

    def _ready(self) -> list[CompletedStep]:
        whole = [step for step, gathered in self._pending.items() if gathered.nodes_in == self.nodes]
        through = max([self._newest - self.lag, *whole])
        ready = sorted(step for step in self._pending if step <= through)
        self._emitted = max(self._emitted, through)
        return [self._out(self._pending.pop(step).completed(step)) for step in ready]

    def _out(self, done: CompletedStep) -> CompletedStep:
        self._last = done
        self._completions.append((done.step, done.at))
        if not math.isnan(done.step_time):
            self._step_medians.append(done.step_time)
            self._step_maxima.append(float(np.nanmax(done.step_s)))
        return done
