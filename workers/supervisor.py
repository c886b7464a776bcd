"""The supervisor worker: RunWorkflow and the run-level activities, on task queue `stayalive`.

    python -m workers.supervisor --address 127.0.0.1:7233

It holds no state of its own: kill it and start another, and Temporal hands it the same runs.
"""

from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta

import structlog
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from activities.checkpoints import choose_checkpoint, keep_checkpoints
from activities.monitor import monitor_run
from training.logs import configure_logging
from workflows.run import TASK_QUEUE, RunWorkflow

log = structlog.get_logger()


async def connect(address: str, namespace: str = "default") -> Client:
    return await Client.connect(address, namespace=namespace, data_converter=pydantic_data_converter)


async def serve(address: str, namespace: str) -> None:
    client = await connect(address, namespace)
    worker = Worker(
        client,
        task_queue=TASK_QUEUE,
        workflows=[RunWorkflow],
        activities=[monitor_run, keep_checkpoints, choose_checkpoint],
        # Heartbeats carry the live summary that `stayalive watch` and the UI show: send them every second.
        max_heartbeat_throttle_interval=timedelta(seconds=1),
    )
    log.info("supervisor worker started", address=address, task_queue=TASK_QUEUE)
    await worker.run()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.supervisor", description=__doc__)
    parser.add_argument("--address", default="127.0.0.1:7233", help="Temporal frontend host:port")
    parser.add_argument("--namespace", default="default")
    args = parser.parse_args()
    configure_logging(node="supervisor")
    asyncio.run(serve(args.address, args.namespace))


if __name__ == "__main__":
    main()
