"""One prepared device check of stayalive's GPU paths: what a machine with NVIDIA GPUs runs as one
command, and what runs of it on a machine without one.

    nvml        every GPU's reading through NVML (agent/gpu.py), and what the node agent's watch costs:
                the CPU seconds of one reading of every GPU, and the share of one core that the
                agent's rate (two readings a second) takes. Without NVML, the simulated source's.
    self_test   the node self-test as a quarantined node runs it (agent/selftest.py): each check,
                whether it passed, its seconds (on every GPU; on the CPU without one).
    checkpoint  the built-in trainer (its GPT `small`) on the GPU (the CPU without one), each step
                through `stayalive.Run` (its vote, SDC checks and reports on the rank's device, NCCL
                the default group), with a forced checkpoint after a step, its blocking milliseconds
                (the state dicts made, and the next update's wait for the device → pinned host copy),
                against `torch.save` and DCP's `async_save` of the same state in the same run;
                medians of the saves after the first. One rank, under torchrun, reporting to an
                agent that reads and drops its lines.
    nccl_hang_aborted
                (two GPUs or more) two NCCL ranks, one of them never entering an all-reduce: the
                seconds from the agent's SIGTERM to the blocked rank's exit, its communicators
                aborted first.
    nccl_two_ranks
                (two GPUs or more) the built-in trainer's step on two NCCL ranks, one GPU each: its
                devices, its losses, and whether the replicas agree after the all-reduce.

    rank_killed (not on one GPU) the built-in trainer under a headless dev stack (Temporal dev server,
                supervisor, node agents n1, n2 and the spare n3), one rank a node, NCCL on a GPU
                each (gloo on the CPU), n2's rank killed at step 35: the run's end, and where the
                restarted ranks resumed from (the host-memory tier), at which step, how fast.

Bar: the self-test passed, every reading came back, a checkpoint through the API blocked for less
than `async_save`, the killed run completed from host memory, and where two GPUs ran them, the hung
rank aborted and left within 10 s and the two ranks' replicas agreed.

    python -m bench.gpu [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import stayalive
from bench.recovery import fleet_idle
from bench.supervision import serve_sink
from harness.hung_rank import stop_blocked_rank
from stayalive.agent.gpu import NvmlTelemetry, SimulatedTelemetry, gpu_telemetry
from stayalive.agent.selftest import SelfTest
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.spec import RunSpec
from stayalive.core.run.status import RunResult
from stayalive.training.train import Trainer, parse_args
from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.temporal import connect, plain
from stayalive.workflows.run import TASK_QUEUE, RunWorkflow

AGENT_EVERY_S = 0.5  # the node agent's GPU watch (agent/node.py sample_gpus)
KILLED_AT_STEP, KILLED_RUN_STEPS = 35, 60  # the killed rank's step: after checkpoints at 10, 20 and 30


def nvml(reads: int) -> dict[str, Any]:
    """Every GPU's reading, and the CPU a reading of all of them takes."""
    telemetry = gpu_telemetry(socket.gethostname(), "bench")
    source = "nvml" if isinstance(telemetry, NvmlTelemetry) else "simulated"
    readings = telemetry.read()
    started = time.process_time()
    for _ in range(reads):
        telemetry.read()
    per_read = (time.process_time() - started) / reads
    if isinstance(telemetry, NvmlTelemetry):
        telemetry.close()
    return {
        "source": source,
        "readings": [r.model_dump(mode="json", exclude_none=True) for r in readings] if source == "nvml" else [],
        "gpus_read": len(readings),
        "cpu_ms_per_read": round(per_read * 1e3, 3),
        "agent_core_share": round(per_read / AGENT_EVERY_S, 5),
    }


def self_test() -> dict[str, Any]:
    """The self-test's checks, each with its seconds (from one check's start to the next's)."""
    telemetry = gpu_telemetry(socket.gethostname(), "bench")
    gpus = telemetry.read if not isinstance(telemetry, SimulatedTelemetry) else None
    test = SelfTest(socket.gethostname(), gpus=gpus)
    starts: list[tuple[str, float]] = []
    result = asyncio.run(test.run(lambda name: starts.append((name, time.perf_counter()))))
    ended = time.perf_counter()
    ends = [at for _, at in starts[1:]] + [ended]
    seconds = {name: round(end - at, 3) for (name, at), end in zip(starts, ends, strict=True)}
    return {
        "devices": [str(d) for d in test.devices],
        "passed": result.passed,
        "checks": {name: {"passed": result.checks[name], "s": seconds[name]} for name in result.checks},
        "detail": result.detail,
    }


