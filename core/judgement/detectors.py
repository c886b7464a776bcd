"""The detectors of failures that do not announce themselves (docs/architecture.md §9): a straggler
relative to its peers, a slowdown of every rank at once against healthy runs, a hang, and the rank
a hang's stack dumps point at.

Pure: per-step vectors in, flags out. The run monitor feeds them; the workflow decides what to do.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict

from stayalive.core.fleet.model import MAD_TO_SIGMA

# ── relative: one rank against its peers ─────────────────────────────────────────────────────────────

STRAGGLER_SIGMA = 3.0  # robust z > 3 (docs/architecture.md §9, §16)
# k consecutive steps is k step-times of sustained slowness before an eviction is considered: 100 would
# be 200 s at ~2 s/step; 20 keeps detection within seconds on sub-second simulated steps (docs/architecture.md §16).
# Noise cannot fake it: P(z > 3) ≈ 0.00135 per independent step, so a run of 20 is ~1e-57.
STRAGGLER_STEPS = 20
# Below 5% excess an eviction does not pay: payback = R / excess = 600 s / 0.05 = 200 min, longer than
# the 3.1 h between interruptions at 16k GPUs (Llama 3, arXiv:2407.21783), so a restart comes sooner.
STRAGGLER_MIN_EXCESS = 0.05
# MAD is 0 when every rank reports the same time (a simulator, coarse timers); with no floor any rank
# 1 µs slower would get z = ∞. 1% of the median is below the rank-to-rank jitter of real GPUs (a few
# percent), so it binds only on near noise-free inputs, and keeps z finite and comparable there.
MAD_FLOOR = 0.01
# Each rank's compute time is first taken as its median over the last 5 steps: a rolling median smooths
# as an EWMA of step time would, and a single GC pause, page fault or scheduler hiccup of any rank moves
# it not at all. Sustained slowness passes through 3 steps late.
SMOOTH_STEPS = 5


class StragglerFlag(BaseModel):
    """`rank` has been slower than its peers for the detector's `k` consecutive steps up to `step`."""

    model_config = ConfigDict(frozen=True)

    rank: int
    step: int
    ratio: float  # its compute time over the peers' median, averaged over the k steps
    z: float  # its robust z, averaged over the k steps


class RelativeStraggler:
    """Flags a rank whose pre-collective compute time stands out from its peers' for `k` consecutive
    steps: robust z = (x − median) / (1.4826·MAD) > `sigma`, and x ≥ (1 + `min_excess`)·median.

    The z-test alone would flag a rank 1% slower when the peers agree to 0.1%; the excess test alone
    would flag noise when the peers spread by 10%. Requiring both means "clearly outside the pack, and
    by enough to matter". One step over the line is a GC pause or a page fault; `k` in a row is not.

    Needs three ranks or more: of two, each sits one MAD from their median. Blind by construction to
    every rank slowing at once: that is `AbsoluteSlowdown`'s job (docs/architecture.md §9). One
    detector per generation: a resize changes what a rank index means.
    """

    def __init__(
        self,
        world_size: int,
        sigma: float = STRAGGLER_SIGMA,
        k: int = STRAGGLER_STEPS,
        min_excess: float = STRAGGLER_MIN_EXCESS,
        mad_floor: float = MAD_FLOOR,
        smooth: int = SMOOTH_STEPS,
    ) -> None:
        if world_size < 1 or k < 1 or smooth < 1:
            raise ValueError("world_size, k and smooth must be at least 1")
        self.world_size = world_size
        self.smooth = smooth
        self._recent = np.zeros((world_size, smooth))  # per rank, its last `smooth` values (a ring)
        self._last = np.full(world_size, np.nan)  # per rank, its newest reported value
        self._steps = 0
        self.sigma = sigma
        self.k = k
        self.min_excess = min_excess
        self.mad_floor = mad_floor
        # Per rank: how many consecutive observed steps it has been slow, and the running sums that
        # average its ratio and z over that streak.
        self.consecutive = np.zeros(world_size, dtype=np.int64)
        self._ratio_sum = np.zeros(world_size)
        self._z_sum = np.zeros(world_size)

    def observe(self, step: int, compute_s: npt.ArrayLike) -> list[StragglerFlag]:
        """Fold in one step (compute seconds indexed by rank, NaN where a rank's report is missing);
        return the ranks whose streak reached `k` at this step. A rank is flagged once per streak.

        A missing report neither extends nor breaks a streak: absent data is not evidence of health.
        """
        raw = np.asarray(compute_s, dtype=np.float64)
        if raw.shape != (self.world_size,):
            raise ValueError(f"expected {self.world_size} compute times, got shape {raw.shape}")
        present = ~np.isnan(raw)  # a rank that did not report this step says nothing about it
        first = np.isnan(self._last) & present
        self._last = np.where(present, raw, self._last)  # a missing report keeps the rank's last value
        self._recent[first] = raw[first, None]  # a rank's first value fills its whole window
        self._recent[:, self._steps % self.smooth] = self._last
        self._steps += 1
        smoothed = _window_median(self._recent) if self.smooth > 1 else self._last
        x = np.where(present, smoothed, np.nan)
        peers = x if present.all() else x[present]
        if peers.size == 0:
            return []
        median = _median(peers)
        if not median > 0:
            return []
        mad = _median(np.abs(peers - median))
        scale = MAD_TO_SIGMA * max(mad, self.mad_floor * median)
        ratio = x / median
        z = (x - median) / scale
        slow = (z > self.sigma) & (ratio >= 1.0 + self.min_excess)  # NaN compares False
        healthy = present & ~slow
        self.consecutive = np.where(slow, self.consecutive + 1, np.where(healthy, 0, self.consecutive))
        self._ratio_sum = np.where(slow, self._ratio_sum + ratio, np.where(healthy, 0.0, self._ratio_sum))
        self._z_sum = np.where(slow, self._z_sum + z, np.where(healthy, 0.0, self._z_sum))
        reached = np.flatnonzero(slow & (self.consecutive == self.k))
        return [
            StragglerFlag(
                rank=int(r),
                step=step,
                ratio=float(self._ratio_sum[r] / self.k),
                z=float(self._z_sum[r] / self.k),
            )
            for r in reached
        ]


