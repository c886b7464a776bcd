"""Prometheus metrics of every open run, for the supervisor worker's `/metrics`.

The numbers live in the runs' workflow state; this only reads them. `refresh` asks each running
RunWorkflow for its `health` query every few seconds and `Exporter` turns the answer into gauges, so
a scrape never touches Temporal and a Temporal outage freezes the numbers instead of failing the
scrape. One query, so that the ledger and the interruption counts come from one workflow state (two
queries can straddle an interruption and serve its count without its cost). Interruption counts are
gauges of the timeline's totals: the timeline is the source of truth, and a counter incremented here
would double-count on restart.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from temporalio.client import Client

from stayalive.core.book.health import Health
from stayalive.core.run.timeline import Cause

log = structlog.get_logger()

OPEN_RUNS = "WorkflowType='RunWorkflow' AND ExecutionStatus='Running'"
REFRESH_SECONDS = 5.0
QUERY_TIMEOUT = timedelta(seconds=5)  # one run whose worker is gone must not stall the others
# A monitor that keeps up judges a step well inside a second of its last report; past 2 s it does not.
JUDGING_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
LEDGER_CATEGORIES = ("productive", "startup", "checkpoint", "lost", "recovery", "idle", "straggler")


class Exporter:
    """Gauges per run (label `run_id`: the workflow id, stable across continue-as-new), in a registry
    of their own so nothing else in the process leaks into, or collides with, these metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, ["run_id", *labels], registry=self.registry)

        self.goodput = gauge("stayalive_goodput_ratio", "Share of the run's wall-clock spent on productive compute")
        self.ledger = gauge("stayalive_ledger_seconds", "The run's wall-clock by goodput ledger category", "category")
        self.step_p50 = gauge("stayalive_step_time_p50_seconds", "Median step time over the recent window")
        self.step_max = gauge("stayalive_step_time_max_seconds", "Slowest step time over the recent window")
        self.checkpoint_interval = gauge(
            "stayalive_checkpoint_interval_seconds", "Checkpoint interval in force (absent when fixed in steps)"
        )
        self.interruptions = gauge("stayalive_interruptions", "Interruptions in the run's timeline, by cause", "cause")
        # Observed by this process's run monitors (activities/monitor.py), not refreshed from workflow state.
        self.judging_lag = Histogram(
            "stayalive_monitor_judging_lag_seconds",
            "From a step's newest report being made on its rank to the run monitor judging the step",
            ["run_id"],
            buckets=JUDGING_BUCKETS,
            registry=self.registry,
        )
        self.runs: set[str] = set()
        self._causes: dict[str, set[str]] = {}  # per run, the cause labels it has series for
        self._server: WSGIServer | None = None

    def update(self, run_id: str, health: Health) -> None:
        book = health.ledger
        self.goodput.labels(run_id).set(book.goodput)
        for category in LEDGER_CATEGORIES:
            self.ledger.labels(run_id, category).set(getattr(book, category))
        self.step_p50.labels(run_id).set(health.step_time_p50)
        self.step_max.labels(run_id).set(health.step_time_max)
        if health.checkpoint_interval_s is None:
            self.checkpoint_interval.remove(run_id)  # a no-op when it was never set
        else:
            self.checkpoint_interval.labels(run_id).set(health.checkpoint_interval_s)
        # Every known cause, zeros included: a series that appears only at its first event hides the
        # step from nothing to one from `increase()`.
        causes = self._causes.setdefault(run_id, set())
        causes |= {c.value for c in Cause} | set(health.interruptions_by_cause)
        for cause in causes:
            self.interruptions.labels(run_id, cause).set(health.interruptions_by_cause.get(cause, 0))
        self.runs.add(run_id)

    def forget(self, run_id: str) -> None:
        """Drop every series of a run that is no longer open: a finished run's gauges would otherwise
        report its last values forever."""
        for metric in (self.goodput, self.step_p50, self.step_max, self.checkpoint_interval, self.judging_lag):
            metric.remove(run_id)
        for category in LEDGER_CATEGORIES:
            self.ledger.remove(run_id, category)
        for cause in self._causes.pop(run_id, set()):
            self.interruptions.remove(run_id, cause)
        self.runs.discard(run_id)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve `/metrics` on host:port from a daemon thread; returns the port (useful with 0)."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


async def refresh(client: Client, exporter: Exporter, every_s: float = REFRESH_SECONDS) -> None:
    """Keep `exporter` current with every open run until cancelled."""
    while True:
        try:
            await refresh_once(client, exporter)
        except Exception as exc:  # the listing failed (server restarting): keep the last numbers
            log.warning("metrics refresh failed", error=str(exc))
        await asyncio.sleep(every_s)


async def refresh_once(client: Client, exporter: Exporter) -> set[str]:
    """One pass: query every open run, update its gauges, forget runs that closed. Returns the open
    runs' workflow ids. A run whose queries fail keeps its last numbers until it closes."""
    open_runs = [execution.id async for execution in client.list_workflows(OPEN_RUNS)]
    answers = await asyncio.gather(*(_health(client, run) for run in open_runs), return_exceptions=True)
    for run, answer in zip(open_runs, answers, strict=True):
        if isinstance(answer, BaseException):
            log.warning("metrics query failed", run_id=run, error=str(answer))
            continue
        exporter.update(run, answer)
    for closed in exporter.runs - set(open_runs):
        exporter.forget(closed)
    return set(open_runs)


async def _health(client: Client, workflow_id: str) -> Health:
    # By query name, not RunWorkflow's method: activities never import workflow code.
    return await client.get_workflow_handle(workflow_id).query("health", result_type=Health, rpc_timeout=QUERY_TIMEOUT)