def checkpoint_blocking(saves: int, steps: int, directory: Path) -> dict[str, Any]:
    """Median milliseconds a save blocked the loop, after the first, for each way of saving."""
    device = stayalive.init_process_group()  # cuda:LOCAL_RANK under NCCL (the launch's choice on a GPU host)
    trainer = Trainer.from_args(parse_args(["--preset", "small", "--global-batch", "16"]), device)
    model, optimizer = trainer.model, trainer.optimizer
    run = stayalive.Run(model, optimizer, rejoin_in_place=True)
    plain = dist.new_group(backend="gloo")  # DCP's own coordination, apart from the loop's group

    def train() -> None:  # one step of the built-in trainer's loop, through the run
        trainer.step(run, run.begin_step())
        run.end_step()

    def settled() -> float:  # the device idle before a save is timed: no earlier kernel in its time
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    directory.mkdir(parents=True, exist_ok=True)
    for _ in range(steps):
        train()
    blocking: dict[str, list[float]] = {"api": [], "torch_save": [], "dcp_async_save": []}
    for i in range(saves):
        train()
        settled()
        run.checkpoint()
        train()  # its update waits for whatever of the copy is left
        blocking["api"].append(run.checkpointer.blocking_s)
        run.checkpointer.wait()
        train()
        started = settled()
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, directory / f"save-{i}.pt")
        blocking["torch_save"].append(time.perf_counter() - started)
        train()
        started = settled()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        pending = dcp.async_save(state, checkpoint_id=directory / f"a-{i}", process_group=plain)
        blocking["dcp_async_save"].append(time.perf_counter() - started)
        pending.result()  # type: ignore[union-attr]
    run.checkpointer.wait()
    figures = {f"{name}_ms": round(statistics.median(seconds[1:]) * 1e3, 3) for name, seconds in blocking.items()}
    return {"device": str(device), "state_mb": round(_bytes(model, optimizer) / 1e6, 1), **figures}


def _bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.state_dict().values()]
    tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def rank_main(quick: bool, out: Path) -> None:
    figures = checkpoint_blocking(saves=5 if quick else 10, steps=5 if quick else 20, directory=out.parent / "plain")
    out.write_text(json.dumps(figures))
    dist.destroy_process_group()
    os._exit(0)  # the checkpoint writer's groups need no teardown: everything is on disk


def hang_aborted(port: int) -> dict[str, Any]:
    """Two NCCL ranks, one hung: the seconds from the agent's SIGTERM to the blocked rank's exit (its
    communicators aborted first, training/rank_process.py)."""
    stopped = stop_blocked_rank("nccl", port, settle_s=2.0)  # its kernel spinning by then
    if not stopped.blocked:
        return {"passed": False, "detail": stopped.output}
    passed = stopped.aborted and stopped.exit_code == 128 + signal.SIGTERM
    return {"passed": passed, "seconds_to_exit": round(stopped.seconds, 3), "exit": stopped.exit_code}