def _window_median(recent: np.ndarray) -> np.ndarray:
    """Each row's median of its few (odd) values by an odd-even transposition sort across columns:
    a handful of whole-column minimum/maximum passes, where np.partition(axis=1) pays a call per row
    (1.6 ms at 16,384 ranks against ~0.2 ms)."""
    columns = [recent[:, j].copy() for j in range(recent.shape[1])]
    n = len(columns)
    for sweep in range(n):
        for j in range(sweep % 2, n - 1, 2):
            low = np.minimum(columns[j], columns[j + 1])
            np.maximum(columns[j], columns[j + 1], out=columns[j + 1])
            columns[j] = low
    return columns[n // 2]


def _median(values: np.ndarray) -> float:
    """np.median of a NaN-free vector, by one partition (np.median costs several times more)."""
    half = values.size // 2
    part = np.partition(values, half)
    return float(part[half]) if values.size % 2 else float((part[half] + part[:half].max()) / 2)


# ── absolute: the whole run against healthy runs of the same configuration ──────────────────────────

WINDOW_STEPS = 50  # a window median ignores up to 24 slow steps (checkpoint staging, a GC storm)
# Healthy runs of one configuration differ by a few percent from day to day (other nodes, other data
# order); a slowdown under 10% is not worth a page, and 1.3× (a hot aisle) is far above it.
ABSOLUTE_MIN_EXCESS = 0.10
ABSOLUTE_SIGMA = 3.0
SLOW_WINDOWS = 2  # consecutive slow windows: one can be a storage stall shared by every rank


class AbsoluteFlag(BaseModel):
    """The run's step time has been above its healthy baseline band for `windows` consecutive windows."""

    model_config = ConfigDict(frozen=True)

    step: int  # the last step of the last slow window
    since_step: int  # the first step of the first slow window
    ratio: float  # window_median / baseline_median
    window_median: float  # median of the slow windows' medians, seconds
    baseline_median: float
    windows: int


def healthy_window_medians(step_times: npt.ArrayLike, window: int = WINDOW_STEPS) -> list[float]:
    """What a healthy run records into the fleet's baseline: the median of each complete window of
    `window` consecutive step times (a trailing partial window is dropped, NaNs ignored)."""
    times = np.asarray(step_times, dtype=np.float64)
    full = times.size // window
    if full == 0:
        return []
    medians = np.nanmedian(times[: full * window].reshape(full, window), axis=1)
    return [float(m) for m in medians if not np.isnan(m)]


class AbsoluteSlowdown:
    """Flags the run when its window-median step time exceeds BOTH baseline_median·(1 + `min_excess`)
    AND baseline_median + `sigma`·1.4826·MAD(baseline) for `windows` consecutive windows.

    The relative excess keeps a tight baseline (MAD ~0.5%) from making a 2% day-to-day drift a
    slowdown; the z-band keeps a noisy configuration from paging on its own spread. With no baseline
    for the configuration yet (`baseline` empty), the detector is unarmed and never flags.
    """

    def __init__(
        self,
        baseline: Sequence[float],
        window: int = WINDOW_STEPS,
        sigma: float = ABSOLUTE_SIGMA,
        min_excess: float = ABSOLUTE_MIN_EXCESS,
        windows: int = SLOW_WINDOWS,
    ) -> None:
        if window < 1 or windows < 1:
            raise ValueError("window and windows must be at least 1")
        self.window = window
        self.windows = windows
        medians = np.asarray(baseline, dtype=np.float64)
        self.armed = medians.size > 0
        self.baseline_median = float(np.median(medians)) if self.armed else float("nan")
        mad = float(np.median(np.abs(medians - self.baseline_median))) if self.armed else 0.0
        relative = self.baseline_median * (1.0 + min_excess)
        band = self.baseline_median + sigma * MAD_TO_SIGMA * mad
        self.threshold = max(relative, band)  # a window median above this is slow
        self._buffer = np.empty(window)
        self._filled = 0
        self._window_start = 0
        self._slow: list[tuple[int, float]] = []  # (first step, median) of each consecutive slow window

    def observe(self, step: int, step_s: float | npt.ArrayLike) -> AbsoluteFlag | None:
        """Fold in one step: the run's step time, or every rank's step seconds (their median is used;
        NaN for missing ranks). A step with no value is skipped."""
        if not self.armed:
            return None
        values = np.atleast_1d(np.asarray(step_s, dtype=np.float64))
        values = values[~np.isnan(values)]
        if values.size == 0:
            return None
        value = float(np.median(values))
        if self._filled == 0:
            self._window_start = step
        self._buffer[self._filled] = value
        self._filled += 1
        if self._filled < self.window:
            return None
        self._filled = 0
        window_median = float(np.median(self._buffer))
        if window_median <= self.threshold:
            self._slow.clear()
            return None
        self._slow.append((self._window_start, window_median))
        if len(self._slow) != self.windows:  # flag once per slow streak, when it reaches `windows`
            return None
        slow_median = float(np.median([m for _, m in self._slow]))
        return AbsoluteFlag(
            step=step,
            since_step=self._slow[0][0],
            ratio=slow_median / self.baseline_median,
            window_median=slow_median,
            baseline_median=self.baseline_median,
            windows=self.windows,
        )


# ── hang: progress, not liveness ─────────────────────────────────────────────────────────────────────

HANG_FACTOR = 3.0  # 3 × p99 step time (docs/architecture.md §9, §16)
# A 50 ms simulated step gives 3 × p99 = 0.15 s, shorter than telemetry's own trip (the node agent
# batches, the monitor heartbeats every second) and than one blocking checkpoint copy; 10 s clears
# both with margin and is a small fraction of the restart a hang costs at scale (docs/architecture.md §16).
HANG_FLOOR_S = 10.0
# Until there are MIN_STEP_SAMPLES step times, p99 is the slowest warm-up step (compilation, lazy
# NCCL connections, allocator growth); this covers the warm-up instead.
HANG_STARTUP_S = 300.0
MIN_STEP_SAMPLES = 20


def step_timeout(
    observed_step_seconds: Sequence[float] | npt.ArrayLike,
    floor_s: float = HANG_FLOOR_S,
    configured: float | Literal["auto"] = "auto",
    startup_s: float = HANG_STARTUP_S,
    known_step_s: float | None = None,
    warm: bool = False,
) -> float:
    """How long a run may go without completing a step before it counts as hung: the configured
    seconds (HealthSpec.step_timeout), or with "auto" 3 × p99 of the observed step times, at least
    `floor_s`. While fewer than MIN_STEP_SAMPLES steps have been seen, and the run knows its step
    time (`known_step_s`, from before this generation): 3 × the slower of that and the steps seen
    after the generation's first. Until the first is done, at least `startup_s` either way. `warm`:
    it was done before this watch began (a monitor taking over a running generation), and every
    step seen counts."""
    seconds = np.asarray(observed_step_seconds, dtype=np.float64)
    seconds = seconds[~np.isnan(seconds)]
    # A generation's first step also imports, rendezvouses, loads a checkpoint and warms caches: on a
    # loaded host that took a 0.2 s-step example 12 s, whatever step timeout its user had set.
    starting = seconds.size == 0 and not warm
    if configured != "auto":
        return max(float(configured), startup_s) if starting else float(configured)
    if seconds.size >= MIN_STEP_SAMPLES:
        return max(floor_s, HANG_FACTOR * float(np.percentile(seconds, 99)))
    if known_step_s is None or starting:
        return max(floor_s, startup_s)
    # A restarted generation past its first step runs at the run's known pace: a hang 10 steps after
    # a restart, or one a monitor taking over finds, is caught in seconds, not after the warm-up allowance.
    counted = seconds if warm else seconds[1:]
    return max(floor_s, HANG_FACTOR * max([known_step_s, *counted.tolist()]))


def overdue(now: float, last_progress_at: float, timeout: float) -> bool:
    """True once no step has completed for longer than `timeout` seconds (same clock for both times)."""
    return now - last_progress_at > timeout


class HangWatchdog:
    """The run's progress watchdog: remembers the last `history` step times and when the newest step
    completed. A hung rank is alive, so only progress counts (docs/architecture.md §9)."""

    def __init__(
        self,
        configured: float | Literal["auto"] = "auto",
        floor_s: float = HANG_FLOOR_S,
        history: int = 1000,
        known_step_s: float | None = None,
        warm: bool = False,
        startup_s: float = HANG_STARTUP_S,
    ) -> None:
        self.configured = configured
        self.floor_s = floor_s
        self.startup_s = startup_s
        self.known_step_s = known_step_s
        self.warm = warm
        self._seconds = np.full(history, np.nan)
        self._next = 0
        self.last_step = -1
        self.last_progress_at: float | None = None

    def progress(self, step: int, at: float, step_s: float) -> None:
        """Every rank has completed `step` at time `at`, the step having taken `step_s` seconds."""
        if step <= self.last_step:
            return
        # A monitor that starts behind (restarted, reading a backlog) must not date progress before
        # its own start: it did not watch that time, so the time cannot count as a stall.
        self.last_step = step
        self.last_progress_at = at if self.last_progress_at is None else max(at, self.last_progress_at)
        self._seconds[self._next % self._seconds.size] = step_s
        self._next += 1

    @property
    def timeout(self) -> float:
        return step_timeout(
            self._seconds,
            self.floor_s,
            self.configured,
            startup_s=self.startup_s,
            known_step_s=self.known_step_s,
            warm=self.warm,
        )

    def overdue(self, now: float) -> bool:
        return self.last_progress_at is not None and overdue(now, self.last_progress_at, self.timeout)


# ── culprit: the rank whose stack differs ────────────────────────────────────────────────────────────

# faulthandler's format (Python/traceback.c): a header per thread, then one line per frame, innermost
# first. Dumped from a signal handler, "Current thread" marks the thread the signal landed on, and
# threads are listed newest first, so the main thread comes last.
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?:\d+|\?\?\?) in (?P<func>.+)$')
Frame = tuple[str, str]  # (file basename, function)


