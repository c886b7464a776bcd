"""`stayalive report`: PNG plots of one run, drawn from its status alone.

goodput.png (where the wall-clock went, over time), interval.png (the checkpoint interval in force),
interruptions.png (what stopped the run, by cause and by node) and step_time.png (step time and
step). The series behind each plot are small pure functions, so they can be checked without
reading pixels. Figures are built without pyplot: nothing global holds them, and each is freed once
written.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from stayalive.core.decisions.goodput import RECENT, ledger, recent_goodput
from stayalive.core.run.status import Ledger, RunStatus
from stayalive.core.run.timeline import PLANNED_CAUSES

Series = npt.NDArray[np.float64]

POINTS = 200  # times at which the ledger is computed: enough for a smooth area, cheap for a month of spans
TOP_NODES = 20
SIZE = (10.0, 5.0)  # inches
DPI = 100
NO_NODE = "—"  # an interruption of the whole run (a pause): no node to blame
# Bottom to top of the stacked area: productive first, so its top edge is the goodput line.
CATEGORY_COLOURS = {
    "productive": "tab:green",
    "checkpoint": "tab:blue",
    "lost": "tab:red",
    "recovery": "tab:orange",
    "startup": "tab:purple",
    "idle": "tab:gray",
    "straggler": "tab:olive",
}
FAILURE_COLOUR, PLANNED_COLOUR = "tab:red", "tab:blue"


class NodeCounts(NamedTuple):
    node: str
    failures: int
    planned: int


def hours_since_start(status: RunStatus, at: datetime) -> float:
    """Hours from the run's start to `at` (a run not started yet is all at its start)."""
    return 0.0 if status.started_at is None else (at - status.started_at).total_seconds() / 3600


def end_of(status: RunStatus, now: datetime) -> datetime:
    return status.finished_at or now


def _span_hours(status: RunStatus, now: datetime) -> tuple[float, float]:
    """The x range every time axis shares: the whole run, so the plots line up."""
    return 0.0, hours_since_start(status, end_of(status, now))


class TimeAxis(NamedTuple):
    per_hour: float  # units of the axis in an hour
    label: str
    limits: tuple[float, float]

    def of(self, hours: Sequence[float] | Series) -> Series:
        return np.asarray(hours, dtype=np.float64) * self.per_hour


def time_axis(status: RunStatus, now: datetime) -> TimeAxis:
    """Minutes for a run shorter than two hours, days for one longer than three, hours between: a
    demo's 3 minutes and a month's 30 days both read in whole numbers."""
    low, high = _span_hours(status, now)
    per_hour, unit = (60.0, "minutes") if high < 2 else (1 / 24, "days") if high > 72 else (1.0, "hours")
    return TimeAxis(per_hour, f"{unit} since start", (low * per_hour, high * per_hour))


def ledger_times(status: RunStatus, now: datetime, points: int = POINTS) -> list[datetime]:
    """`points` evenly spaced times after the start, the last one the run's end (or `now`); none at
    the start itself, whose ledger has no wall-clock to divide."""
    if status.started_at is None:
        return []
    span = end_of(status, now) - status.started_at
    if span <= timedelta(0):
        return []
    return [status.started_at + span * (k / points) for k in range(1, points + 1)]


def _as_of(status: RunStatus, t: datetime, now: datetime) -> RunStatus:
    """The run as the ledger of [start, t] must read it. Not finished: ledger() ends a finished run
    at its end whatever time it is given. And with only its share of the blocking seconds of the
    checkpoints retention deleted: the status keeps just their total, so they are spread evenly
    over the run (retention keeps a milestone every six hours and deletes between them), as is the
    straggler loss, which the monitor reports as a running total. The costs of interruptions that
    left the timeline are spread over the time up to the newest of them."""
    deleted, earlier = status.deleted_checkpoints, status.earlier_interruptions
    share = hours_since_start(status, t) / hours_since_start(status, end_of(status, now))
    folded = 1.0
    if earlier.newest_at is not None and earlier.newest_at > t:
        folded = hours_since_start(status, t) / max(hours_since_start(status, earlier.newest_at), 1e-9)
    costs = ("lost_seconds", "idle_seconds", "recovery_seconds")
    return status.model_copy(
        update={
            "finished_at": None,
            "deleted_checkpoints": deleted.model_copy(update={"blocking_seconds": deleted.blocking_seconds * share}),
            "earlier_interruptions": earlier.model_copy(update={k: getattr(earlier, k) * folded for k in costs}),
            "straggler_seconds": status.straggler_seconds * share,
        }
    )


