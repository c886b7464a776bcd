"""The soak's report: a table by fault kind, and the figures of its last JSON line."""

from __future__ import annotations

import statistics
from typing import Any

from rich.table import Table

from bench.soak_checks import FaultVerdict, RunVerdict
from bench.soak_plan import KINDS


def table(verdicts: list[RunVerdict]) -> Table:
    out = Table(title="Fault soak: each fault kind, as the runs' timelines show it")
    for column in (
        "fault",
        "injected",
        "as planned",
        "wrong blame",
        "missed",
        "lost steps (mean)",
        "recovery s (median)",
    ):
        out.add_column(column, justify="left" if column == "fault" else "right")
    by_kind: dict[str, list[FaultVerdict]] = {}
    for verdict in verdicts:
        for fault in verdict.faults:
            by_kind.setdefault(fault.fault.kind, []).append(fault)
    for kind, label in KINDS.items():
        faults = by_kind.get(kind, [])
        if not faults:
            continue
        lost = [f.lost_steps for f in faults if f.lost_steps is not None]
        recovery = [f.restart_s for f in faults if f.restart_s is not None]
        out.add_row(
            label,
            str(len(faults)),
            str(sum(f.caught and f.blame_right for f in faults)),
            str(sum(f.caught and not f.blame_right for f in faults)),
            str(sum(not f.caught for f in faults)),
            f"{statistics.mean(lost):.1f}" if lost else "-",
            f"{statistics.median(recovery):.1f}" if recovery else "-",
        )
    return out


def problems(verdict: RunVerdict) -> list[str]:
    """Every check the run failed, in words."""
    found = [] if verdict.completed else [f"ended {verdict.state} at step {verdict.final_step}"]
    if verdict.completed and not verdict.weights_equal:
        found.append("final weights differ from the reference run's")
    if verdict.samples_lost or verdict.samples_repeated or verdict.samples_out_of_order:
        found.append(
            f"samples: {verdict.samples_lost} lost, {verdict.samples_repeated} repeated, "
            f"{verdict.samples_out_of_order} out of order"
            + (f" (reports: {verdict.reports_missing})" if verdict.reports_missing else "")
        )
    found += [f"{f.fault.kind}: {f.detail}" for f in verdict.faults if not (f.caught and f.blame_right)]
    found += [f"unexplained: {u}" for u in verdict.unexpected]
    found += [f"unvalidated resume: {u}" for u in verdict.unvalidated_resumes]
    found += [f"no cost: {u}" for u in verdict.uncosted]
    return found


def summary(verdicts: list[RunVerdict], poisoned: tuple[bool, str], partitions: str) -> dict[str, Any]:
    faults = [f for v in verdicts for f in v.faults]
    figures: dict[str, Any] = {
        "bench": "soak",
        "faults": len(faults),
        "runs": len(verdicts),
        "completed": sum(v.completed for v in verdicts),
        "samples_lost": sum(v.samples_lost for v in verdicts),
        "samples_repeated": sum(v.samples_repeated for v in verdicts),
        "samples_out_of_order": sum(v.samples_out_of_order for v in verdicts),
        "weights_mismatch": sum(not (v.completed and v.weights_equal) for v in verdicts),
        "wrong_blame": sum(f.caught and not f.blame_right for f in faults) + sum(len(v.unexpected) for v in verdicts),
        "missed": sum(not f.caught for f in faults),
        "unvalidated_resumes": sum(len(v.unvalidated_resumes) for v in verdicts),
        "uncosted": sum(len(v.uncosted) for v in verdicts),
        "poisoned_batch_stopped": poisoned[0],
        "poisoned_batch": poisoned[1],
        "partitions": partitions,
        "kinds": len({f.fault.kind for f in faults}),
    }
    counts = [k for k in figures if k not in ("bench", "faults", "runs", "completed", "kinds")]
    failed = [k for k in counts if isinstance(figures[k], int) and not isinstance(figures[k], bool) and figures[k]]
    figures["bar"] = figures["completed"] == len(verdicts) and not failed and poisoned[0]
    return figures
