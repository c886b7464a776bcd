"""A run inside a real Slurm job: the sbatch template on a one-host Slurm cluster of three nodes, each
node a network namespace (tests/slurm/cluster.py), against a real Temporal dev server and supervisor
outside the job. The run survives a killed rank, the job's requeue (its agents and the launcher all
killed) reattaches to the same run, a node Slurm drains is drained from the run, and the job ends
COMPLETED with the run.

Skipped, with the reason, where Slurm cannot be started (not root, slurm-wlm or munge missing);
STAYALIVE_REQUIRE_SLURM=1 (CI) turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowHandle

from harness.tiny import TINY_ENTRYPOINT
from stayalive.core.decisions.slurm import run_workflow_id
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.status import RunResult, RunStatus
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.temporal import connect, plain
from tests.helpers import ROOT, wait_until
from tests.slurm.cluster import SlurmCluster, missing

NODES = ["c1", "c2", "c3"]
TARGET = 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if (why := missing()) is not None:
        if os.environ.get("STAYALIVE_REQUIRE_SLURM"):
            pytest.fail(f"Slurm is required here: {why}")
        pytest.skip(why)
    with SlurmCluster.start(tmp_path_factory.mktemp("slurm"), NODES, index=200 + os.getpid() % 50) as made:
        yield made
    for node in NODES:  # the agents' host-memory tiers
        shutil.rmtree(Path("/dev/shm/stayalive") / node, ignore_errors=True)


@pytest.fixture(scope="module")
async def outside(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DevStack]:
    """Temporal and the supervisor, outside the job: on this host, reached from the nodes over the bridge."""
    dev = DevStack(
        state_dir=tmp_path_factory.mktemp("outside"),
        nodes=[],
        port=free_port(),
        ui_port=None,
        metrics_port=free_port(),
        workdir=ROOT,
        ip=cluster.segment.host_ip,
    )
    dev.start()
    await dev.ready()
    yield dev
    dev.stop()


def job_fields(cluster: SlurmCluster, job: str) -> dict[str, str]:
    text = cluster.run("scontrol", "show", "job", "-o", job).stdout
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def wait_job(cluster: SlurmCluster, job: str, done: object, timeout: float = 180.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_fields(cluster, job)
        if done(fields):  # type: ignore[operator]
            return fields
        time.sleep(0.5)
    raise TimeoutError(f"job {job}: {job_fields(cluster, job)}")


def max_checkpoint(status: RunStatus) -> int:
    return max((c.step for c in status.checkpoints if c.validated), default=0)


async def test_a_run_in_a_slurm_job_survives_a_killed_rank_a_requeue_and_a_drain(
    cluster: SlurmCluster, outside: DevStack, tmp_path: Path
) -> None:
    spec = {
        "name": "slurm-tiny",
        "world_size": 2,
        "ranks_per_node": 1,
        "nodes": ["gpu-a", "gpu-b"],  # replaced by the allocation's first two nodes; the third is the spare
        "entrypoint": [*TINY_ENTRYPOINT[:-1], "60"],
        "min_nodes": 2,  # keep the width through the requeue: the run waits for its nodes to come back
        "target_step": TARGET,
        "checkpoint": {"root": str(tmp_path / "checkpoints"), "interval": "10 steps"},
        "health": {"node_heartbeat_timeout": "5s"},
        "faults": [{"kind": "crash", "rank": 1, "at_step": 20}],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    log = tmp_path / "job.log"
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "TEMPORAL_ADDRESS": f"{cluster.segment.host_ip}:{outside.port}",
        "STAYALIVE_SECRET_FILE": str(outside.secret_file),
        "STAYALIVE_STATE_DIR": str(tmp_path / "state"),
    }
    submitted = cluster.run(
        "sbatch", "-N3", f"--output={log}", f"--chdir={ROOT}", "--parsable",
        str(ROOT / "examples" / "stayalive.sbatch"), str(tmp_path / "spec.json"), "--poll", "1",
        env=env,
    )  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    client: Client = await connect(plain(outside.address))
    handle: WorkflowHandle = client.get_workflow_handle(run_workflow_id("slurm-tiny", job), result_type=RunResult)

    # The killed rank: rank 1 on c2 exits at step 20; c2 is quarantined and the spare c3 takes its place.
    status = await wait_until(
        handle, lambda s: s.generation >= 1 and s.state == RunState.RUNNING and max_checkpoint(s) >= 30, timeout=180
    )
    assert [(i.cause, i.node, i.rank) for i in status.interruptions] == [(Cause.CRASH, "c2", 1)]
    assert status.nodes == ["c1", "c3"]
    first_run = (await handle.describe()).run_id

    # A requeue kills the launcher and every agent (and their ranks); the job starts again and reattaches.
    cluster.run("scontrol", "requeue", job)
    # Slurm holds a requeued job back for a while (its begin time); start it as soon as its nodes are free.
    wait_job(cluster, job, lambda f: f["JobState"] == "PENDING")
    cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now")
    wait_job(cluster, job, lambda f: f["Restarts"] == "1" and f["JobState"] == "RUNNING")
    status = await wait_until(handle, lambda s: s.state == RunState.RUNNING and s.generation >= 2, timeout=180)
    assert "how=reattached" in log.read_text()
    assert (await handle.describe()).run_id == first_run, "the requeued job reattached to the same run"

    # Slurm drains a node of the run: the launcher turns it into the run's drain_node.
    cluster.run("scontrol", "update", f"nodename={status.nodes[-1]}", "state=drain", "reason=fan failing")
    drained = status.nodes[-1]
    await wait_until(handle, lambda s: any(i.cause == Cause.DRAIN and i.node == drained for i in s.interruptions))

    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert result.final_step == TARGET
    causes = [(i.cause, i.node) for i in result.interruptions]
    assert causes[0] == (Cause.CRASH, "c2")
    assert any(cause == Cause.NODE_LOST for cause, _ in causes[1:]), causes  # the requeue took every agent
    drain = next(i for i in result.interruptions if i.cause == Cause.DRAIN)
    assert drain.node == drained and "fan failing" in drain.detail + " ".join(drain.actions)
    executions = [e async for e in client.list_workflows(f"WorkflowId = '{handle.id}'")]
    assert [e.run_id for e in executions] == [first_run], "one run, never a second"

    fields = wait_job(cluster, job, lambda f: f["JobState"] not in ("RUNNING", "COMPLETING"))
    assert fields["JobState"] == "COMPLETED", log.read_text()[-3000:]
    assert fields["ExitCode"] == "0:0"
