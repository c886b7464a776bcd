"""The goodput ledger: where the run's wall-clock went, by category, not as one number (docs/architecture.md §14).

Every second of wall-clock lands in exactly one category. Each cost is a set of measured spans on
the clock (startup, idle, recovery, checkpoint blocking, lost work); where spans overlap, the second
goes to the first category in PRECEDENCE, so nothing is counted twice; `productive` is what remains.
Straggler loss is the one cost that is not a span: slow steps are still steps, so it is carved out
of the running time the spans leave. Clipping every span to a window [since, now] gives the ledger
of that window, which is what the paging rule "goodput over the last hour < 0.3" reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.status import Ledger, RunStatus
from stayalive.core.run.timeline import Interruption

RECENT = timedelta(hours=1)  # the paging rule's window (core.decisions.paging.WINDOW)


class Category(StrEnum):
    IDLE = "idle"  # waiting for a person or for nodes
    RECOVERY = "recovery"  # from a failure to the first step after it
    STARTUP = "startup"  # from the run's start to its first step
    CHECKPOINT = "checkpoint"  # blocking checkpoint copies
    LOST = "lost"  # steps computed and then thrown away by a restart from an earlier checkpoint


# Who owns a second claimed by two spans. Idle first: a run waiting for a person is waiting, whatever
# else was open. Lost work last: it is estimated (lost steps × p50 step time), so it yields to spans
# measured on the clock; a checkpoint blocking inside work later thrown away is still a checkpoint.
PRECEDENCE = (Category.IDLE, Category.RECOVERY, Category.STARTUP, Category.CHECKPOINT, Category.LOST)

Span = tuple[float, float, Category]  # start and end, seconds since the run started


def ledger(status: RunStatus, now: datetime, since: datetime | None = None) -> Ledger:
    """The ledger of the run's wall-clock from `since` (default: its start) to `now` (or its end)."""
    if status.started_at is None:
        return _empty()
    end = _seconds(status, status.finished_at or now)
    start = max(0.0, _seconds(status, since)) if since is not None else 0.0
    if end <= start:
        return _empty()
    spans = list(_spans(status, end))
    book = _partition(spans, start, end)
    # Checkpoints retention deleted left the state, and their spans with it; their blocking seconds
    # stay as one total, carved out of the running time of the whole run (they are old: a window of
    # the last hour holds only checkpoints retention still keeps).
    if since is None:
        earlier = status.earlier_interruptions  # the same for interruptions that left the timeline
        for category, seconds in (
            (Category.CHECKPOINT, status.deleted_checkpoints.blocking_seconds),
            (Category.IDLE, earlier.idle_seconds),
            (Category.RECOVERY, earlier.recovery_seconds),
            (Category.LOST, earlier.lost_seconds),
        ):
            book[category] += min(seconds, end - sum(book.values()))
    running = end - start - sum(book.values())
    # Straggler seconds arrive as one running total (RunStatus.straggler_seconds, from the run
    # monitor), so a window gets its share in proportion to its share of the run's running time.
    straggler_total = status.straggler_seconds
    if straggler_total > 0 and since is not None:
        whole = _partition(spans, 0.0, end)
        running_total = end - sum(whole.values())
        straggler = straggler_total * running / running_total if running_total > 0 else 0.0
    else:
        straggler = straggler_total
    return Ledger(
        wall=end - start,
        startup=book[Category.STARTUP],
        checkpoint=book[Category.CHECKPOINT],
        lost=book[Category.LOST],
        recovery=book[Category.RECOVERY],
        idle=book[Category.IDLE],
        straggler=min(max(0.0, straggler), max(0.0, running)),
    )


