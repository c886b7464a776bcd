"""Page on the pattern, not the count (seed 003, R5).

INDEPENDENT failures are restarted silently and reported; CORRELATED ones page a human;
DETERMINISTIC ones (the same step failing again) stop the run, because restarting cannot fix data
or code.
"""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from core.run import Interruption

WINDOW = timedelta(hours=1)
RATE_FACTOR = 5.0
GOODPUT_FLOOR = 0.3


class PagingClass(StrEnum):
    INDEPENDENT = "independent"
    CORRELATED = "correlated"
    DETERMINISTIC = "deterministic"


class Classification(BaseModel):
    paging: PagingClass
    rule: str
    evidence: str
    action: str


# A drain, a pause or a rollback: a person or a detector asked for it; nothing to page about.
PLANNED = Classification(paging=PagingClass.INDEPENDENT, rule="planned", evidence="asked for", action="none")


def classify(
    history: list[Interruption], latest: Interruption, baseline_mtbf_s: float, goodput_last_hour: float | None
) -> Classification:
    """Classify `latest` against the run's earlier interruptions (`history` excludes it)."""
    earlier_steps = [i.step for i in history if i.step is not None and i.cause == latest.cause]
    if latest.step is not None and latest.step in earlier_steps:
        return Classification(
            paging=PagingClass.DETERMINISTIC,
            rule="same step twice",
            evidence=f"{latest.cause.value} at step {latest.step} again (also in generation "
            f"{next(i.generation for i in history if i.step == latest.step)})",
            action="stop the run: a failure that repeats at the same step is data or code, not hardware; "
            "inspect the batch and the code at that step, then resume_from an earlier checkpoint",
        )
    if latest.node is not None and any(i.node == latest.node for i in history):
        return Classification(
            paging=PagingClass.CORRELATED,
            rule="same node twice",
            evidence=f"node {latest.node} failed again after it was quarantined",
            action=f"quarantine is not holding {latest.node} out: check the fleet's quarantine records",
        )
    recent = [i for i in [*history, latest] if latest.at - i.at <= WINDOW]
    baseline_per_hour = WINDOW.total_seconds() / baseline_mtbf_s
    if len(recent) > RATE_FACTOR * baseline_per_hour and len(recent) >= 2:
        return Classification(
            paging=PagingClass.CORRELATED,
            rule="failure rate anomaly",
            evidence=f"{len(recent)} interruptions in the last hour, baseline {baseline_per_hour:.2g}/h",
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


def environmental(ratio: float, evidence: str) -> Classification:
    """A slowdown every rank shares, with the rack hot: a page for facilities, not an eviction (seed 000)."""
    return Classification(
        paging=PagingClass.CORRELATED,
        rule="environmental slowdown",
        evidence=f"every rank {ratio:.2f}× slower than healthy runs; {evidence}",
        action="page facilities (cooling, power): evicting nodes would only move the symptom",
    )
