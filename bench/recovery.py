"""Recovery time after a crash: stayalive against `torchrun --max-restarts`, same job, same crash.

R is the time from the fault to the first step every rank has completed after the resume. Both sides
run the same job (the tiny GPT, 4 ranks, global batch 8, checkpoints every CHECKPOINT_EVERY steps)
with the same injected crash (core/run/faults.py: rank 3 exits with 137 in the middle of step
`--crash-step`, before its gradient all-reduce), and both resume from their newest checkpoint.

  stayalive  a headless dev stack (workers/devstack.py) on free ports in a temporary folder: nodes n1,
             n2 (2 ranks each) and n3 as the hot spare. R is the run timeline's restart_seconds:
             from the agent seeing the rank exit to the first step every rank reported after resume.
  torchrun   `python -m torch.distributed.run --nnodes 1 --nproc-per-node 4 --max-restarts 3` of
             bench/torchrun_worker.py (training.train, resuming from the newest checkpoint when
             restarted), with a c10d rendezvous and a fresh store per attempt: with the shared store it
             hangs in gloo connect on restart (pytorch#135712). R is from the crashing
             rank's "injected crash" log line, just before it exits, to the newest first-step time of
             the restarted ranks.

Every node agent forks its ranks from a warm fork server (agent/forkserver.py) unless
`--no-fork-server`; the table says how each restart's ranks started. The bar: stayalive's R is at
most a third of torchrun's.

    python -m bench.recovery [--quick] [--runs N] [--no-fork-server] [--crash-step S] [--breakdown]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table
from temporalio.client import Client

from bench.recovery_timeline import Milestones, restart_starts, stayalive_milestones
from stayalive.core.run.faults import Crash
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.temporal import connect, plain
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle
from stayalive.workflows.run import TASK_QUEUE, RunWorkflow

REPO = Path(__file__).resolve().parent.parent
TRAIN_ARGS = ["--preset", "tiny", "--global-batch", "8"]
WORLD_SIZE, RANKS_PER_NODE = 4, 2
CRASH_RANK = 3  # on n2: the spare n3 takes n2's place, n1's ranks restart where they are
CHECKPOINT_EVERY = 100
STEPS_AFTER_CRASH = 20  # the run ends soon after the step it crashed in
NODES, SPARE = ["n1", "n2"], "n3"
RACKS = {"n1": "rack-a", "n2": "rack-a", "n3": "rack-b"}
RUN_TIMEOUT_S = 600.0
# The crashing rank's last log line (logfmt, training/logs.py), written just before os._exit.
INJECTED_CRASH = re.compile(r'timestamp=(\S+) level=warning event="injected crash"')


@dataclass
class Trial:
    r_s: float
    started: str  # how the restarted ranks started: forked from the warm server, or cold
    milestones: Milestones | None = None


def crash(step: int) -> Crash:
    return Crash(rank=CRASH_RANK, at_step=step)


# ── stayalive ─────────────────────────────────────────────────────────────────────────────────────────


def job_spec(checkpoint_root: Path, crash_step: int, name: str) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": name,
            "world_size": WORLD_SIZE,
            "ranks_per_node": RANKS_PER_NODE,
            "nodes": NODES,
            "spare_nodes": [SPARE],
            "min_nodes": len(NODES),
            "entrypoint": ["python", "-m", "stayalive.training.train", *TRAIN_ARGS],
            "target_step": crash_step + STEPS_AFTER_CRASH,
            "checkpoint": {"root": str(checkpoint_root), "interval": f"{CHECKPOINT_EVERY} steps"},
            "faults": [crash(crash_step).model_dump()],
        }
    )


async def fleet_idle(client: Client, nodes: list[str], timeout: float = 180.0) -> None:
    """Every node registered, usable and in no run: the last trial's quarantined node passed its self-test."""
    fleet = fleet_handle(client)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            known = {n.id: n for n in await fleet.query(FleetWorkflow.nodes)}
            if all(n in known and known[n].state.usable and known[n].run_id is None for n in nodes):
                return
        except Exception:  # the fleet workflow starts with the first agent's registration
            pass
        await asyncio.sleep(0.3)
    raise TimeoutError(f"the fleet did not settle in {timeout:g}s")


async def stayalive_trials(runs: int, crash_step: int, fork_server: bool, root: Path) -> list[Trial]:
    stack = DevStack(
        state_dir=root / "stack",
        nodes=[*NODES, SPARE],
        spares=[SPARE],
        racks=RACKS,
        port=free_port(),
        ui_port=None,
        workdir=REPO,
        fork_server=fork_server,
    )
    stack.start()
    try:
        await stack.ready()
        client = await connect(plain(stack.address))
        trials = []
        for i in range(runs):
            await fleet_idle(client, stack.nodes)
            spec = job_spec(root / "checkpoints", crash_step, f"recovery-{i}")
            handle = await client.start_workflow(RunWorkflow.run, spec, id=spec.name, task_queue=TASK_QUEUE)
            result = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
            if result.state != RunState.COMPLETED or len(result.interruptions) != 1:
                raise RuntimeError(f"{spec.name}: {result.state} with {len(result.interruptions)} interruptions")
            interruption = result.interruptions[0]
            assert interruption.restart_seconds is not None
            milestones = await stayalive_milestones(client, handle, result.run_id, stack.state_dir)
            trials.append(Trial(interruption.restart_seconds, restart_starts(milestones), milestones))
        return trials
    finally:
        stack.stop()


