"""What the straggler detectors cost the run monitor per step, at the seed's 16,384 ranks.

The monitor runs both detectors on every step's telemetry: `RelativeStraggler` on the per-rank
pre-collective compute times, `AbsoluteSlowdown` on the per-rank step times (their median, windowed
against a healthy baseline). The bar: both together under 5 ms of CPU per step at p99 on one core,
so that at ~2 s per step (seed 003 §2) detection costs the monitor a quarter of a percent of one core.
CPU time is the bar because it is what the detectors cost; wall time is shown beside it, and its
p99 also counts every moment another process held the core (the JSON line carries the load average).

The process is pinned to one CPU and BLAS/OpenMP pools are held to one thread before numpy loads.
Telemetry is pre-generated (2% noise, a GC-pause spike on one rank in 5% of steps, one rank 1.2×
slow) and cycled, so only the detectors are timed.

    python -m bench.detectors [--quick]
"""

from __future__ import annotations

import os

for _pool in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_pool] = "1"  # before numpy is imported: pools size themselves at load

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from core.detectors import AbsoluteSlowdown, RelativeStraggler, healthy_window_medians  # noqa: E402

RANKS = 16_384
SLOW_RANK, SLOW_FACTOR = 4_321, 1.2
BLOCK = 256  # distinct steps of telemetry, cycled
WARMUP = 50  # steps not timed (first-touch allocations, caches)
BAR_MS = 5.0


@dataclass
class Timings:
    """Milliseconds per step for each detector: wall clock, and the CPU time this thread consumed
    (what the detector costs the monitor, without the time another process held the core)."""

    wall_ms: dict[str, np.ndarray]
    cpu_ms: dict[str, np.ndarray]
    flagged: list[int]


def pin_to_one_core() -> int:
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def telemetry(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(BLOCK, RANKS) compute seconds and step seconds of a run at ~0.5 s compute + 0.1 s all-reduce."""
    rng = np.random.default_rng(seed)
    compute = 0.5 * (1.0 + 0.02 * rng.standard_normal((BLOCK, RANKS)))
    compute[:, SLOW_RANK] *= SLOW_FACTOR
    for step in np.flatnonzero(rng.random(BLOCK) < 0.05):
        compute[step, rng.integers(RANKS)] *= rng.uniform(1.5, 4.0)
    step_s = compute.max(axis=1, keepdims=True) + 0.1 + 0.005 * rng.standard_normal((BLOCK, RANKS))
    return compute, step_s


def measure(steps: int) -> Timings:
    compute, step_s = telemetry()
    baseline = healthy_window_medians(np.median(step_s, axis=1).repeat(8))  # a healthy run's windows
    relative, absolute = RelativeStraggler(RANKS), AbsoluteSlowdown(baseline)
    wall = np.empty((steps, 2), dtype=np.int64)
    cpu = np.empty((steps, 2), dtype=np.int64)
    flagged: list[int] = []
    for i in range(WARMUP + steps):
        row = i % BLOCK
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        flags = relative.observe(i + 1, compute[row])
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        absolute.observe(i + 1, step_s[row])
        w2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        flagged += [f.rank for f in flags]
        if i >= WARMUP:
            wall[i - WARMUP] = (w1 - w0, w2 - w1)
            cpu[i - WARMUP] = (c1 - c0, c2 - c1)

    def per_detector(ns: np.ndarray) -> dict[str, np.ndarray]:
        ms = ns / 1e6
        return {"relative": ms[:, 0], "absolute": ms[:, 1], "both": ms.sum(axis=1)}

    return Timings(per_detector(wall), per_detector(cpu), flagged)


def summary(timings: Timings, steps: int, cpu: int) -> dict[str, object]:
    line: dict[str, object] = {"bench": "detectors", "ranks": RANKS, "steps": steps, "cpu": cpu}
    line["load_avg_1m"] = round(os.getloadavg()[0], 2)  # other processes on the machine inflate wall p99
    for clock, series in (("cpu", timings.cpu_ms), ("wall", timings.wall_ms)):
        for name, ms in series.items():
            line[f"{name}_{clock}_p50_ms"] = round(float(np.median(ms)), 4)
            line[f"{name}_{clock}_p99_ms"] = round(float(np.percentile(ms, 99)), 4)
    line["flagged"] = timings.flagged  # the detector measured is the one that works: [SLOW_RANK]
    line["bar_ms"] = BAR_MS
    both_p99 = float(np.percentile(timings.cpu_ms["both"], 99))
    line["bar"] = both_p99 < BAR_MS and timings.flagged == [SLOW_RANK]
    return line


def table(timings: Timings, steps: int) -> Table:
    grid = Table(title=f"Detectors per step, {RANKS:,} ranks, {steps:,} steps, one core (ms)")
    grid.add_column("detector")
    for column in ("CPU p50", "CPU p99", "wall p50", "wall p99", "wall max"):
        grid.add_column(column, justify="right")
    for name, cpu_ms in timings.cpu_ms.items():
        wall_ms = timings.wall_ms[name]
        grid.add_row(
            name,
            *(f"{v:.3f}" for v in (np.median(cpu_ms), np.percentile(cpu_ms, 99))),
            *(f"{v:.3f}" for v in (np.median(wall_ms), np.percentile(wall_ms, 99), wall_ms.max())),
        )
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2,000 timed steps instead of 10,000")
    args = parser.parse_args()
    steps = 2_000 if args.quick else 10_000
    cpu = pin_to_one_core()
    timings = measure(steps)
    Console().print(table(timings, steps))
    print(json.dumps(summary(timings, steps, cpu)))


if __name__ == "__main__":
    main()
