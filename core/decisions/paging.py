"""Page on the pattern, not the count (docs/architecture.md §12).

INDEPENDENT failures are restarted silently and reported; CORRELATED ones page a human;
DETERMINISTIC ones (the same step failing again) stop the run, because restarting cannot fix data
or code. Planned interruptions (a drain, a pause, a rollback) are never failures: they page about
nothing and count towards no rule.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import BaseModel

from stayalive.core.run.spec import FailureLimit
from stayalive.core.run.timeline import PLANNED, Cause, Classification, Interruption, PagingClass, failures, is_planned

WINDOW = timedelta(hours=1)
RATE_FACTOR = 5.0
# The rate rule also needs this many failures in the window. Two are not a pattern: at Llama 3's
# MTBF of 3.1 h, a failure has another within the hour before it 1 − e^(−1/3.1) = 28% of the time,
# so "2 in an hour > 5 × 0.32/h" would page on more than a quarter of routine failures (docs/architecture.md §12).
# With three, an independent failure pages when two others fell in its hour: 4.1% at 3.1 h, 1.2% at
# the 6 h prior MTBF.
MIN_FAILURES_IN_WINDOW = 3
GOODPUT_FLOOR = 0.3
# A lost node's `step` is the workflow's last known progress (checkpoints, monitor events), not where
# the node died: two node losses without a completed step between them share it by construction. A
# failed GPU is seen by the node agent's NVML watch between steps, whatever step the ranks are at.
STEP_UNKNOWN_CAUSES = frozenset({Cause.NODE_LOST, Cause.GPU_FAULT})


def classify(
    history: list[Interruption], latest: Interruption, baseline_mtbf_s: float, goodput_last_hour: float | None
) -> Classification:
    """Classify `latest` against the run's earlier interruptions (`history` excludes it).

    Rules in order, the first that matches decides: same step twice (DETERMINISTIC), same node twice,
    failure rate anomaly, goodput collapse (CORRELATED); otherwise INDEPENDENT. `goodput_last_hour`
    is None when unknown or the run is younger than the window (core.decisions.goodput.recent_goodput).
    """
    if is_planned(latest):
        return PLANNED
    earlier = failures(history)
    if (same_step := _same_step(earlier, latest)) is not None:
        return Classification(
            paging=PagingClass.DETERMINISTIC,
            rule="same step twice",
            evidence=f"{latest.cause.value} at step {latest.step} again (also {same_step.cause.value} in "
            f"generation {same_step.generation})",
            action="stop the run: a failure that repeats at the same step is data or code, not hardware; "
            "inspect the batch and the code at that step, then resume_from an earlier checkpoint",
        )
    if latest.node is not None and any(i.node == latest.node for i in earlier):
        return Classification(
            paging=PagingClass.CORRELATED,
            rule="same node twice",
            evidence=f"node {latest.node} failed again after it was quarantined",
            action=f"quarantine is not holding {latest.node} out: check the fleet's quarantine records",
        )
    recent = [i for i in [*earlier, latest] if latest.at - i.at <= WINDOW]
    baseline_per_window = WINDOW.total_seconds() / baseline_mtbf_s
    if len(recent) > RATE_FACTOR * baseline_per_window and len(recent) >= MIN_FAILURES_IN_WINDOW:
        return Classification(
            paging=PagingClass.CORRELATED,
            rule="failure rate anomaly",
            evidence=f"{len(recent)} failures in the last hour, baseline {baseline_per_window:.2g}/h",
            action="look for a shared cause (rack, network, storage, a bad image) before the run burns its budget",
        )
    if goodput_last_hour is not None and goodput_last_hour < GOODPUT_FLOOR:
        return Classification(
            paging=PagingClass.CORRELATED,
            rule="goodput collapse",
            evidence=f"goodput over the last hour {goodput_last_hour:.0%} < {GOODPUT_FLOOR:.0%}",
            action="restarts are costing more than they recover: find what keeps interrupting the run",
        )
    return Classification(
        paging=PagingClass.INDEPENDENT,
        rule="independent",
        evidence="no pattern with earlier interruptions",
        action="restarted automatically; listed in the daily digest",
    )


def _same_step(earlier: list[Interruption], latest: Interruption) -> Interruption | None:
    """The earlier failure at the step `latest` failed at, whatever its cause (a poisoned batch may
    crash one generation and hang the next); None when either step is unknown or only approximate."""
    if latest.step is None or latest.cause in STEP_UNKNOWN_CAUSES:
        return None
    return next((i for i in earlier if i.step == latest.step and i.cause not in STEP_UNKNOWN_CAUSES), None)


def over_limit(history: list[Interruption], latest: Interruption, limit: FailureLimit) -> str | None:
    """Why the run gives up, if `latest` makes more failures within the spec's window than
    `failure_limit` allows (`history` excludes it); None while it may go on. Planned interruptions
    never count, and neither does the run's length: only how fast failures come."""
    if is_planned(latest):
        return None
    window = timedelta(seconds=limit.window)
    within = [i for i in [*failures(history), latest] if latest.at - i.at < window]
    if len(within) <= limit.failures:
        return None
    return (
        f"gave up: {len(within)} failures within {_hours(limit.window)} (failure_limit: at most {limit.failures}); "
        f"the last: {latest.line()}"
    )


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:g}h" if seconds >= 3600 else f"{seconds / 60:g}m" if seconds >= 60 else f"{seconds:g}s"


