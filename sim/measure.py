"""What a simulated month measured (sim/month.py): the run's own C, M, R and T, its overhead against
the overhead equation for them (docs/architecture.md §14), how closely the intervals the ranks kept
followed Daly's, the pages it sent, and whether a node that failed its self-test ever came back. Read
from the run's final state and from what the simulated cluster saw; `python -m bench.month` prints
them and tests/sim checks them.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass

from stayalive.core.decisions.goodput import ledger
from stayalive.core.decisions.interval import daly, overhead
from stayalive.core.run.status import Ledger, RunStatus
from stayalive.core.run.timeline import failures, is_planned
from stayalive.sim.month import DAY_S, MonthRan, pages_file


@dataclass(frozen=True)
class Overhead:
    """Over the time the run was exposed to failure: wall-clock less its first startup, idle time and
    the restarts of planned drains (the formula counts failures only)."""

    ledger: Ledger
    failures: int
    c: float  # mean blocking seconds of a checkpoint
    m: float  # exposed seconds per failure
    r: float  # mean seconds from a failure to the first step after it
    t: float  # the interval the ranks kept, time-weighted
    simulated: float  # (checkpoint + lost + restarts after failures) / exposed

    @property
    def formula(self) -> float:
        return overhead(self.c, self.t, self.m, self.r)


def measured(ran: MonthRan) -> Overhead:
    status = ran.status
    assert status.finished_at is not None, "the run has not ended"
    book = ledger(status, status.finished_at)
    earlier = status.earlier_interruptions
    failed = failures(status.interruptions)
    count = status.failure_count()
    planned = earlier.planned_recovery_seconds + sum(
        i.restart_seconds or 0.0 for i in status.interruptions if is_planned(i)
    )
    restarts = earlier.recovery_seconds - earlier.planned_recovery_seconds
    restarts += sum(i.restart_seconds or 0.0 for i in failed)
    exposed = book.wall - book.startup - book.idle - planned
    c = statistics.fmean(ck.blocking_seconds for ck in status.checkpoints) if status.checkpoints else 0.0
    return Overhead(
        ledger=book,
        failures=count,
        c=c,
        m=exposed / max(1, count),
        r=restarts / max(1, count),
        t=kept_interval(ran),
        simulated=(book.checkpoint + book.lost + restarts) / exposed,
    )


def kept_interval(ran: MonthRan) -> float:
    """T: the seconds of training between checkpoints the ranks kept, weighted by how long each held."""
    kept = ran.cluster.kept_intervals(ran.status.run_id)
    if not kept or ran.status.finished_at is None:
        return 0.0
    ends = [at for at, _ in kept[1:]] + [ran.status.finished_at.timestamp()]
    spans = [(end - at, seconds) for (at, seconds), end in zip(kept, ends, strict=True)]
    held = sum(d for d, _ in spans)
    return sum(d * s for d, s in spans) / held if held > 0 else 0.0


def interval_error(ran: MonthRan) -> float:
    """The worst relative gap, over the intervals the ranks took up after the first interruption (at
    a launch or by a command, as the simulated cluster recorded them), between each and Daly's for
    the C and M the run had measured when it chose it, within the spec's bounds."""
    status = ran.status
    bounds = status.spec.checkpoint
    if bounds.interval.kind != "auto" or not ran.cluster.marks:
        return 0.0
    first = ran.cluster.marks[0][0]
    choices = [c for c in status.intervals if c.cost_s is not None and c.mtbf_s is not None]
    worst = 0.0
    for at, seconds in ran.cluster.kept_intervals(status.run_id):
        chosen = [c for c in choices if c.at.timestamp() <= at + 1e-3]
        if at <= first or not chosen:
            continue
        choice = chosen[-1]
        assert choice.cost_s is not None and choice.mtbf_s is not None
        optimum = min(max(daly(choice.cost_s, choice.mtbf_s), bounds.min_interval), bounds.max_interval)
        worst = max(worst, abs(seconds - optimum) / optimum)
    return worst


def repeat_nodes(status: RunStatus) -> int:
    """Failures on a node that had failed before in this run (of those the timeline keeps)."""
    seen: set[str] = set()
    repeats = 0
    for i in failures(status.interruptions):
        if i.node is not None:
            repeats += i.node in seen
            seen.add(i.node)
    return repeats


def came_back(ran: MonthRan) -> list[str]:
    """Nodes a launch put into the run after they had failed their self-test: none, if quarantine holds."""
    failed_at = {node: at for at, node, passed in reversed(ran.cluster.self_tests) if not passed}
    return [
        node
        for g in ran.cluster.generations(ran.status.run_id)
        for node in g.launch.nodes
        if node in failed_at and g.launched_at > failed_at[node]
    ]


def pages_per_week(ran: MonthRan) -> dict[str, float]:
    """Pages the run sent (its spec's JSONL sink), per week of the run, by paging class."""
    pages, status = pages_file(ran.root), ran.status
    if not pages.exists() or status.started_at is None or status.finished_at is None:
        return {}
    sent = Counter(json.loads(line)["paging"] for line in pages.read_text().splitlines() if line.strip())
    weeks = (status.finished_at - status.started_at).total_seconds() / (7 * DAY_S)
    return {k: round(n / weeks, 2) for k, n in sorted(sent.items())}
