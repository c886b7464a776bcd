"""The detectors on synthetic telemetry: who they flag, when, and what they leave alone."""

from __future__ import annotations

import faulthandler
import queue
import tempfile
import threading
from collections.abc import Callable

import numpy as np
import pytest

from stayalive.core.judgement.detectors import (
    HANG_STARTUP_S,
    SMOOTH_STEPS,
    AbsoluteSlowdown,
    HangWatchdog,
    RelativeStraggler,
    StragglerFlag,
    culprit,
    healthy_window_medians,
    main_thread,
    overdue,
    parse_threads,
    step_timeout,
)

RANKS = 64
COMPUTE_S = 0.5  # a healthy rank's pre-collective compute time
ALL_REDUCE_S = 0.1


def compute_times(
    steps: int,
    seed: int,
    noise: float = 0.02,
    slow: dict[int, float] | None = None,
    everyone: float = 1.0,
    spikes: float = 0.0,
) -> np.ndarray:
    """(steps, RANKS) compute seconds: each rank a fixed ±1% off nominal (no two GPUs are alike),
    Gaussian step noise, `slow` ranks multiplied by their factor, every rank by `everyone`, and with
    probability `spikes` per step one random rank stalls 1.5-4× for that step alone (a GC pause)."""
    rng = np.random.default_rng(seed)
    bias = 1.0 + rng.uniform(-0.01, 0.01, RANKS)
    times = COMPUTE_S * everyone * bias * (1.0 + noise * rng.standard_normal((steps, RANKS)))
    for rank, factor in (slow or {}).items():
        times[:, rank] *= factor
    for step in np.flatnonzero(rng.random(steps) < spikes):
        times[step, rng.integers(RANKS)] *= rng.uniform(1.5, 4.0)
    return times


def step_seconds(compute: np.ndarray, seed: int) -> np.ndarray:
    """Per step: everyone waits for the slowest rank in the all-reduce, then a little network jitter."""
    rng = np.random.default_rng(seed)
    return compute.max(axis=1) + ALL_REDUCE_S * (1.0 + 0.05 * rng.standard_normal(compute.shape[0]))


def relative_flags(times: np.ndarray, **kwargs: float) -> list[StragglerFlag]:
    detector = RelativeStraggler(times.shape[1], **kwargs)  # type: ignore[arg-type]
    return [flag for step, row in enumerate(times, start=1) for flag in detector.observe(step, row)]


# ── relative ─────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("k", [5, 20, 100])
def test_a_slow_rank_is_flagged_at_the_kth_step_not_before(k: int) -> None:
    detector = RelativeStraggler(RANKS, k=k, smooth=1)  # raw per-step values: the ratio is exactly theirs
    times = compute_times(k + 50, seed=1, slow={17: 1.2})
    flags = {step: detector.observe(step, row) for step, row in enumerate(times, start=1)}
    assert all(flags[step] == [] for step in range(1, k))
    (flag,) = flags[k]
    assert (flag.rank, flag.step) == (17, k)
    assert flag.ratio == pytest.approx(1.2, abs=0.02)
    assert flag.ratio == pytest.approx(np.mean(times[:k, 17] / np.median(times[:k], axis=1)))  # over the k steps
    assert flag.z > 5
    assert all(flags[step] == [] for step in range(k + 1, k + 51))  # once per streak


@pytest.mark.parametrize(
    ("noise", "factor", "flagged", "why"),
    [
        (0.02, 1.20, True, "a 20%-slow GPU among 2%-noisy peers"),
        (0.02, 1.12, True, "a 12%-slow GPU"),
        (0.02, 1.04, False, "within 3 sigma of 2%-noisy peers"),
        (0.10, 1.20, False, "peers spread by 10%: 20% slower is within 3 sigma"),
    ],
)
def test_relative_thresholds(noise: float, factor: float, flagged: bool, why: str) -> None:
    flags = relative_flags(compute_times(200, seed=2, noise=noise, slow={5: factor}))
    assert [f.rank for f in flags] == ([5] if flagged else []), why
    assert all(np.isfinite(f.z) for f in flags)


@pytest.mark.parametrize(
    ("factor", "flagged"),
    [
        (1.01, False),
        (1.048, False),  # z = 0.048 / (1.4826 × 1%) = 3.2 on the floor, but under the 5% minimum excess
        (1.10, True),
    ],
)
def test_identical_peers_do_not_make_every_difference_a_straggler(factor: float, flagged: bool) -> None:
    """A simulator or a coarse timer reports the same time for every rank: MAD is 0."""
    times = np.full((40, RANKS), COMPUTE_S)
    times[:, 5] *= factor
    flags = relative_flags(times)
    assert [f.rank for f in flags] == ([5] if flagged else [])
    assert all(f.z == pytest.approx((factor - 1) / (1.4826 * 0.01)) for f in flags)  # the 1% MAD floor


