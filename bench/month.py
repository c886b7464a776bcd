"""30 days of one run, through the real RunWorkflow and FleetWorkflow under the time-skipping test
server (sim/month.py): at 1,024 GPUs (128 nodes × 8) and, without --quick, 16,384 (2,048 × 8), with
failures drawn from the Llama 3 405B mix (sim/failure_mix.py); then the reference table of
docs/architecture.md §14, a run of crashes only with C = 30 s, R = 600 s and M = 3.093 h, at Daly's
interval and at a fixed 30 minutes.

Per run: the goodput ledger by category; the overhead that the equation C/T + (T/2)/M + R/M (§14)
predicts for the run's own measured C, M, R and T beside the simulated one (both over the time the
run was exposed to failure: wall-clock less its first startup and the restarts of planned drains);
every interval chosen after the first interruption against Daly's for the C and M measured then;
pages per week by class; interruptions on nodes that had failed before; nodes that failed their
self-test and came back into the run (never, or the bar fails); history events per interruption
(without the test server's empty workflow tasks, which a real server does not write) and the
largest payload. Plots of each run go to --out (stayalive report's figures).

    python -m bench.month [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from stayalive.core.decisions.interval import daly, overhead
from stayalive.core.run.lifecycle import RunState
from stayalive.sim import history
from stayalive.sim.failure_mix import draw, load_mix
from stayalive.sim.measure import came_back, interval_error, measured, pages_per_week, repeat_nodes
from stayalive.sim.month import (
    BLOCKING_S,
    DAY_S,
    RANKS_PER_NODE,
    STARTUP_S,
    STEP_S,
    Month,
    MonthRan,
    crashes_every,
    simulate,
)
from stayalive.workers.report import write_report

DAYS = 30
DRAW_SEED = 3
REFERENCE_MTBF_S = 3.093 * 3600  # Llama 3's 54 days over 419 interruptions at 16,384 GPUs
REFERENCE_TABLE = {"daly": 12.73, "30min": 15.14}  # the reference table, percent (docs/architecture.md §14)
OVERHEAD_GAP_POINTS = 1.0
REFERENCE_GAP_POINTS = 0.5
INTERVAL_ERROR = 0.10
BUDGET_EVENTS = 50
PAYLOAD_LIMIT = 256 * 1024
QUICK_LIMIT_S = 300.0


def mix_month(nodes: int) -> Month:
    """A month at `nodes` × 8 GPUs of the Llama 3 mix; its length in steps is what a month holds at
    the overhead Daly's interval predicts for the mix's MTBF (the run ends about then)."""
    gpus = nodes * RANKS_PER_NODE
    mix = load_mix()
    m = mix.mtbf_hours(gpus) * 3600
    predicted = overhead(BLOCKING_S, daly(BLOCKING_S, m), m, STARTUP_S)
    draws = draw(mix, gpus, days=DAYS * 1.5, seed=DRAW_SEED, nodes=nodes)  # training time to spare
    return Month(f"month-{gpus}", nodes, draws, target_step=round(DAYS * DAY_S * (1 - predicted) / STEP_S))


def reference_month(interval: str, key: str) -> Month:
    """The reference table: crashes only, a fixed count at M = 3.093 h, over the training a month holds."""
    m, r = REFERENCE_MTBF_S, STARTUP_S
    period = daly(BLOCKING_S, m) if interval == "auto" else 1800.0
    target = round(DAYS * DAY_S * (1 - REFERENCE_TABLE[key] / 100) / STEP_S)
    training = target * STEP_S / (1 - (period / 2) / (m - r))  # the steps, and the work redone after each crash
    draws = crashes_every(m, r, training, seed=DRAW_SEED)
    return Month(f"reference-{key}", 128, draws, target_step=target, interval=interval, prior_mtbf_s=m)


def figures(ran: MonthRan, out: Path) -> dict[str, object]:
    status = ran.status
    assert status.finished_at is not None
    got = measured(ran)
    book = got.ledger
    events = [cost.as_signalled for cost in ran.costs]
    paths = write_report(status, status.finished_at, out / ran.month.name)
    return {
        "run": ran.month.name,
        "gpus": ran.month.nodes * RANKS_PER_NODE,
        "completed": status.state == RunState.COMPLETED,
        "days": round(book.wall / DAY_S, 2),
        "goodput": round(book.goodput, 4),
        "ledger_hours": {k: round(v / 3600, 2) for k, v in book.model_dump().items() if k != "wall"},
        "failures": got.failures,
        "planned": status.interruption_count() - got.failures,
        "by_cause": status.interruptions_by_cause(),
        "measured": {
            "C_s": round(got.c, 1),
            "M_h": round(got.m / 3600, 3),
            "R_s": round(got.r, 1),
            "T_s": round(got.t),
        },
        "overhead_simulated_pct": round(100 * got.simulated, 2),
        "overhead_formula_pct": round(100 * got.formula, 2),
        "overhead_gap_points": round(100 * (got.simulated - got.formula), 2),
        "interval_error_max": round(interval_error(ran), 4),
        "pages_per_week": pages_per_week(ran),
        "repeat_nodes": repeat_nodes(status),
        "self_tests_failed": sum(not passed for _, _, passed in ran.cluster.self_tests),
        "failed_self_test_came_back": len(came_back(ran)),
        "events_per_interruption_max": max(events, default=0),
        "events_per_interruption_mean": round(statistics.fmean(events), 1) if events else 0.0,
        "events_per_interruption_max_quiet": max((cost.events for cost in ran.costs), default=0),
        "events_per_interruption_max_by_kind": {
            what: max(c.as_signalled for c in ran.costs if c.what == what)
            for what in sorted({c.what for c in ran.costs})
        },
        "history_events": sum(len(s) for s in ran.run),
        "segments": len(ran.run),
        "payload_max_bytes": history.largest_payload(e for s in [*ran.run, *ran.fleet] for e in s),
        "real_s": round(ran.real_s, 1),
        "plots": [str(p) for p in paths],
    }


def reference_table(rows: dict[str, dict[str, object]]) -> dict[str, object]:
    table: dict[str, object] = {}
    for key, expected in REFERENCE_TABLE.items():
        simulated = float(rows[key]["overhead_simulated_pct"])  # type: ignore[arg-type]
        gap = round(simulated - expected, 2)
        table[key] = {"reference_pct": expected, "simulated_pct": simulated, "gap_points": gap}
    return table


async def main(quick: bool, out: Path) -> dict[str, object]:
    server = Path(sys.executable).parent / "temporal-test-server"
    began = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="bench-month-"))
    months = {
        "daly": reference_month("auto", "daly"),
        "30min": reference_month("1800s", "30min"),
        "1024": mix_month(128),
    }
    if not quick:
        months["16384"] = mix_month(2048)
    ran = {key: await simulate(month, root / key, server) for key, month in months.items()}
    rows = {key: figures(r, out) for key, r in ran.items()}
    mix = [rows[k] for k in ("1024", "16384") if k in rows]
    table = reference_table(rows)
    seconds = time.monotonic() - began
    line: dict[str, object] = {
        "bench": "month",
        "quick": quick,
        "days": DAYS,
        "completed": all(bool(r["completed"]) for r in rows.values()),
        "overhead_gap_points": max((float(r["overhead_gap_points"]) for r in mix), key=abs),  # type: ignore[arg-type]
        "interval_error_max": max(float(r["interval_error_max"]) for r in rows.values()),  # type: ignore[arg-type]
        "reference_gap_points": max((float(t["gap_points"]) for t in table.values()), key=abs),  # type: ignore[index]
        "events_per_interruption_max": max(int(r["events_per_interruption_max"]) for r in rows.values()),  # type: ignore[call-overload]
        "payload_max_bytes": max(int(r["payload_max_bytes"]) for r in rows.values()),  # type: ignore[call-overload]
        "failed_self_test_came_back": sum(int(r["failed_self_test_came_back"]) for r in rows.values()),  # type: ignore[call-overload]
        "reference_table": table,
        "runs": list(rows.values()),
        "seconds": round(seconds, 1),
    }
    line["bar"] = bool(
        line["completed"]
        and abs(line["overhead_gap_points"]) <= OVERHEAD_GAP_POINTS  # type: ignore[arg-type]
        and line["interval_error_max"] <= INTERVAL_ERROR  # type: ignore[operator]
        and abs(line["reference_gap_points"]) <= REFERENCE_GAP_POINTS  # type: ignore[arg-type]
        and line["events_per_interruption_max"] <= BUDGET_EVENTS  # type: ignore[operator]
        and line["payload_max_bytes"] <= PAYLOAD_LIMIT  # type: ignore[operator]
        and line["failed_self_test_came_back"] == 0
        and (not quick or seconds < QUICK_LIMIT_S)
    )
    show(rows, table)
    return line


def show(rows: dict[str, dict[str, object]], table: dict[str, object]) -> None:
    console = Console(stderr=True)
    runs = Table(title=f"{DAYS} simulated days (the overhead is over the time exposed to failure)")
    for column in ("run", "days", "failures", "planned", "C / M / R / T", "simulated", "formula", "events max"):
        runs.add_column(column)
    for r in rows.values():
        measured = r["measured"]
        assert isinstance(measured, dict)
        runs.add_row(
            str(r["run"]),
            str(r["days"]),
            str(r["failures"]),
            str(r["planned"]),
            f"{measured['C_s']}s / {measured['M_h']}h / {measured['R_s']}s / {measured['T_s']}s",
            f"{r['overhead_simulated_pct']}%",
            f"{r['overhead_formula_pct']}%",
            str(r["events_per_interruption_max"]),
        )
    console.print(runs)
    console.print(f"reference table (docs/architecture.md §14): {table}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,024 GPUs and the reference table only")
    parser.add_argument("--out", type=Path, default=Path(".stayalive") / "bench-month", help="where the plots go")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.quick, args.out))), flush=True)
