"""What the run monitor's per-step path costs at 16,384 ranks (2,048 nodes × 8 ranks).

Timed per step, in CPU time of this thread on one pinned core, as the monitor runs it:

1. `StepIngest.add` of each of the step's 2,048 node frames (keeps the bytes),
2. `StepIngest.complete` (joins them, one `np.frombuffer`, scatters into per-rank vectors, takes
   the step's median step seconds once),
3. both detectors: `RelativeStraggler` on the compute seconds, `AbsoluteSlowdown` on the step's
   step seconds as that median (`CompletedStep.step_time`: what the detector takes of a vector),
4. `StepIngest.summary` (the monitor heartbeats it about once a second; here every step).

Not timed: the sockets' I/O (reading 2,048 hub streams and cutting them into frames: the frames
arrive here as ready-made `bytes`), the events the monitor signals, and everything on the nodes
(`StepBatcher`, `pack_steps`). The bar: the whole path under 5 ms of CPU per step at p99, so that at
~2 s per step (docs/architecture.md §16) the monitor spends a quarter of a percent of one core on it. CPU time is
the bar because it is what the path costs; wall time is shown beside it, and its p99 also counts
every moment another process held the core (the JSON line carries the load average).

Beside it, for comparison, the detectors alone as a separate pass fed raw float64 vectors (both on
every rank's values, as this bench measured them before the monitor path was timed).

The process is pinned to one CPU and BLAS/OpenMP pools are held to one thread before numpy loads.
Telemetry is pre-generated (2% noise, a GC-pause spike on one rank in 5% of steps, one rank 1.2×
slow), packed into frames in an arbitrary node order, and a block of steps is cycled, each cycle
stamped with its own step numbers.

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

from stayalive.core.judgement.detectors import AbsoluteSlowdown, RelativeStraggler, healthy_window_medians  # noqa: E402
from stayalive.core.monitor.progress import StepIngest  # noqa: E402
from stayalive.core.protocol.telemetry import NodeSteps, pack_steps, steps_frame  # noqa: E402

RANKS_PER_NODE = 8
NODES = 2_048
RANKS = NODES * RANKS_PER_NODE
SLOW_RANK, SLOW_FACTOR = 4_321, 1.2
BLOCK = 256  # distinct steps of telemetry, cycled
WARMUP = 50  # steps not timed (first-touch allocations, caches)
BAR_MS = 5.0
STEP_S = 0.6  # the steps' nominal length, for their timestamps
# What is timed, in order: the detectors alone, and the monitor's path ("both" and "monitor" are sums).
DETECTOR_STAGES = ("relative", "absolute")
PATH_STAGES = ("add", "complete", "detect", "summary")


@dataclass
class Timings:
    """Milliseconds per step for each stage, and sums: wall clock, and the CPU time this thread
    consumed (what the path costs the monitor, without the time another process held the core)."""

    wall_ms: dict[str, np.ndarray]
    cpu_ms: dict[str, np.ndarray]
    flagged: list[int]


def pin_to_one_core() -> int:
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def telemetry(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(BLOCK, RANKS) compute seconds, step seconds and losses of a run at ~0.5 s compute + 0.1 s
    all-reduce."""
    rng = np.random.default_rng(seed)
    compute = 0.5 * (1.0 + 0.02 * rng.standard_normal((BLOCK, RANKS)))
    compute[:, SLOW_RANK] *= SLOW_FACTOR
    for step in np.flatnonzero(rng.random(BLOCK) < 0.05):
        compute[step, rng.integers(RANKS)] *= rng.uniform(1.5, 4.0)
    step_s = compute.max(axis=1, keepdims=True) + 0.1 + 0.005 * rng.standard_normal((BLOCK, RANKS))
    loss = 2.5 + 0.1 * rng.standard_normal((BLOCK, RANKS))
    return compute, step_s, loss


def packed(compute: np.ndarray, step_s: np.ndarray, loss: np.ndarray, seed: int = 0) -> np.ndarray:
    """(BLOCK, NODES) frames as the hubs pack them (`same_as_pack_steps` checks), nodes in an
    arbitrary order of arrival; `seq`, `step` and `at` are stamped as each step is replayed."""
    order = np.random.default_rng(seed).permutation(NODES)
    block = np.zeros((BLOCK, NODES), dtype=steps_frame(RANKS_PER_NODE))
    block["first_rank"] = order * RANKS_PER_NODE
    for field, values in (("compute", compute), ("step_s", step_s), ("loss", loss)):
        block[field] = values.reshape(BLOCK, NODES, RANKS_PER_NODE)[:, order]
    return block


def step_frames(block: np.ndarray, row: int, step: int) -> list[bytes]:
    """One step's frames as a monitor's readers would hand them over: one `bytes` per node."""
    batch = block[row].copy()
    batch["seq"] = batch["step"] = step
    batch["at"] = step * STEP_S + batch["step_s"].max(axis=1)
    raw, size = batch.tobytes(), batch.dtype.itemsize
    return [raw[k : k + size] for k in range(0, len(raw), size)]