def test_healthy_ranks_with_gc_pauses_are_never_flagged() -> None:
    # 2,000 steps × 64 ranks; one rank stalls somewhere in 5% of the steps.
    times = compute_times(2000, seed=3, spikes=0.05)
    assert relative_flags(times) == []
    assert relative_flags(times, k=1, smooth=1) != []  # the spikes are there: a raw one-step detector cries wolf
    assert relative_flags(times, k=1) == []  # the 5-step rolling median absorbs every single-step spike


def test_peers_that_spike_do_not_break_a_stragglers_streak() -> None:
    """Eight ranks sharing two CPU cores (measured on this kind of machine): every few steps half the
    peers are held up for a step, which widens the MAD enough to pull the straggler under 3 sigma that
    step; the 5-step rolling median keeps its streak whole."""
    rng = np.random.default_rng(8)
    times = COMPUTE_S * (1 + 0.01 * rng.standard_normal((120, 8)))
    times[:, 3] *= 1.2
    for step in range(0, 120, 7):
        held = rng.choice([0, 1, 2, 4, 5, 6, 7], size=4, replace=False)
        times[step, held[:2]] *= 2.0
        times[step, held[2:]] *= 1.2
    raw = relative_flags(times, k=20, smooth=1)
    smooth = relative_flags(times, k=20)
    lag = SMOOTH_STEPS - 1  # the rolling median needs a majority of its window
    assert [f.rank for f in smooth] == [3] and smooth[0].step <= 20 + lag
    assert not raw or raw[0].step > 20 + lag, "without smoothing the spikes break the streak"


def test_a_missing_report_neither_extends_nor_breaks_a_streak() -> None:
    detector = RelativeStraggler(RANKS, k=10, smooth=1)
    times = compute_times(20, seed=4, slow={9: 1.3})
    times[3:8, 9] = np.nan  # five steps of rank 9's telemetry lost in between
    flags = [(step, f.rank) for step, row in enumerate(times, start=1) for f in detector.observe(step, row)]
    assert flags == [(15, 9)]  # 10 observed slow steps: 1-3 and 9-15


def test_a_broken_streak_starts_over() -> None:
    times = compute_times(30, seed=5)
    times[:5, 9] *= 2.0  # five very slow steps, one normal one, then 1.2× for good
    times[6:, 9] *= 1.2
    flags = relative_flags(times, k=10, smooth=1)
    assert [(f.step, f.rank) for f in flags] == [(16, 9)]
    # The earlier 2× steps are in neither average.
    streak = times[6:16]
    median = np.median(streak, axis=1)
    mad = np.median(np.abs(streak - median[:, None]), axis=1)
    assert flags[0].ratio == pytest.approx(np.mean(streak[:, 9] / median))
    assert flags[0].z == pytest.approx(np.mean((streak[:, 9] - median) / (1.4826 * mad)))


@pytest.mark.filterwarnings("error")  # no "mean of empty slice" either
@pytest.mark.parametrize("value", [0.0, np.nan])
def test_steps_without_a_usable_median_are_skipped(value: float) -> None:
    times = np.full((30, RANKS), value)
    times[:, 3] = 0.5  # one rank reporting among peers that report zero or nothing
    assert relative_flags(times, k=5) == []
    assert RelativeStraggler(RANKS).observe(1, np.full(RANKS, np.nan)) == []  # a step nobody reported


def test_relative_rejects_a_vector_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="expected 64"):
        RelativeStraggler(RANKS).observe(1, np.ones(63))


# ── absolute ─────────────────────────────────────────────────────────────────────────────────────────


def test_every_rank_slowed_together_is_caught_only_by_the_absolute_check() -> None:
    """A hot aisle slows every rank; the peer median moves with them (docs/architecture.md §9)."""
    healthy = step_seconds(compute_times(2000, seed=10, spikes=0.02), seed=11)
    baseline = healthy_window_medians(healthy)
    assert len(baseline) == 40

    hot_compute = compute_times(2000, seed=12, everyone=1.3, spikes=0.02)
    assert relative_flags(hot_compute) == []
    hot = step_seconds(hot_compute, seed=13)
    detector = AbsoluteSlowdown(baseline)
    flags = [f for step, value in enumerate(hot, start=1) if (f := detector.observe(step, float(value)))]
    (flag,) = flags  # once per slow streak
    assert (flag.since_step, flag.step, flag.windows) == (1, 100, 2)
    # Compute is 1.3× slower, the all-reduce is not: the step is ~1.25× slower.
    assert flag.ratio == pytest.approx(np.median(hot) / np.median(healthy), rel=0.01)
    assert flag.ratio > 1.2


