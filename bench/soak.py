"""A randomized fault soak: many faults, in any order, on real ranks and a real dev server, and after
every run the checks a user's trust rests on.

A headless dev stack (workers/devstack.py) on free ports: nodes n1 and n2 train (two ranks each), n3
and n4 are spares. Where this host can make network namespaces (root, iproute2), n2's agent runs in
one (workers/netns.py), so that cutting its link partitions it for real. A seeded schedule
(bench/soak_plan.py) draws faults from the whole matrix (rank crashes, hangs in compute and in the
collective, agents, the supervisor and the server killed, a partition, storage away and full, the
five checkpoint damages, a transient SDC, a straggler, and faults that land during a restart, a drain
or a checkpoint write) and lays them into runs of the same spec as a fault-free reference run.

After every run (bench/soak_checks.py): it COMPLETED; every global sample was consumed exactly once,
in order; its final weights are bitwise those of the reference; it never resumed from a checkpoint
that was not validated (nor from a damaged one); each fault is on the timeline as the cause it is,
blaming the rank and node it hit, and nothing else is; every interruption carries its cost. Then a
poisoned batch (the same step failing in every generation) must end STOPPED, with a page.

The bar: every check holds for every run.

    python -m bench.soak [--quick] [--faults N] [--seed S] [--dir D]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from temporalio.client import Client, WorkflowHandle

from bench.soak_checks import RunVerdict, coverage, judge_faults, uncosted, unvalidated_resumes
from bench.soak_faults import FaultDriver, status_of
from bench.soak_plan import CHECKPOINT_EVERY, TARGET_STEP, WORLD_SIZE, RunPlan, plan
from bench.soak_report import problems, summary, table
from harness.records import RecordCollector, sample_tally, step_reports
from harness.tiny import TINY_ENTRYPOINT, final_state
from stayalive.core.protocol.telemetry import RankStarted
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import CheckpointRecord, RunResult
from stayalive.core.run.timeline import PagingClass
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.netns import Partitionable, usable
from stayalive.workers.secret import SECRET_ENV, create_secret
from stayalive.workers.temporal import connect, plain
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import TASK_QUEUE, RunWorkflow

REPO = Path(__file__).resolve().parent.parent
NODES, SPARES = ["n1", "n2"], ["n3", "n4"]
GLOBAL_BATCH = 8
RUN_TIMEOUT_S = 600.0
DEVICE_MS = 50  # TARGET_STEP steps of it outlast a partition's fence and report after a cut at the first fault


def soak_spec(root: Path, name: str, faults: list[dict[str, Any]], **more: Any) -> RunSpec:
    """The tiny GPT on 4 ranks, DEVICE_MS of device time a step (the run outlasts a partition's fence),
    checkpoints and SDC self-checks every 10 steps, short heartbeat and fence, and a failure limit
    no soak run reaches: the soak is many faults by design."""
    return RunSpec.model_validate(
        {
            "name": name,
            "world_size": WORLD_SIZE,
            "ranks_per_node": 2,
            "nodes": NODES,
            "spare_nodes": SPARES,
            "min_nodes": len(NODES),  # the width is kept: weights compare bitwise with the reference
            "entrypoint": [*TINY_ENTRYPOINT[:-1], str(DEVICE_MS)],
            "target_step": TARGET_STEP,
            "checkpoint": {"root": str(root / "checkpoints"), "interval": f"{CHECKPOINT_EVERY} steps"},
            "sdc": {"self_check_every": CHECKPOINT_EVERY},
            "health": {"node_heartbeat_timeout": "5s", "partition_fence": "20s"},
            "failure_limit": {"failures": 100, "window": "6h"},
            "faults": faults,
        }
        | more
    )


@dataclass
class Soak:
    stack: DevStack
    client: Client
    root: Path
    faults: FaultDriver
    reference: dict[str, Any] = field(default_factory=dict)

    # -- runs ----------------------------------------------------------------------------------------

    async def settled(self, timeout: float = 240) -> None:
        """Every node usable and in no run: the last run's quarantined nodes passed their self-tests."""
        fleet = fleet_handle(self.client)
        deadline = time.monotonic() + timeout
        known: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self.stack.check_alive()
            with contextlib.suppress(Exception):
                known = {n.id: n for n in await fleet.query(FleetWorkflow.nodes)}
                if all(n in known and known[n].state.usable and known[n].run_id is None for n in self.stack.nodes):
                    return
            await asyncio.sleep(0.5)
        shown = ", ".join(f"{n.id} {n.state.value} (run {n.run_id})" for n in known.values())
        raise TimeoutError(f"the fleet did not settle within {timeout:g}s: {shown}")

    async def result(self, handle: WorkflowHandle) -> RunResult:
        """The run's result, across a dev server restart (a long poll cut by the kill is asked again)."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            try:
                return await handle.result()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)

    async def watch_checkpoints(self, handle: WorkflowHandle, into: dict[tuple[int, int], CheckpointRecord]) -> None:
        """Every checkpoint record the run shows, newest state of each: retention drops records a
        resume may have used."""
        while True:
            status = await status_of(handle)
            for record in [*status.rejected_checkpoints, *status.checkpoints]:
                into[(record.step, record.generation)] = record
            await asyncio.sleep(1)

    async def run(self, run: RunPlan) -> RunVerdict:
        await self.settled()
        spec = soak_spec(self.root, f"soak-{run.index}", run.spec_faults())
        began = time.monotonic()
        handle = await self.client.start_workflow(
            RunWorkflow.run, spec, id=f"soak-{run.index}-{int(time.time())}", task_queue=TASK_QUEUE
        )
        collector = RecordCollector(self.client, handle, [*spec.nodes, *spec.spare_nodes])
        records: dict[tuple[int, int], CheckpointRecord] = {}
        watcher = asyncio.create_task(self.watch_checkpoints(handle, records))
        driver = asyncio.create_task(self.faults.drive(handle, run))
        try:
            result = await asyncio.wait_for(self.result(handle), RUN_TIMEOUT_S)
            acted, missed = await asyncio.wait_for(driver, timeout=120)
        finally:
            watcher.cancel()
            driver.cancel()
        status = await status_of(handle)
        for record in [*status.rejected_checkpoints, *status.checkpoints]:
            records[(record.step, record.generation)] = record
        evidence = await collector.stop()
        placement = {(m.generation, m.rank): r.node for r in evidence if isinstance(m := r.message, RankStarted)}
        faults, unexpected = judge_faults(run, result.interruptions, status.detections, placement, acted, missed)
        verdict = RunVerdict(
            index=run.index,
            state=result.state.value,
            final_step=result.final_step,
            wall_s=time.monotonic() - began,
            faults=faults,
            unexpected=unexpected,
        )
        if result.state == RunState.COMPLETED:
            resumed = [i.resumed_from or 0 for i in result.interruptions]
            reports = step_reports(evidence)
            tally = sample_tally(reports, resumed, TARGET_STEP, GLOBAL_BATCH)
            verdict.samples_lost, verdict.samples_repeated, verdict.samples_out_of_order = tally
            if verdict.samples_lost:
                verdict.reports_missing = coverage(reports, resumed, TARGET_STEP)
            final = final_state(list(records.values()), TARGET_STEP)
            verdict.weights_equal = final.keys() == self.reference.keys() and all(
                final[name].equal(self.reference[name]) for name in final
            )
        verdict.unvalidated_resumes = unvalidated_resumes(run, result.interruptions, records)
        verdict.uncosted = uncosted(result.interruptions)
        return verdict

    async def reference_run(self) -> None:
        await self.settled()
        spec = soak_spec(self.root, "soak-reference", [])
        handle = await self.client.start_workflow(RunWorkflow.run, spec, id="soak-reference", task_queue=TASK_QUEUE)
        result = await self.result(handle)
        if result.state != RunState.COMPLETED or result.interruptions:
            raise RuntimeError(f"the fault-free reference run ended {result.state.value}: {result.failure}")
        self.reference = final_state(await handle.query(RunWorkflow.checkpoints), TARGET_STEP)

    async def poisoned_batch(self) -> tuple[bool, str]:
        """The same step failing in every generation: the run must stop for a person, with a page."""
        await self.settled()
        pages = self.root / "pages.jsonl"
        poison = [{"kind": "crash", "rank": 1, "at_step": 40, "generation": None}]
        spec = soak_spec(self.root, "soak-poisoned", poison, paging={"jsonl": str(pages)})
        handle = await self.client.start_workflow(RunWorkflow.run, spec, id="soak-poisoned", task_queue=TASK_QUEUE)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while (status := await status_of(handle)).state != RunState.STOPPED and not status.state.terminal:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        await handle.cancel()  # a stopped run waits for a person; this one has shown what it had to
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.result(), timeout=60)
        paged = [json.loads(line) for line in pages.read_text().splitlines()] if pages.exists() else []
        deterministic = [p for p in paged if p.get("paging") == PagingClass.DETERMINISTIC.value]
        last = status.interruptions[-1] if status.interruptions else None
        held = (
            status.state == RunState.STOPPED
            and len(status.interruptions) == 2
            and last is not None
            and last.paging is not None
            and last.paging.rule == "same step twice"
            and bool(deterministic)
        )
        return held, f"{status.state.value} after {len(status.interruptions)} crashes; {len(deterministic)} page(s)"


async def soak(args: argparse.Namespace, root: Path, console: Console) -> dict[str, Any]:
    cannot = usable()
    net = Partitionable.create(f"soak{os.getpid() % 10000}", index=40 + os.getpid() % 60) if cannot is None else None
    runs = plan(args.seed, args.faults, partitions=net is not None)
    stack = DevStack(
        state_dir=root / "stack",
        nodes=[*NODES, *SPARES],
        spares=SPARES,
        port=free_port(),
        ui_port=None,
        metrics_port=free_port(),
        workdir=REPO,
        ip=net.host_ip if net else "127.0.0.1",
        interface=net.host_if if net else None,
    )
    try:
        create_secret(stack.secret_file)
        stack.start_temporal()
        stack.start_supervisor()
        os.environ[SECRET_ENV] = str(stack.secret_file)
        client = await connect(plain(stack.address))
        faults = FaultDriver(stack, client, net, random.Random(args.seed))
        bench = Soak(stack, client, root, faults)
        for node in stack.nodes:
            faults.start_agent(node)
        await stack.ready()
        console.print(f"{sum(len(r.faults) for r in runs)} faults in {len(runs)} runs, seed {args.seed}")
        await bench.reference_run()
        verdicts = []
        for run in runs:
            verdict = await bench.run(run)
            verdicts.append(verdict)
            caught = sum(f.caught and f.blame_right for f in verdict.faults)
            console.print(
                f"run {run.index}: {verdict.state} at step {verdict.final_step} in {verdict.wall_s:.0f}s; "
                f"{caught} of {len(verdict.faults)} faults as planned: " + ", ".join(f.kind for f in run.faults)
            )
            for problem in problems(verdict):
                console.print(f"  [red]{problem}[/red]")
            for late in faults.late:
                console.print(f"  {late}")
            faults.late.clear()
        poisoned = await bench.poisoned_batch()
    finally:
        stack.stop()
        if net is not None:
            net.close()
    console.print(table(verdicts))
    return summary(verdicts, poisoned, partitions=cannot or "real network namespace")


def stop_once(signum: int, frame: object) -> None:
    """A stopped bench still takes its stack and namespace down: the first SIGTERM interrupts it,
    and more (`timeout` and a shell both passing it on) do not cut that cleanup short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="about ten faults (a few minutes on two cores)")
    parser.add_argument("--faults", type=int, default=None, help="how many faults to draw (default 110)")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--dir", type=Path, default=None, help="keep logs and checkpoints here")
    args = parser.parse_args()
    args.faults = args.faults or (10 if args.quick else 110)
    root = args.dir or Path(tempfile.mkdtemp(prefix="stayalive-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    console = Console() if sys.stdout.isatty() else Console(width=150)  # a log keeps the table whole
    signal.signal(signal.SIGTERM, stop_once)
    figures = asyncio.run(soak(args, root, console))
    console.print(f"logs and checkpoints: {root}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