def two_nccl_ranks(work: Path) -> dict[str, Any]:
    """The built-in trainer's step on two NCCL ranks, one GPU each (harness/device_loop.py): where each
    rank computed, its losses, and whether the replicas agree after the all-reduce."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAYALIVE_")} | {"STAYALIVE_BACKEND": "nccl"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "harness/device_loop.py"]
    started = time.perf_counter()
    subprocess.run([*argv, "--out", str(work)], env=env, check=True, timeout=300)
    ranks = [json.loads((work / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    return {
        "passed": len({r["weights"] for r in ranks}) == 1 and all(r["losses"][-1] < r["losses"][0] for r in ranks),
        "devices": [r["device"] for r in ranks],
        "losses": [r["losses"] for r in ranks],
        "seconds": round(time.perf_counter() - started, 1),
    }


def rank_killed(work: Path, gpus: int) -> dict[str, Any]:
    """The built-in trainer under a headless dev stack (Temporal dev server, supervisor, node agents n1,
    n2 and the spare n3), one rank a node, n2's killed mid-run: where the restarted ranks resumed from
    (n2's shard has its replica on n1) and how long the restart took. NCCL on CUDA, n1 on GPU 0, n2
    and then n3 on GPU 1; gloo on the CPU without one."""
    spec = RunSpec.model_validate(
        {
            "name": "bench-gpu-killed",
            "world_size": 2,
            "ranks_per_node": 1,
            "nodes": ["n1", "n2"],
            "spare_nodes": ["n3"],
            "min_nodes": 2,
            "backend": "nccl" if gpus else "gloo",
            "entrypoint": ["python", "-m", "stayalive.training.train", "--preset", "tiny", "--global-batch", "8"],
            "target_step": KILLED_RUN_STEPS,
            "checkpoint": {"root": str(work / "checkpoints"), "interval": "10 steps"},
            "faults": [{"kind": "crash", "rank": 1, "at_step": KILLED_AT_STEP}],
        }
    )
    stack = DevStack(
        state_dir=work / "stack",
        nodes=["n1", "n2", "n3"],
        spares=["n3"],
        port=free_port(),
        ui_port=None,
        gpus={"n1": "0", "n2": "1", "n3": "1"} if gpus else {},
    )
    stack.start()
    try:
        result = asyncio.run(_run_to_the_end(stack, spec))
    finally:
        stack.stop()
    crash = result.interruptions[0] if result.interruptions else None
    resumed = crash.restored_from if crash is not None else None
    return {
        "passed": result.state == RunState.COMPLETED and resumed == "memory" and len(result.interruptions) == 1,
        "backend": spec.backend,
        "state": result.state.value,
        "final_step": result.final_step,
        "restored_from": resumed,
        "resumed_at_step": crash.resumed_from if crash is not None else None,
        "restart_s": round(crash.restart_seconds, 2)
        if crash is not None and crash.restart_seconds is not None
        else None,
    }


async def _run_to_the_end(stack: DevStack, spec: RunSpec) -> RunResult:
    await stack.ready()
    client = await connect(plain(stack.address))
    await fleet_idle(client, stack.nodes)
    handle = await client.start_workflow(RunWorkflow.run, spec, id=spec.name, task_queue=TASK_QUEUE)
    return await asyncio.wait_for(handle.result(), timeout=300)


def launch_checkpoint(quick: bool, work: Path) -> dict[str, Any]:
    out = work / "figures.json"
    env = os.environ | {
        "STAYALIVE_RUN_ID": "bench-gpu/00000000",
        "STAYALIVE_AGENT": serve_sink(every_s=0.1),
        "STAYALIVE_TARGET_STEP": "1000000",
        "STAYALIVE_CHECKPOINT_DIR": str(work / "checkpoints"),
        "STAYALIVE_CHECKPOINT_EVERY_STEPS": "1000000",  # only the forced saves
        "STAYALIVE_BACKEND": "nccl" if torch.cuda.is_available() else "gloo",
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "bench.gpu", "--rank"]
    subprocess.run([*argv, *(["--quick"] if quick else []), "--out", str(out)], env=env, check=True)
    return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer readings and saves: about a minute")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.quick, args.out)
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    readings = nvml(reads=10 if args.quick else 120)
    test = self_test()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as work:
        checkpoint = launch_checkpoint(args.quick, Path(work))
    print(f"GPUs: {gpus}; telemetry: {readings['source']}, {readings['cpu_ms_per_read']} ms of CPU a reading")
    print(f"self-test on {', '.join(test['devices'])}: {'passed' if test['passed'] else 'FAILED'}: {test['detail']}")
    print(
        f"checkpoint of {checkpoint['state_mb']} MB on {checkpoint['device']}: API {checkpoint['api_ms']} ms, "
        f"torch.save {checkpoint['torch_save_ms']} ms, dcp.async_save {checkpoint['dcp_async_save_ms']} ms"
    )
    skipped: dict[str, str] = {}
    killed: dict[str, Any] | None = None
    if gpus == 1:
        skipped["rank_killed"] = "1 GPU: the killed rank's replica sits on another node, a GPU of its own"
    else:
        with tempfile.TemporaryDirectory(prefix="bench-gpu-") as work:
            killed = rank_killed(Path(work), gpus)
        print(
            f"two {killed['backend']} ranks, n2's killed at step {KILLED_AT_STEP}: {killed['state']}, resumed "
            f"from {killed['restored_from']} at step {killed['resumed_at_step']} in {killed['restart_s']} s"
        )
    hang: dict[str, Any] | None = None
    two: dict[str, Any] | None = None
    if gpus >= 2:
        hang = hang_aborted(port=29517)
        print(f"an NCCL hang: the blocked rank exited {hang.get('seconds_to_exit')} s after SIGTERM")
        with tempfile.TemporaryDirectory(prefix="bench-gpu-") as work:
            two = two_nccl_ranks(Path(work))
        print(f"two NCCL ranks on {two['devices']}: replicas {'agree' if two['passed'] else 'DIFFER'}")
    else:
        why = f"{gpus} GPUs: two NCCL ranks need two"
        skipped |= {"nccl_hang_aborted": why, "nccl_two_ranks": why}
    every_gpu_read = readings["source"] != "nvml" or readings["gpus_read"] == gpus
    hang_ended = hang is None or (hang["passed"] and hang["seconds_to_exit"] < 10)
    two_agree = two is None or two["passed"]
    bar = (
        test["passed"]
        and every_gpu_read
        and hang_ended
        and two_agree
        and (killed is None or killed["passed"])
        and checkpoint["api_ms"] < checkpoint["dcp_async_save_ms"]
    )
    figures = {
        "bench": "gpu",
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nvml": readings,
        "self_test": test,
        "checkpoint": checkpoint,
        **({"rank_killed": killed} if killed is not None else {}),
        **({"nccl_hang_aborted": hang} if hang is not None else {}),
        **({"nccl_two_ranks": two} if two is not None else {}),
        "skipped": skipped,
        "bar": bool(bar),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