def straggler_wait(
    compute_s: npt.NDArray[np.float64], step_s: float, stragglers: list[int], baseline_step_s: float | None
) -> float:
    """Seconds one step lost to slowness, its actual against its ideal time. A known straggler holds
    the barrier for as long as its compute exceeds the median rank's; a known slowdown of the whole
    run costs the step's excess over the healthy baseline. The larger of the two: they overlap."""
    waited = 0.0
    known = [r for r in stragglers if 0 <= r < compute_s.size and not np.isnan(compute_s[r])]
    if known:
        waited = max(0.0, max(float(compute_s[r]) for r in known) - float(np.nanmedian(compute_s)))
    if baseline_step_s is not None:
        waited = max(waited, step_s - baseline_step_s)
    return waited


def recent_goodput(status: RunStatus, now: datetime, window: timedelta = RECENT) -> float | None:
    """Goodput over the last `window`, or None while the run is younger than that: a run's first
    hour holds its startup, and a goodput over ten minutes of it says nothing about a collapse."""
    if status.started_at is None or now - status.started_at < window:
        return None
    return ledger(status, now, since=now - window).goodput


def _empty() -> Ledger:
    return Ledger(wall=0.0, startup=0.0, checkpoint=0.0, lost=0.0, recovery=0.0)


def _seconds(status: RunStatus, at: datetime) -> float:
    assert status.started_at is not None
    return (at - status.started_at).total_seconds()


def _spans(status: RunStatus, end: float) -> Iterable[Span]:
    """Every measured cost of the run as spans on its clock (unclipped; they may overlap)."""
    first_step = _seconds(status, status.first_step_at) if status.first_step_at is not None else end
    yield 0.0, first_step, Category.STARTUP
    for checkpoint in status.checkpoints:
        # `written_at` is when the keeper judged it; the blocking copy ended no later than that.
        written = _seconds(status, checkpoint.written_at)
        yield written - checkpoint.blocking_seconds, written, Category.CHECKPOINT
    interruptions = status.interruptions
    for n, interruption in enumerate(interruptions):
        following = interruptions[n + 1] if n + 1 < len(interruptions) else None
        yield from _interruption_spans(status, interruption, following, end)


def _interruption_spans(
    status: RunStatus, interruption: Interruption, following: Interruption | None, end: float
) -> Iterable[Span]:
    """An interruption costs the work it threw away, before it, and its idle wait and restart, after
    it (idle first: a pause waits for the person, then restarts). A restart still under way runs to
    the next interruption or to `end`, and a stopped run's open restart is all idle."""
    at = _seconds(status, interruption.at)
    if interruption.lost_steps:
        yield at - interruption.lost_steps * status.progress.step_seconds_p50, at, Category.LOST
    idle_end = at + interruption.idle_seconds
    if interruption.idle_seconds > 0:
        yield at, idle_end, Category.IDLE
    if interruption.restart_seconds is not None:
        yield idle_end, idle_end + interruption.restart_seconds, Category.RECOVERY
        return
    open_until = _seconds(status, following.at) if following is not None else end
    stopped = following is None and status.state == RunState.STOPPED
    yield idle_end, open_until, Category.IDLE if stopped else Category.RECOVERY


def _partition(spans: list[Span], start: float, end: float) -> dict[Category, float]:
    """Seconds of [start, end] per category, each second to the first category in PRECEDENCE among
    the spans covering it: a sweep over the span edges, O(n log n) for n spans."""
    edges: list[tuple[float, int, Category]] = []
    for lo, hi, category in spans:
        lo, hi = max(lo, start), min(hi, end)
        if hi > lo:
            edges += [(lo, 1, category), (hi, -1, category)]
    edges.sort(key=lambda edge: edge[0])
    open_spans = dict.fromkeys(PRECEDENCE, 0)
    totals = dict.fromkeys(PRECEDENCE, 0.0)
    previous = start
    for at, change, category in edges:
        if at > previous:
            owner = next((c for c in PRECEDENCE if open_spans[c] > 0), None)
            if owner is not None:
                totals[owner] += at - previous
            previous = at
        open_spans[category] += change
    return totals