def parse_threads(dump: str) -> list[list[Frame]]:
    """Each thread's frames (innermost first), in the order listed. When the text holds several dumps
    (the stack file is appended to), only the last one is kept."""
    threads: list[list[Frame]] = []
    seen: set[str] = set()
    for line in dump.splitlines():
        if header := _THREAD.match(line):
            if header.group(1) in seen:  # the same thread again: a newer dump starts here
                threads, seen = [], set()
            seen.add(header.group(1))
            threads.append([])
        elif threads and (frame := _FRAME.match(line)):
            threads[-1].append((os.path.basename(frame.group("file")), frame.group("func")))
    return threads


def _started_by_threading(frames: list[Frame]) -> bool:
    return bool(frames) and frames[-1] == ("threading.py", "_bootstrap")


def main_thread(dump: str) -> list[Frame]:
    """The main thread's frames: a thread not started by `threading` (checkpoint writers, channel
    readers are), preferring one that runs a module body (the script, or under `python -m` the
    module runpy runs; threads that C code started, like autograd's, have none); among several, the
    last listed, the oldest. Beyond 100 frames faulthandler writes "..." instead of the outermost
    ones, and only the order is left to go by. Empty when the dump has no Python frames."""
    candidates = [t for t in parse_threads(dump) if t and not _started_by_threading(t)]
    modules = [t for t in candidates if any(function == "<module>" for _, function in t)]
    chosen = modules or candidates
    return _program(chosen[-1]) if chosen else []


