"""Train the small GPT under stayalive: `python -m stayalive.training.train --preset small`.

Data parallel with one explicit gradient all-reduce per step. DistributedDataParallel overlaps its
bucketed all-reduces with backward, which hides where a rank's compute ends (the straggler signal,
DESIGN §5) and re-buckets after the first step (changing the summation layout, so a resumed run
would not be bitwise equal to an uninterrupted one). One flat all-reduce has neither problem.

A process may live through several generations: when told to hold, it checkpoints, waits, and
joins the next generation's group in place (training/elastic.py).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from datetime import timedelta
from enum import Enum

import structlog
import torch
import torch.distributed as dist
from pydantic import BaseModel

from stayalive.core.escalation import rebalance
from stayalive.core.hangs import Site
from stayalive.core.launch import EXIT_CHECKPOINT_UNUSABLE, EXIT_SDC
from stayalive.core.telemetry import CheckpointCommitted, Finished, Held, Hello, Resumed, StepReport, StorageUnavailable
from stayalive.training import collectives, memory, rank_process
from stayalive.training.channel import AgentChannel
from stayalive.training.checkpoint import CheckpointError, Manifest, within_root
from stayalive.training.checkpointer import Checkpointer, Identity
from stayalive.training.corpus import Corpus, SampleStream, generate_text
from stayalive.training.elastic import state_from_rank0
from stayalive.training.faults import FaultInjector
from stayalive.training.gpt import GPT, PRESETS, GPTConfig
from stayalive.training.logs import configure_logging
from stayalive.training.memory import MemoryTier
from stayalive.training.restore import restore
from stayalive.training.sdc import FLAGS, SdcGuard, flat_grads, set_grads
from stayalive.training.state import TrainState, restore_rng
from stayalive.training.supervision import VOTES, Supervision, SupervisionConfig

log = structlog.get_logger()


class Outcome(Enum):
    DONE = "done"  # reached the target step, or told to stop
    HELD = "held"  # checkpointed at an agreed step and waiting for the next generation
    HALTED = "halted"  # an SDC check failed: the state is suspect, the workflow rolls the run back


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stayalive.training.train", description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--global-batch", type=int, default=16, help="samples per step, across all ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--collective-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="accelerator time to add to every step on a CPU-only machine: it makes compute times as steady as a "
        "GPU's, which the straggler detectors are tuned for (ranks sharing two cores jitter by tens of percent)",
    )
    return parser.parse_args(argv)


def train(
    state: TrainState,
    stream: SampleStream,
    supervision: Supervision,
    checkpointer: Checkpointer,
    faults: FaultInjector,
    guard: SdcGuard,
    device_s: float = 0.0,
) -> Outcome:
    rank, world_size, generation = supervision.rank, supervision.world_size, supervision.config.generation
    params = list(state.model.parameters())
    split: list[int] | None = None  # samples per rank once rebalanced (escalation S2); None: even

    def backward(step: int, of_rank: int, *, replay: bool) -> torch.Tensor:
        """Forward and backward of `of_rank`'s micro-batch of `step` into fresh gradients; returns
        this rank's share of the loss. Replays (the SDC checks) see no injected fault. Each sample's
        loss is divided by the global batch, whoever computes it, so the summed gradient is the
        global mean however the batch is split."""
        state.optimizer.zero_grad(set_to_none=True)
        positions = stream.positions(step, of_rank, world_size, split)
        inputs, targets = stream.batch(positions)
        loss = state.model(inputs, targets).sum() / stream.global_batch
        loss.backward()
        if device_s:  # an accelerator's time grows with the samples it computes
            time.sleep(device_s * len(positions) * world_size / stream.global_batch)
        if not replay:
            faults.after_backward(step, [p.grad for p in params if p.grad is not None])
        return loss.detach()

    guard.calibrate(params, lambda r: backward(state.step + 1, r, replay=True))
    for step in range(state.step + 1, supervision.config.target_step + 1):
        structlog.contextvars.bind_contextvars(step=step)
        collectives.at_step(step)
        started = time.perf_counter()
        loss = backward(step, rank, replay=False)
        checks = guard.checks(step, params, functools.partial(backward, step, replay=True))
        faults.before_collective(step, time.perf_counter() - started)
        compute_s = time.perf_counter() - started
        # One flat all-reduce (SUM: each rank's loss is already its share of the global mean) that
        # also carries the SDC flags and the control vote, so agreeing on them costs no collective.
        flat = flat_grads(params, guard.flags(loss, checks), supervision.votes())
        collectives.all_reduce(flat, Site.GRADIENTS)
        reduced, flags, votes = flat.split([flat.numel() - FLAGS - VOTES, FLAGS, VOTES])
        faults.before_update(step, params)
        if guard.replicas_due(step):
            fingerprints, _ = guard.gather([*params, reduced])
            checks.append(guard.replicas(step, fingerprints))
        verdict = guard.judge(step, loss, params, flags, reduced, checks)  # params: still this rank's gradients
        set_grads(params, reduced)
        if verdict.apply:
            state.optimizer.step()
        state.last_verified = guard.last_verified
        if verdict.skipped:
            log.warning("update skipped", why=verdict.skipped)
        for report in verdict.reports:
            supervision.report(report)
        if verdict.failed is not None:
            log.error("silent data corruption", culprit=verdict.failed.culprit, detail=verdict.failed.detail)
            return Outcome.HALTED
        state.step = step
        decision = supervision.decide(step, votes)
        positions = stream.positions(step, rank, world_size, split)
        share = loss.item() * stream.global_batch / len(positions)  # the mean loss of this rank's samples
        supervision.report(
            StepReport(
                rank=rank,
                generation=generation,
                step=step,
                compute_s=compute_s,
                step_s=time.perf_counter() - started,
                loss=share if math.isfinite(share) else None,
                samples=positions,
                at=time.time(),
            )
        )
        if decision.speeds is not None:
            split = rebalance(decision.speeds, stream.global_batch)
            log.info("rebalanced", split=split, speeds=[round(s, 3) for s in decision.speeds])
        if decision.checkpoint:
            checkpointer.save(state)
        if decision.hold:
            return Outcome.HELD
        if decision.stop:
            log.info("stopping on command")
            break
    return Outcome.DONE


class Trainer:
    """One rank's process: the model and data built once, then one generation after another."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        torch.set_num_threads(args.threads)
        corpus = Corpus(generate_text(args.seed))
        self.gpt_config = GPTConfig(vocab_size=corpus.vocab_size, **PRESETS[args.preset])
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = GPT(self.gpt_config)
        self.state = TrainState(model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0))
        self.stream = SampleStream(corpus, self.gpt_config.block_size, args.global_batch, args.seed)
        self.channel: AgentChannel | None = None
        self.durable: str | None = None  # the newest checkpoint known whole on storage (host memory keeps it)
        rank_process.watch_from_outside()

    def report(self, message: BaseModel) -> None:
        if self.channel is not None:
            self.channel.send(message)

    def run(self) -> None:
        while self.generation():
            pass
        if self.channel is not None:
            self.channel.close()

    def generation(self) -> bool:
        """Train one generation; True if this process goes on into the next one."""
        config = SupervisionConfig.from_env()
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        configure_logging(run_id=config.run_id, node=os.environ.get("STAYALIVE_NODE", "-"), rank=rank)
        if self.args.global_batch < world_size:
            raise SystemExit(f"--global-batch {self.args.global_batch} is smaller than the world size {world_size}")
        hello = Hello(run_id=config.run_id, rank=rank, generation=config.generation, pid=os.getpid())
        if self.channel is None and config.agent:
            self.channel = AgentChannel(config.agent, hello, config.run_token)
        else:
            self.report(hello)  # the agent files this connection under the new rank and generation
        store, tier = self.join(config, rank, world_size)
        supervision = Supervision(config, rank, world_size, self.channel)
        self.load(config, rank, world_size, tier)
        faults = FaultInjector(config.faults, rank, config.generation, world_size)
        faults.attach(self.state.model)
        checkpointer = self.checkpointer(config, rank, world_size, store, tier, faults)
        guard = SdcGuard(config.sdc, rank, world_size, config.generation, self.state.last_verified)
        outcome = train(self.state, self.stream, supervision, checkpointer, faults, guard, self.args.device_ms / 1000)
        if outcome is Outcome.DONE:  # said before the final checkpoint lands: waiting for storage is no hang
            self.report(Finished(rank=rank, generation=config.generation, step=self.state.step))
        checkpointer.wait()
        self.durable = checkpointer.durable()
        faults.detach()
        if outcome is Outcome.HALTED:  # the state is suspect: nothing of it may go on; wait to be stopped
            supervision.await_rejoin()
            sys.exit(EXIT_SDC)
        if outcome is Outcome.DONE:
            dist.destroy_process_group()
            return False
        self.report(Held(rank=rank, generation=config.generation, step=self.state.step))
        rejoin = supervision.await_rejoin()
        dist.destroy_process_group()  # nothing is pending: every rank stopped after the same step
        if rejoin is None:
            log.info("leaving the group", step=self.state.step)
            return False
        os.environ.update(rejoin.env)
        return True

    def join(self, config: SupervisionConfig, rank: int, world_size: int) -> tuple[dist.Store, MemoryTier | None]:
        """Join the generation's group, through its rendezvous store (fresh every generation), and find
        this rank's memory tier. Each node's local rank 0 names its agent in the store before joining,
        so once every rank has joined, the lookup of the replica's agent finds it."""
        # Who hosts the store is decided as torch's env:// rendezvous decides it: the agent when it says
        # so (stayalive's always does; torchrun's c10d rendezvous does not), else rank 0.
        hosting = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(address, port, is_master=hosting, wait_for_workers=False)
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        local_rank = int(os.environ.get("LOCAL_RANK", rank % ranks_per_node))
        if config.agent is not None and local_rank == 0:
            memory.publish_hub(store, rank // ranks_per_node, config.agent)
        timeout = timedelta(seconds=self.args.collective_timeout)
        collectives.begin(config.generation)
        dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        return store, config.memory_tier(store, rank, world_size, ranks_per_node)

    def load(self, config: SupervisionConfig, rank: int, world_size: int, tier: MemoryTier | None) -> None:
        """Where a generation's state comes from: rank 0's live state, a checkpoint, or (first launch) nothing."""
        if config.state_from_rank0:
            state_from_rank0(self.state, rank)
            return
        if config.resume_from is None or self.state.step > 0:
            return
        try:
            directory = within_root(config.checkpoint_dir, config.resume_from)
            restored = restore(directory, config.run_id, rank, world_size, tier)
        except CheckpointError as exc:
            log.error("cannot resume", checkpoint=str(config.resume_from), error=str(exc))
            sys.exit(EXIT_CHECKPOINT_UNUSABLE)
        self.state.restore(restored.manifest, restored.tensors)
        restore_rng(restored.manifest, restored.tensors, rank)
        self.durable = directory.name  # validated, so whole on storage
        self.report(
            Resumed(
                rank=rank,
                generation=config.generation,
                step=self.state.step,
                source=restored.source,
                seconds=restored.seconds,
            )
        )

    def checkpointer(
        self,
        config: SupervisionConfig,
        rank: int,
        world_size: int,
        store: dist.Store,
        tier: MemoryTier | None,
        faults: FaultInjector,
    ) -> Checkpointer:
        def committed(manifest: Manifest, path: os.PathLike[str]) -> None:
            blocking = max(shard.blocking_s for shard in manifest.shards)
            self.report(
                CheckpointCommitted(
                    rank=rank,
                    generation=config.generation,
                    step=manifest.step,
                    path=str(path),
                    blocking_s=blocking,
                    last_verified_step=manifest.last_verified_step,
                    at=time.time(),
                )
            )

        def outage(step: int, since: float, error: OSError) -> None:
            self.report(
                StorageUnavailable(rank=rank, generation=config.generation, step=step, since=since, error=str(error))
            )

        identity = Identity(
            config.run_id, config.generation, config.config_digest, self.gpt_config.model_dump(), self.args.global_batch
        )
        shard_records = dist.PrefixStore("stayalive/checkpoints", store)
        return Checkpointer(
            config.checkpoint_dir,
            rank,
            world_size,
            shard_records,
            identity,
            tier,
            faults,
            on_commit=committed,
            on_outage=outage,
            durable=self.durable,
        )


def main(argv: list[str] | None = None) -> None:
    Trainer(parse_args(argv)).run()


if __name__ == "__main__":
    main()
    # A finished rank leaves without the interpreter's teardown: everything that matters is done
    # (checkpoint writes joined, reports flushed to the agent, the group destroyed), and torch's and
    # gloo's destructors took 5-8 s after atexit on a loaded host, for every rank of every generation
    # that ends. An error or sys.exit never gets here: it exits the ordinary way, with its code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