# ── torchrun ──────────────────────────────────────────────────────────────────────────────────────────


def torchrun_trial(crash_step: int, root: Path, i: int) -> Trial:
    events = root / f"torchrun-{i}.events"
    env = os.environ | {
        "STAYALIVE_RUN_ID": f"bench-torchrun/{i:08x}",
        "STAYALIVE_TARGET_STEP": str(crash_step + STEPS_AFTER_CRASH),
        "STAYALIVE_CHECKPOINT_DIR": str(root / f"torchrun-{i}"),
        "STAYALIVE_CHECKPOINT_EVERY_STEPS": str(CHECKPOINT_EVERY),
        "STAYALIVE_FAULTS": f"[{crash(crash_step).model_dump_json()}]",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # a fresh store per attempt: restarts do not hang
        "BENCH_EVENTS": str(events),
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORLD_SIZE)]
    argv += ["--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    argv += ["--local-addr", "127.0.0.1", "-m", "bench.torchrun_worker", *TRAIN_ARGS]
    with open(root / f"torchrun-{i}.log", "wb") as log:
        done = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited {done.returncode}; see {root / f'torchrun-{i}.log'}")
    crashed = INJECTED_CRASH.search((root / f"torchrun-{i}.log").read_text(errors="replace"))
    if crashed is None:
        raise RuntimeError(f"torchrun: no injected crash in {root / f'torchrun-{i}.log'}")
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    restarted = [e for e in lines if e["event"] == "step" and e["restart"] == 1]
    if len(restarted) != WORLD_SIZE:
        raise RuntimeError(f"torchrun: {len(restarted)} of {WORLD_SIZE} ranks stepped after the restart")
    crashed_at = datetime.fromisoformat(crashed.group(1)).timestamp()
    return Trial(max(e["at"] for e in restarted) - crashed_at, f"{WORLD_SIZE} cold processes")


# ── report ────────────────────────────────────────────────────────────────────────────────────────────


def table(results: dict[str, list[Trial]]) -> Table:
    out = Table(title="Recovery time R: crash → first step every rank completed after resume")
    for column in ("method", "runs", "R median s", "R each s", "restarted ranks"):
        out.add_column(column, justify="left" if column in ("method", "restarted ranks") else "right")
    for method, trials in results.items():
        each = ", ".join(f"{t.r_s:.2f}" for t in trials)
        starts = "; ".join(sorted({t.started for t in trials}))
        out.add_row(method, str(len(trials)), f"{statistics.median(t.r_s for t in trials):.2f}", each, starts)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one repetition each (1-2 minutes on two cores)")
    parser.add_argument("--runs", type=int, default=3, help="repetitions per method (default 3)")
    parser.add_argument(
        "--fork-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="node agents fork ranks from a warm server (default); --no-fork-server starts each cold",
    )
    parser.add_argument("--crash-step", type=int, default=None, help="step whose middle the crash interrupts")
    parser.add_argument("--breakdown", action="store_true", help="print where stayalive's recovery time went")
    parser.add_argument("--dir", type=Path, default=None, help="keep logs and checkpoints here")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    # Well after the first launch, and mid-interval, so the validator is idle when the crash comes.
    crash_step = args.crash_step or (950 if args.quick else 1350)
    root = args.dir or Path(tempfile.mkdtemp(prefix="stayalive-recovery-"))
    root.mkdir(parents=True, exist_ok=True)
    console = Console()
    starts = "forked from a warm server" if args.fork_server else "cold"
    console.print(f"crash of rank {CRASH_RANK} at step {crash_step}; {runs} run(s) each; ranks start {starts}")

    stayalive = asyncio.run(stayalive_trials(runs, crash_step, args.fork_server, root))
    torchrun = [torchrun_trial(crash_step, root, i) for i in range(runs)]
    console.print(table({"stayalive": stayalive, "torchrun --max-restarts": torchrun}))
    if args.breakdown:
        for i, trial in enumerate(stayalive):
            if trial.milestones is not None:
                console.print(f"stayalive run {i}: where R = {trial.r_s:.2f}s went")
                console.print(trial.milestones.table())
    console.print(f"logs and checkpoints: {root}")
    r_stayalive = statistics.median(t.r_s for t in stayalive)
    r_torchrun = statistics.median(t.r_s for t in torchrun)
    ratio = r_stayalive / r_torchrun
    summary = {
        "bench": "recovery",
        "stayalive_r_s": round(r_stayalive, 3),
        "torchrun_r_s": round(r_torchrun, 3),
        "ratio": round(ratio, 3),
        "bar": ratio <= 1 / 3,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