@pytest.mark.parametrize("seed", [10, 20, 30])
def test_healthy_runs_do_not_flag_against_the_baseline(seed: int) -> None:
    baseline = healthy_window_medians(step_seconds(compute_times(2000, seed=10, spikes=0.02), seed=11))
    run = step_seconds(compute_times(2000, seed=seed, spikes=0.02), seed=seed + 1)  # seed 10: the run itself
    detector = AbsoluteSlowdown(baseline)
    assert [f for step, value in enumerate(run, start=1) if (f := detector.observe(step, float(value)))] == []


@pytest.mark.parametrize(
    ("baseline", "windows", "flagged"),
    [
        ([1.0] * 40, [1.05] * 4, False),  # tight baseline (MAD 0): 5% drift is under the 10% excess
        ([1.0] * 40, [1.12] * 4, True),
        ([1.0, 1.3] * 20, [1.4] * 4, False),  # noisy baseline: 1.4 s is within its 3-sigma band
        ([1.0, 1.3] * 20, [2.4] * 4, True),
        ([1.0] * 40, [1.5, 1.0, 1.5, 1.0], False),  # slow windows, never two in a row
        ([], [9.0] * 4, False),  # no baseline for this configuration yet: unarmed
    ],
)
def test_absolute_band(baseline: list[float], windows: list[float], flagged: bool) -> None:
    detector = AbsoluteSlowdown(baseline, window=10)
    steps = np.repeat(windows, 10)
    got = [f for step, value in enumerate(steps, start=1) if (f := detector.observe(step, float(value)))]
    assert bool(got) == flagged


def test_window_medians_ignore_a_trailing_partial_window_and_nans() -> None:
    times = np.r_[np.full(50, 2.0), np.full(50, 3.0), np.full(10, 99.0)]
    times[:20] = np.nan
    assert healthy_window_medians(times, 50) == [2.0, 3.0]


# ── hang ─────────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("observed", "configured", "timeout"),
    [
        ([30.0] * 200, "auto", 90.0),  # 3 × p99 step time: 90 s at 30 s steps
        ([20.0] * 300 + [100.0], "auto", 60.0),  # p99, not the max: one stalled step does not set it
        ([0.05] * 200, "auto", 10.0),  # the floor: 3 × 50 ms is shorter than telemetry's own trip
        ([30.0] * 10, "auto", HANG_STARTUP_S),  # too few steps for a p99: still warming up
        ([30.0] * 200, 45.0, 45.0),  # HealthSpec.step_timeout given
        # ... and before the generation's first step, the startup allowance (HealthSpec.startup_timeout):
        # the first step also imports, rendezvouses, loads a checkpoint and warms caches
        ([], 45.0, HANG_STARTUP_S),
        ([], 600.0, 600.0),  # a step timeout longer than the allowance holds from the start
        ([30.0], 45.0, 45.0),  # the first step is done: the step timeout alone
        ([np.nan] * 50 + [30.0] * 200, "auto", 90.0),
    ],
)
def test_step_timeout(observed: list[float], configured: float | str, timeout: float) -> None:
    assert step_timeout(observed, configured=configured) == timeout  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("observed", "known", "timeout"),
    [
        ([], 30.0, HANG_STARTUP_S),  # a restarted generation's first step may still be warming up
        ([200.0, 30.0, 30.0], 30.0, 90.0),  # after it: the run's known pace, not the warm-up allowance
        ([200.0, 30.0, 40.0], 30.0, 120.0),  # the slower of the known pace and what this generation shows
        ([200.0, 0.05], 0.05, 10.0),  # the floor holds
        ([30.0] * 10, None, HANG_STARTUP_S),  # a run that has not measured its pace yet
    ],
)
def test_a_restarted_generation_uses_the_runs_known_step_time(
    observed: list[float], known: float | None, timeout: float
) -> None:
    assert step_timeout(observed, known_step_s=known) == timeout