def _program(frames: list[Frame]) -> list[Frame]:
    """The frames up to the program's own module body: what started it (runpy, the fork server that
    forked it) differs between ranks of the same program and says nothing about a hang."""
    for depth, (_, function) in enumerate(frames):
        if function == "<module>":
            return frames[: depth + 1]
    return frames


def culprit(stacks: dict[int, str]) -> list[int]:
    """The ranks whose main-thread stack differs from a clear majority's (with every rank in the same
    collective, the one whose stack is different is the culprit: docs/architecture.md §9).

    Signatures are (file basename, function) frames, ignoring line numbers and install paths. A rank
    with no Python frames (no dump) has the empty signature, so it stands out too. Returns the ranks
    of the smallest minority group(s), sorted; [] when every rank agrees, when no signature holds more
    than half of the ranks (so never with two: neither of two is the odd one out).
    """
    if not stacks:
        return []
    signatures = {rank: tuple(main_thread(text)) for rank, text in stacks.items()}
    groups = Counter(signatures.values())
    ranked = groups.most_common()
    majority_size = ranked[0][1]
    if len(ranked) == 1 or majority_size * 2 <= len(stacks):
        return []
    smallest = min(size for _, size in ranked[1:])
    odd = {sig for sig, size in ranked[1:] if size == smallest}
    return sorted(rank for rank, sig in signatures.items() if sig in odd)