def _shares(book: Ledger) -> dict[str, float]:
    return {category: getattr(book, category) / book.wall for category in CATEGORY_COLOURS}


def ledger_series(status: RunStatus, now: datetime, points: int = POINTS) -> tuple[Series, dict[str, Series]]:
    """Hours since start, and per ledger category its share of the wall-clock of [start, t] at each
    of `ledger_times`: the shares at a time sum to 1, and `productive` is the goodput."""
    times = ledger_times(status, now, points)
    shares = [_shares(ledger(_as_of(status, t, now), t)) for t in times]
    hours = np.array([hours_since_start(status, t) for t in times], dtype=np.float64)
    return hours, {c: np.array([s[c] for s in shares], dtype=np.float64) for c in CATEGORY_COLOURS}


def recent_goodput_series(status: RunStatus, now: datetime, points: int = POINTS) -> tuple[Series, Series]:
    """Goodput over the hour before each of `ledger_times`, from the first time a full hour lies behind
    it, and only where that hour is past the interruptions the timeline folded into totals (it no
    longer knows when those were)."""
    folded = status.earlier_interruptions.newest_at
    times = [t for t in ledger_times(status, now, points) if folded is None or t - RECENT > folded]
    recent = [(hours_since_start(status, t), recent_goodput(_as_of(status, t, now), t)) for t in times]
    known = [(h, g) for h, g in recent if g is not None]
    return np.array([h for h, _ in known], dtype=np.float64), np.array([g for _, g in known], dtype=np.float64)


def interval_series(status: RunStatus, now: datetime) -> tuple[Series, Series, Series]:
    """Hours, the interval in force (seconds) and Daly's unclamped optimum (seconds, NaN where not
    computed) at each change, the last value repeated at the run's end so the final step shows."""
    choices = status.intervals
    if not choices:
        empty = np.array([], dtype=np.float64)
        return empty, empty, empty
    hours = [hours_since_start(status, c.at) for c in choices]
    seconds = [c.seconds for c in choices]
    optimum = [np.nan if c.optimum_s is None else c.optimum_s for c in choices]
    hours.append(max(hours[-1], _span_hours(status, now)[1]))
    return (
        np.array(hours, dtype=np.float64),
        np.array([*seconds, seconds[-1]], dtype=np.float64),
        np.array([*optimum, optimum[-1]], dtype=np.float64),
    )


def counts_by_cause(status: RunStatus) -> dict[str, int]:
    """Interruptions per cause, the most frequent first."""
    return dict(Counter(status.interruptions_by_cause()).most_common())


def counts_by_node(status: RunStatus, top: int = TOP_NODES) -> list[NodeCounts]:
    """Failures and planned interruptions per node, for the `top` nodes with the most of both."""
    failures = Counter(i.node or NO_NODE for i in status.interruptions if i.cause not in PLANNED_CAUSES)
    planned = Counter(i.node or NO_NODE for i in status.interruptions if i.cause in PLANNED_CAUSES)
    ranked = (failures + planned).most_common(top)
    return [NodeCounts(node, failures[node], planned[node]) for node, _ in ranked]


def _figure(status: RunStatus, what: str) -> Figure:
    figure = Figure(figsize=SIZE, dpi=DPI, layout="tight")
    figure.suptitle(f"{what}: run {status.spec.name} ({status.run_id or 'not started'})")
    return figure


def _note(axes: Axes, text: str) -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes, fontsize=14)
    axes.set_axis_off()


def goodput_figure(status: RunStatus, now: datetime) -> Figure:
    figure = _figure(status, "Goodput and where the wall-clock went")
    axes = figure.add_subplot()
    hours, shares = ledger_series(status, now)
    if hours.size == 0:
        _note(axes, "no wall-clock yet: the run has not started")
        return figure
    x = time_axis(status, now)
    colours = list(CATEGORY_COLOURS.values())
    axes.stackplot(x.of(hours), *shares.values(), labels=list(shares), colors=colours, alpha=0.8)
    axes.plot(x.of(hours), shares["productive"], color="black", label="goodput since start")
    recent_hours, recent = recent_goodput_series(status, now)
    if recent.size:
        label = f"goodput over the last {RECENT.total_seconds() / 3600:g} h"
        axes.plot(x.of(recent_hours), recent, color="black", linestyle="--", label=label)
    axes.set(xlabel=x.label, ylabel="fraction of wall-clock", ylim=(0, 1), xlim=x.limits)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figure