@pytest.mark.parametrize(
    ("observed", "known", "timeout"),
    [
        ([], 30.0, 90.0),  # a monitor taking over a hung generation: the known pace at once
        ([40.0], 30.0, 120.0),  # every step it saw counts: none of them was a warm-up
        ([], None, HANG_STARTUP_S),  # nothing known: the allowance
    ],
)
def test_a_monitor_taking_over_past_the_first_step_needs_no_warm_up(
    observed: list[float], known: float | None, timeout: float
) -> None:
    assert step_timeout(observed, known_step_s=known, warm=True) == timeout


def test_a_monitor_taking_over_past_the_first_step_holds_the_step_timeout_given() -> None:
    assert step_timeout([], configured=45.0, warm=True) == 45.0


def test_the_startup_allowance_is_the_runs_own() -> None:
    watchdog = HangWatchdog(configured=10.0, startup_s=60.0)
    watchdog.last_progress_at = 0.0  # the generation's monitor started
    assert not watchdog.overdue(now=59.0)
    assert watchdog.overdue(now=61.0)
    watchdog.progress(step=1, at=61.0, step_s=0.2)
    assert not watchdog.overdue(now=70.0) and watchdog.overdue(now=72.0)


def test_watchdog_counts_progress_not_liveness() -> None:
    watchdog = HangWatchdog()
    assert not watchdog.overdue(now=1e9)  # no step yet: the launch has its own timeout
    for step in range(1, 101):
        watchdog.progress(step, at=1000.0 + 30.0 * step, step_s=30.0)
    watchdog.progress(50, at=99999.0, step_s=1.0)  # a late duplicate is not progress
    assert watchdog.timeout == 90.0
    last = 1000.0 + 30.0 * 100
    assert not watchdog.overdue(last + 90.0)
    assert watchdog.overdue(last + 90.5)
    assert overdue(now=100.0, last_progress_at=0.0, timeout=99.0)
    assert not overdue(now=100.0, last_progress_at=0.0, timeout=100.0)


def test_a_restarted_watchdog_does_not_date_a_backlog_before_its_start() -> None:
    """A monitor restarted after its supervisor died reads steps the ranks reported while nobody
    watched: those steps are progress, but not evidence that progress stopped long ago."""
    watchdog = HangWatchdog(configured=10.0)
    watchdog.last_progress_at = 5000.0  # the restarted monitor's start
    watchdog.progress(1, at=4980.0, step_s=0.05)  # reported 20 s before the monitor started
    assert watchdog.last_step == 1
    assert not watchdog.overdue(5009.0)
    assert watchdog.overdue(5010.5)


# ── culprit ──────────────────────────────────────────────────────────────────────────────────────────

WRITER = """Thread 0x00007f3a2d7fe6c0 (most recent call first):
  File "{root}/lib/python3.11/threading.py", line 327 in wait
  File "{root}/lib/python3.11/queue.py", line 171 in get
  File "/srv/stayalive/training/checkpointer.py", line 212 in _write_loop
  File "{root}/lib/python3.11/threading.py", line 982 in run
  File "{root}/lib/python3.11/threading.py", line 1045 in _bootstrap_inner
  File "{root}/lib/python3.11/threading.py", line 1002 in _bootstrap
"""
MAIN_TAIL = """  File "/srv/stayalive/training/train.py", line 88 in train
  File "/srv/stayalive/training/train.py", line 160 in generation
  File "/srv/stayalive/training/train.py", line 137 in run
  File "/srv/stayalive/training/train.py", line 230 in main
  File "/srv/stayalive/training/train.py", line 240 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
IN_ALL_REDUCE = """  File "{root}/site-packages/torch/distributed/distributed_c10d.py", line 2806 in all_reduce
  File "{root}/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/srv/stayalive/training/train.py", line 66 in all_reduce_gradients
"""
IN_FORWARD = """  File "{root}/site-packages/torch/nn/modules/linear.py", line 125 in forward
  File "{root}/site-packages/torch/nn/modules/module.py", line 1762 in _call_impl
  File "/srv/stayalive/training/model.py", line 80 in forward
