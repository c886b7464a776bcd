"""What supervision costs a training step: the hooks on against the same step without them.

The hooks are what a supervised rank does beyond a plain data-parallel step: the control vote (how
many commands of each kind the rank has received, in a few extra slots of the gradient all-reduce,
so every rank acts on a command at the same step), a step report to its node agent (serialized and
sent by a writer thread; the agent here is a TCP sink in this process), and the flag slots the SDC
checks would use. Both variants run in the same ranks, interleaved (bench/interleaved.py) in blocks
of 10 steps, in the order plain, supervised, supervised, plain, so that a drift across a cycle
cancels:

    plain       forward, backward, gradient all-reduce, optimizer step: a torchrun script's step
    supervised  training/train.py's step through `stayalive.Run`, SDC checks off: the same step, plus
                the hooks

Neither checkpoints (bench.checkpoint and bench.api measure that). The bar (issue 5): the hooks
cost under 1% of a step, shown met when the whole 95% interval is under it.

    python -m bench.supervision [--quick]
"""

from __future__ import annotations

import os
import socket
import threading
import time
from itertools import islice
from multiprocessing.queues import Queue
from typing import cast

import torch.distributed as dist

from bench.interleaved import (
    DEVICE_MS,
    WORLD_SIZE,
    Block,
    counted_cycles,
    cycles,
    measure,
    median_step_s,
    overhead,
    report,
    supervised,
    timed_block,
)
from stayalive.core.protocol.access import Challenge
from stayalive.core.run.spec import SdcSpec
from stayalive.training.sdc import flat_grads, set_grads
from stayalive.training.train import Trainer

BAR = 0.01
BLOCK_STEPS = 10  # the host's noise is white over about this many steps (bench/interleaved.py)
PLAN = ("plain", "supervised", "supervised", "plain")
SINK = "STAYALIVE_BENCH_SINK"  # where ranks send their reports: host:port of the sink


def plain_block(trainer: Trainer, rank: int, first: int, steps: int) -> None:
    """A torchrun script's step: forward, backward, one flat gradient all-reduce, the update."""
    model, optimizer, stream = trainer.model, trainer.optimizer, trainer.stream
    params = list(model.parameters())
    for step in range(first, first + steps):
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = stream.batch(stream.positions(step, rank, WORLD_SIZE))
        (model(inputs, targets).sum() / stream.global_batch).backward()
        time.sleep(DEVICE_MS / 1000)
        flat = flat_grads(params)
        dist.all_reduce(flat)
        set_grads(params, flat)
        optimizer.step()


def blocks(rank: int, trainer: Trainer, count: int, directory: str, results: Queue[Block]) -> None:
    """Both variants train the same model: the plain blocks outside the run (the SDC checks' hook
    passes over an update the run did not open), the supervised ones through it."""
    env = {"STAYALIVE_AGENT": os.environ[SINK], "STAYALIVE_SDC": SdcSpec(enabled=False).model_dump_json()}
    run = supervised(trainer, directory, env)  # the sink checks no proof
    steps = run.steps()  # a step's bookkeeping runs when the next is asked for
    for cycle in range(count):
        for name in PLAN:
            with timed_block(rank, cycle, name, results):
                if name == "plain":
                    plain_block(trainer, rank, 10**6 + cycle * BLOCK_STEPS, BLOCK_STEPS)
                else:
                    for step in islice(steps, BLOCK_STEPS):
                        trainer.step(run, step)


def serve_sink(every_s: float = 0.0) -> str:
    """A node agent's receiving end, reduced to reading and dropping every line; `every_s`: what has
    arrived, at most that often (an agent on a core of its own, whose reading takes none of the ranks')."""
    server = socket.create_server(("127.0.0.1", 0))

    def drain(connection: socket.socket) -> None:
        with connection:
            connection.sendall(Challenge(nonce="0").model_dump_json().encode() + b"\n")  # as a hub opens
            while connection.recv(1 << 20):
                if every_s:
                    time.sleep(every_s)

    def accept() -> None:
        while True:
            connection, _ = server.accept()
            threading.Thread(target=drain, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}"


def summary(timed: list[Block]) -> dict[str, object]:
    hooks = overhead(timed, "supervised", "plain")
    return {
        "bench": "supervision",
        "world_size": WORLD_SIZE,
        "device_ms": DEVICE_MS,
        "block_steps": BLOCK_STEPS,
        "cycles": len(counted_cycles(timed)),
        "step_ms_plain": round(median_step_s(timed, "plain", BLOCK_STEPS) * 1000, 2),
        "step_ms_supervised": round(median_step_s(timed, "supervised", BLOCK_STEPS) * 1000, 2),
        "hooks_overhead": round(hooks.point, 4),
        "hooks_overhead_ci95": hooks.interval(),
        "bar": hooks.high < BAR,  # shown met only when the whole interval is under it
    }


def main() -> None:
    count = cycles(__doc__, quick=30, full=400)
    os.environ[SINK] = serve_sink()
    result = summary(measure(blocks, count, len(PLAN)))
    rows = [
        ("step time, plain", f"{result['step_ms_plain']} ms"),
        ("step time, supervised", f"{result['step_ms_supervised']} ms"),
        ("hooks", f"{result['hooks_overhead']:+.2%}"),
        ("  95% interval", "{:+.2%} … {:+.2%}".format(*cast(list[float], result["hooks_overhead_ci95"]))),
    ]
    report("Supervision hooks against the same step without them", rows, result)


if __name__ == "__main__":
    main()