def interval_figure(status: RunStatus, now: datetime) -> Figure:
    figure = _figure(status, "Checkpoint interval")
    axes = figure.add_subplot()
    hours, seconds, optimum = interval_series(status, now)
    if hours.size == 0:
        interval = status.spec.checkpoint.interval
        _note(axes, "auto interval: not computed yet" if interval.kind == "auto" else f"fixed interval: {interval}")
        return figure
    x = time_axis(status, now)
    axes.step(x.of(hours), seconds / 60, where="post", label="interval in force")
    if not np.isnan(optimum).all():
        label = "Daly optimum (before min/max bounds)"
        axes.step(x.of(hours), optimum / 60, where="post", linestyle="--", label=label)
    axes.set(xlabel=x.label, ylabel="interval (minutes)", ylim=(0, None), xlim=x.limits)
    axes.legend()
    return figure


def _bars(axes: Axes, labels: list[str], failures: list[int], planned: list[int], title: str) -> None:
    axes.barh(labels, failures, color=FAILURE_COLOUR)
    axes.barh(labels, planned, left=failures, color=PLANNED_COLOUR)
    axes.invert_yaxis()  # the most frequent at the top
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # interruptions come whole
    axes.set(title=title, xlabel="interruptions")


def interruptions_figure(status: RunStatus, now: datetime) -> Figure:
    figure = _figure(status, "Interruptions")
    if not status.interruptions:
        _note(figure.add_subplot(), "no interruptions")
        return figure
    grid = figure.subplot_mosaic([["cause", "node"], ["time", "time"]], height_ratios=[4, 1])
    causes = counts_by_cause(status)
    failed = [0 if c in PLANNED_CAUSES else n for c, n in causes.items()]
    planned = [n if c in PLANNED_CAUSES else 0 for c, n in causes.items()]
    _bars(grid["cause"], list(causes), failed, planned, "by cause")
    nodes = counts_by_node(status)
    _bars(grid["node"], [n.node for n in nodes], [n.failures for n in nodes], [n.planned for n in nodes], "by node")
    x = time_axis(status, now)
    when = x.of([hours_since_start(status, i.at) for i in status.interruptions])
    colours = [PLANNED_COLOUR if i.cause in PLANNED_CAUSES else FAILURE_COLOUR for i in status.interruptions]
    grid["time"].vlines(when, 0, 1, colors=colours)
    grid["time"].set(xlabel=x.label, yticks=[], xlim=x.limits)
    grid["node"].legend(
        handles=[Patch(color=FAILURE_COLOUR, label="failure"), Patch(color=PLANNED_COLOUR, label="planned")]
    )
    return figure


def step_time_figure(status: RunStatus, now: datetime) -> Figure:
    figure = _figure(status, "Step time and progress")
    axes = figure.add_subplot()
    if not status.samples:
        _note(axes, "no samples yet: one is taken at each checkpoint")
        return figure
    x = time_axis(status, now)
    hours = x.of([hours_since_start(status, s.at) for s in status.samples])
    axes.plot(hours, [s.step_seconds_p50 for s in status.samples], color="tab:blue", marker=".")
    axes.set(xlabel=x.label, ylim=(0, None), xlim=x.limits)
    axes.set_ylabel("step time p50 (seconds)", color="tab:blue")
    steps = axes.twinx()
    steps.plot(hours, [s.step for s in status.samples], color="tab:green")
    steps.set_ylim(0, None)
    steps.set_ylabel("step", color="tab:green")
    return figure


PLOTS: dict[str, Callable[[RunStatus, datetime], Figure]] = {
    "goodput.png": goodput_figure,
    "interval.png": interval_figure,
    "interruptions.png": interruptions_figure,
    "step_time.png": step_time_figure,
}


def write_report(status: RunStatus, now: datetime, directory: Path) -> list[Path]:
    """Write every plot of the run as of `now` into `directory` (created if missing); their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in PLOTS.items():
        path = directory / name
        draw(status, now).savefig(path)
        paths.append(path)
    return paths