"""


def dump(inner: str, root: str = "/usr", line_shift: int = 0, signal_on_writer: bool = False) -> str:
    """A faulthandler dump of a rank (threads newest first, the main thread last), with the install
    root and line numbers varied the way they vary between nodes and versions."""
    main = (inner + MAIN_TAIL).format(root=root).replace("line 88 ", f"line {88 + line_shift} ")
    writer = WRITER.format(root=root)
    if signal_on_writer:  # the signal landed on the writer thread: faulthandler marks that one current
        writer = writer.replace("Thread", "Current thread", 1)
        return f"{writer}\nThread 0x00007f3a3c9b1740 (most recent call first):\n{main}"
    return f"{writer}\nCurrent thread 0x00007f3a3c9b1740 (most recent call first):\n{main}"


def healthy_ranks(n: int) -> dict[int, str]:
    return {
        r: dump(IN_ALL_REDUCE, root=("/usr", "/opt/conda")[r % 2], line_shift=r % 3, signal_on_writer=r % 5 == 0)
        for r in range(n)
    }


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s: s, []),  # every rank waits in the same all-reduce: no odd one out
        (lambda s: s | {7: dump(IN_FORWARD)}, [7]),  # rank 7 never reached the collective
        (lambda s: s | {7: dump(IN_FORWARD), 9: dump(IN_FORWARD)}, [7, 9]),
        (lambda s: s | {3: ""}, [3]),  # no dump at all: dead or wedged below Python
        (lambda s: s | {3: dump(IN_ALL_REDUCE) + dump(IN_FORWARD)}, [3]),  # two dumps in the file: the newest
        (lambda s: s | {7: dump(IN_FORWARD), 8: "", 9: ""}, [7]),  # the smallest minority
        (lambda s: {r: dump(IN_FORWARD) if r % 2 else t for r, t in s.items()}, []),  # split in half
        (lambda s: s | {r: dump(IN_FORWARD) for r in range(6)} | {6: "", 7: ""}, []),  # 8 / 6 / 2: no majority
        (lambda s: {0: s[0], 1: dump(IN_FORWARD)}, []),  # two ranks: neither is the odd one out
        (lambda s: {}, []),
    ],
)
def test_culprit(change: Callable[[dict[int, str]], dict[int, str]], expected: list[int]) -> None:
    assert culprit(change(healthy_ranks(16))) == expected


AUTOGRAD = """Thread 0x00007f3a1b3fe6c0 (most recent call first):
  File "/srv/stayalive/training/model.py", line 41 in _scale_grad
"""  # a thread C++ started (autograd's) running a Python hook: not from `threading`, no <module>


def frames(dump: str) -> list[str]:
    return [function for _, function in main_thread(dump)]


def test_the_main_thread_is_found_wherever_the_signal_landed() -> None:
    assert frames(dump(IN_ALL_REDUCE, signal_on_writer=True))[:3] == ["all_reduce", "wrapper", "all_reduce_gradients"]
    assert frames(AUTOGRAD + "\n" + dump(IN_FORWARD))[0] == "forward"
    listed_first = dump(IN_FORWARD).split("\n\n")[1] + "\n\n" + AUTOGRAD  # whatever the order
    assert frames(listed_first)[0] == "forward"
    assert main_thread("Thread 0x00007f8393fff6c0 (most recent call first):\n  <no Python frame>\n") == []


def test_a_truncated_main_thread_is_the_last_one_listed() -> None:
    deep = IN_FORWARD * 40  # past faulthandler's 100 frames: "..." replaces the outermost ones
    truncated = "\n".join(deep.splitlines()[:100]) + "\n  ...\n"
    text = f"{AUTOGRAD}\nCurrent thread 0x00007f3a3c9b1740 (most recent call first):\n{truncated}"
    assert frames(text)[0] == "forward"
    assert len(main_thread(text)) == 100


def test_only_the_newest_of_several_appended_dumps_counts() -> None:
    threads = parse_threads(dump(IN_FORWARD) + dump(IN_ALL_REDUCE))
    assert len(threads) == 2
    assert threads[1][0][1] == "all_reduce"


# Real faulthandler output: the same process dumps from two different places in its "step".


def _real_dump(where: Callable[[Callable[[], str]], str]) -> str:
    def take() -> str:
        with tempfile.TemporaryFile("w+") as out:
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.seek(0)
            return out.read()

    return where(take)


def _wait_in_collective(take: Callable[[], str]) -> str:
    return take()


def _stuck_in_forward(take: Callable[[], str]) -> str:
    return take()


def test_culprit_on_real_faulthandler_dumps() -> None:
    inbox: queue.Queue[None] = queue.Queue()
    writer = threading.Thread(target=inbox.get, name="checkpoint-writer", daemon=True)
    writer.start()
    try:
        stacks = {rank: _real_dump(_wait_in_collective) for rank in range(5)}
        stacks[2] = _real_dump(_stuck_in_forward)
    finally:
        inbox.put(None)
        writer.join()
    assert "(most recent call first):" in stacks[0]
    assert ("test_detectors.py", "_wait_in_collective") in main_thread(stacks[0])
    assert culprit(stacks) == [2]