def environmental(ratio: float, evidence: str) -> Classification:
    """A slowdown every rank shares, with the rack hot: a page for facilities, not an eviction (see
    docs/architecture.md §11)."""
    return Classification(
        paging=PagingClass.CORRELATED,
        rule="environmental slowdown",
        evidence=f"every rank {ratio:.2f}× slower than healthy runs; {evidence}",
        action="page facilities (cooling, power): evicting nodes would only move the symptom",
    )


# Storage is away: training goes on and checkpoints stay in host memory (docs/architecture.md §8: halting would
# turn a storage incident into a training incident), but validation reads storage, so the newest
# resumable checkpoint stays the last one before the outage and a failure loses all the work since.
# Past this many checkpoint intervals that is more than a routine failure costs, and a person's to fix.
STORAGE_OUTAGE_INTERVALS = 3.0


def storage_outage(lasted_s: float, interval_s: float, error: str) -> Classification:
    """A storage outage that has lasted `lasted_s`, at a checkpoint interval of `interval_s`:
    CORRELATED (a person) past STORAGE_OUTAGE_INTERVALS intervals, INDEPENDENT (recorded) before
    that, and while the interval is not known yet (no step time measured)."""
    intervals = lasted_s / interval_s if interval_s > 0 else 0.0
    if intervals <= STORAGE_OUTAGE_INTERVALS:
        return Classification(
            paging=PagingClass.INDEPENDENT,
            rule="storage outage",
            evidence=f"checkpoint storage unavailable for {lasted_s:.0f}s: {error}",
            action="none yet: checkpoints stay in host memory and the write is retried",
        )
    return Classification(
        paging=PagingClass.CORRELATED,
        rule="storage outage",
        evidence=f"checkpoint storage unavailable for {lasted_s:.0f}s, {intervals:.1f} checkpoint intervals "
        f"(the bound is {STORAGE_OUTAGE_INTERVALS:g}): {error}",
        action="bring checkpoint storage back: training goes on with its checkpoints in host memory only, and a "
        "failure now rolls back to the last checkpoint before the outage",
    )


class Page(BaseModel):
    run_id: str
    at: datetime
    paging: PagingClass
    rule: str
    summary: str  # what happened, in one line
    evidence: str
    action: str  # what a person should do
    webhook_url: str | None = None
    jsonl_path: str | None = None

    @classmethod
    def of(
        cls,
        run_id: str,
        at: datetime,
        classification: Classification,
        summary: str,
        webhook_url: str | None = None,
        jsonl_path: str | None = None,
    ) -> Page:
        return cls(
            run_id=run_id,
            at=at,
            paging=classification.paging,
            rule=classification.rule,
            summary=summary,
            evidence=classification.evidence,
            action=classification.action,
            webhook_url=webhook_url,
            jsonl_path=jsonl_path,
        )

    def record(self) -> dict[str, object]:
        """What every sink receives: the page without where it is going."""
        return self.model_dump(mode="json", exclude={"webhook_url", "jsonl_path"})
