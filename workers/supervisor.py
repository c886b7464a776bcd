"""The supervisor worker: RunWorkflow, FleetWorkflow and the run-level activities, on task queue `stayalive`.

    python -m stayalive.workers.supervisor --address 127.0.0.1:7233 --secret-file secret --metrics-port 9464

Temporal's address, namespace and TLS settings are the temporal CLI's (workers/temporal.py); the
fleet's secret (workers/secret.py) is what the node agents' hubs take for its requests.

It holds no state of its own: kill it and start another, and Temporal hands it the same runs. Its
`/metrics` serves every open run's goodput ledger, interruptions, step times and checkpoint interval
for Prometheus (activities/metrics.py).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import structlog
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.envconfig import ClientConnectConfig
from temporalio.worker import Worker

from stayalive.activities.checkpoints import choose_checkpoint, test_loader
from stayalive.activities.fleet import FleetActivities
from stayalive.activities.metrics import Exporter, refresh
from stayalive.activities.monitor import MonitorActivities
from stayalive.activities.nodes import NodeActivities
from stayalive.activities.paging import deliver_webhook, page
from stayalive.core.fleet.requests import fleet_id
from stayalive.training.logs import configure_logging
from stayalive.workers.secret import add_secret_flag, load_secret
from stayalive.workers.temporal import add_temporal_flags, client_config, connect
from stayalive.workflows.fleet import FleetInput, FleetWorkflow
from stayalive.workflows.run import TASK_QUEUE, RunWorkflow

log = structlog.get_logger()


# The web UI lists runs by these (RunWorkflow upserts them): state, step, goodput.
SEARCH_ATTRIBUTES = {
    "RunState": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    "Step": IndexedValueType.INDEXED_VALUE_TYPE_INT,
    "Goodput": IndexedValueType.INDEXED_VALUE_TYPE_DOUBLE,
}


async def ensure_search_attributes(client: Client) -> None:
    """Register the run's search attributes on the server (the dev server gets them at start already)."""
    existing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    missing = {name: kind for name, kind in SEARCH_ATTRIBUTES.items() if name not in existing.custom_attributes}
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=client.namespace, search_attributes=missing)
        )


async def ensure_fleet(client: Client, cluster: str = "default") -> None:
    """The cluster's FleetWorkflow runs for as long as the cluster does; start it if it is not running."""
    await client.start_workflow(
        FleetWorkflow.run,
        FleetInput(),
        id=fleet_id(cluster),
        task_queue=TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )


METRICS_PORT = 9464  # the Prometheus exporters' customary default


def activities(client: Client, secret: bytes, exporter: Exporter) -> list[Callable[..., Any]]:
    """Every activity of RunWorkflow and FleetWorkflow: the node agents are reached from here."""
    fleet = FleetActivities(client)
    nodes = NodeActivities(fleet, secret)
    return [
        MonitorActivities(fleet, secret, exporter.judging_lag).monitor_run,
        choose_checkpoint,
        nodes.launch,
        nodes.command,
        nodes.release,
        nodes.dump_stacks,
        nodes.self_test,
        *fleet.activities(),
        page,
        deliver_webhook,
    ]


async def serve(
    temporal: ClientConnectConfig, secret: bytes, metrics_port: int, metrics_host: str = "127.0.0.1"
) -> None:
    # Bind first: a port in use must stop this process at start with the reason, before it polls.
    exporter = Exporter()
    try:
        metrics_port = exporter.serve(metrics_port, host=metrics_host)
    except OSError as exc:
        raise SystemExit(
            f"cannot serve /metrics on {metrics_host}:{metrics_port}: {exc.strerror}. Is another supervisor "
            "running here? Pick a free port with --metrics-port (0: any free one)."
        ) from exc
    client = await connect(temporal)
    worker = Worker(
        client,
        task_queue=TASK_QUEUE,
        workflows=[RunWorkflow, FleetWorkflow],
        activities=activities(client, secret, exporter),
        # Heartbeats carry the live summary that `stayalive watch` and the UI show: send them every second.
        max_heartbeat_throttle_interval=timedelta(seconds=1),
    )
    await ensure_search_attributes(client)
    await ensure_fleet(client)
    await test_loader.start()
    metrics = asyncio.create_task(refresh(client, exporter))
    log.info(
        "supervisor worker started",
        address=temporal.get("target_host"),
        tls=bool(temporal.get("tls")),
        task_queue=TASK_QUEUE,
        metrics_port=metrics_port,
    )
    try:
        await worker.run()
    finally:
        metrics.cancel()
        exporter.close()


def parser() -> argparse.ArgumentParser:
    """The supervisor's command line (deploy/kubernetes checks its Deployment's flags against it)."""
    parser = argparse.ArgumentParser(
        prog="python -m stayalive.workers.supervisor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_temporal_flags(parser)
    add_secret_flag(parser)
    parser.add_argument("--metrics-port", type=int, default=METRICS_PORT, help="serve /metrics on this port")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="0.0.0.0 lets a Prometheus on another host scrape")
    return parser


def main() -> None:
    cli = parser()
    args = cli.parse_args()
    configure_logging(node="supervisor")
    try:
        temporal = client_config(args)
    except ValueError as exc:
        cli.error(str(exc))
    asyncio.run(serve(temporal, load_secret(args.secret_file), args.metrics_port, args.metrics_host))


if __name__ == "__main__":
    main()