def same_as_pack_steps(block: np.ndarray) -> bool:
    """The bench's frames are byte for byte what core.protocol.telemetry.pack_steps makes of the same step."""
    frame = step_frames(block, 0, 1)[0]
    (record,) = np.frombuffer(frame, dtype=block.dtype)
    steps = NodeSteps(
        generation=0,
        step=1,
        first_rank=int(record["first_rank"]),
        compute_s=record["compute"].tolist(),
        step_s=record["step_s"].tolist(),
        loss=record["loss"].tolist(),
        samples=[[] for _ in range(RANKS_PER_NODE)],
        at=float(record["at"]),
    )
    return frame == pack_steps(1, steps, RANKS_PER_NODE)


def measure_detectors(compute: np.ndarray, step_s: np.ndarray, baseline: list[float], steps: int) -> Timings:
    """The detectors alone on raw (BLOCK, RANKS) float64 telemetry."""
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
    return Timings(per_stage(wall, DETECTOR_STAGES, "both"), per_stage(cpu, DETECTOR_STAGES, "both"), flagged)


def measure_monitor(block: np.ndarray, baseline: list[float], steps: int) -> Timings:
    """The monitor's path from frames to detectors and summary."""
    ingest = StepIngest(RANKS, RANKS_PER_NODE, generation=0)
    relative, absolute = RelativeStraggler(RANKS), AbsoluteSlowdown(baseline)
    add = ingest.add
    wall = np.empty((steps, len(PATH_STAGES)), dtype=np.int64)
    cpu = np.empty((steps, len(PATH_STAGES)), dtype=np.int64)
    flagged: list[int] = []
    for i in range(WARMUP + steps):
        incoming = step_frames(block, i % BLOCK, i + 1)
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        for frame in incoming:
            add(frame)
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        done = ingest.complete()
        w2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        for step in done:
            flagged += [flag.rank for flag in relative.observe(step.step, step.compute_s)]
            absolute.observe(step.step, step.step_time)
        w3, c3 = time.perf_counter_ns(), time.thread_time_ns()
        ingest.summary()
        w4, c4 = time.perf_counter_ns(), time.thread_time_ns()
        if [step.step for step in done] != [i + 1]:
            raise AssertionError(f"step {i + 1}: ingest completed {[step.step for step in done]}")
        if i >= WARMUP:
            wall[i - WARMUP] = (w1 - w0, w2 - w1, w3 - w2, w4 - w3)
            cpu[i - WARMUP] = (c1 - c0, c2 - c1, c3 - c2, c4 - c3)
    return Timings(per_stage(wall, PATH_STAGES, "monitor"), per_stage(cpu, PATH_STAGES, "monitor"), flagged)


def per_stage(ns: np.ndarray, stages: tuple[str, ...], total: str) -> dict[str, np.ndarray]:
    ms = {stage: ns[:, k] / 1e6 for k, stage in enumerate(stages)}
    ms[total] = ns.sum(axis=1) / 1e6
    return ms


def summary(detectors: Timings, monitor: Timings, steps: int, cpu: int) -> dict[str, object]:
    line: dict[str, object] = {"bench": "detectors", "ranks": RANKS, "nodes": NODES, "steps": steps, "cpu": cpu}
    line["load_avg_1m"] = round(os.getloadavg()[0], 2)  # other processes on the machine inflate wall p99
    for clock in ("cpu", "wall"):
        for timings in (detectors, monitor):
            for name, ms in getattr(timings, f"{clock}_ms").items():
                line[f"{name}_{clock}_p50_ms"] = round(float(np.median(ms)), 4)
                line[f"{name}_{clock}_p99_ms"] = round(float(np.percentile(ms, 99)), 4)
    line["flagged"] = monitor.flagged  # the path measured is the one that works: [SLOW_RANK]
    line["detectors_flagged"] = detectors.flagged
    line["bar_ms"] = BAR_MS
    monitor_p99 = float(np.percentile(monitor.cpu_ms["monitor"], 99))
    line["bar"] = monitor_p99 < BAR_MS and monitor.flagged == [SLOW_RANK]
    return line


def table(detectors: Timings, monitor: Timings, steps: int) -> Table:
    grid = Table(title=f"Per step, {RANKS:,} ranks on {NODES:,} nodes, {steps:,} steps, one core (ms)")
    grid.add_column("stage")
    for column in ("CPU p50", "CPU p99", "wall p50", "wall p99", "wall max"):
        grid.add_column(column, justify="right")
    for title, timings in (("detectors alone", detectors), ("monitor path", monitor)):
        grid.add_section()
        grid.add_row(f"[bold]{title}[/bold]")
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
    parser.add_argument("--quick", action="store_true", help="2,000 timed steps of each instead of 10,000")
    args = parser.parse_args()
    steps = 2_000 if args.quick else 10_000
    cpu = pin_to_one_core()
    compute, step_s, loss = telemetry()
    baseline = healthy_window_medians(np.median(step_s, axis=1).repeat(8))  # a healthy run's windows
    block = packed(compute, step_s, loss)
    if not same_as_pack_steps(block):
        raise AssertionError("the bench's frames differ from pack_steps'")
    detectors = measure_detectors(compute, step_s, baseline, steps)
    del compute, step_s, loss
    monitor = measure_monitor(block, baseline, steps)
    Console().print(table(detectors, monitor, steps))
    print(json.dumps(summary(detectors, monitor, steps, cpu)))


if __name__ == "__main__":
    main()
