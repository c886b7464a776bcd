"""The public training API: a training loop of the user's own, supervised by stayalive.

    import stayalive

    run = stayalive.Run(model, optimizer, dataloader=loader)   # resumes here when stayalive says so
    for step in run.steps():                                   # from the resumed step to the target
        loss = train_step(...)
        run.record(loss)

A loop with a counter of its own, or a framework's callbacks, brackets each step instead:
`run.begin_step()`, …, `run.record(loss)`, `if not run.end_step(): break`, and `run.finish()` after.

`Run` gives the loop what the built-in trainer has: step telemetry through the node agent; commands
(checkpoint now, hold, exit, a new interval) carried out by every rank at the same agreed step;
asynchronous DCP checkpoints of the model, optimizer, data loader and every rank's RNG streams,
committed atomically with digests, kept in host memory with a peer replica, validated by the
supervisor before any resume, and restored at any world size; collective counts for a hang's
culprit (a DistributedDataParallel model's gradient all-reduces are counted through a comm hook);
and the SDC checks before each update (training/loop_checks.py), the replay self-check included
where the loop hands its step over with `run.replay_with(...)`.

Ranks agree on commands by summing their votes: in the step's first gradient all-reduce (DDP's, or
the loop's own through `run.all_reduce_gradients(params)`), which costs no collective, or else
(FSDP2) in one small all-reduce on a gloo group of the API's own (training/gradient_route.py). When
stayalive asks for a rebalance (escalation S2), `run.speeds` holds the ranks' relative speeds for a
loop that can split its batch unevenly.

A held rank waits until storage has the checkpoint of the held step, and joins the next generation,
which resumes from that checkpoint, resharded: in place where the loop says its model is bound to no
process group (`rejoin_in_place`), keeping its process and memory (when every rank did, nobody
loads: each holds that state already), else (DDP and FSDP2 bind theirs) by re-executing itself.

Outside stayalive (no STAYALIVE_* environment) `Run` only counts steps, so the same script runs
under plain torchrun.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stayalive.core.judgement.hangs import Site
from stayalive.core.protocol.telemetry import CheckpointCommitted, Finished, Held, Hello, Resumed, StorageUnavailable
from stayalive.core.run.launch import EXIT_CHECKPOINT_UNUSABLE, EXIT_SDC
from stayalive.training import collectives, memory, rank_process
from stayalive.training.accelerator import init_process_group
from stayalive.training.channel import AgentChannel
from stayalive.training.checkpoint import CheckpointError, DcpManifest, within_root
from stayalive.training.faults import FaultInjector
from stayalive.training.gradient_route import GradientRoute, plain_all_reduce
from stayalive.training.logs import configure_logging
from stayalive.training.loop_checks import LoopChecks
from stayalive.training.loop_state import LoopState, Stateful
from stayalive.training.state_checkpointer import open_checkpoints
from stayalive.training.state_restore import agreed_checkpoint, restore_state
from stayalive.training.step_reports import StepReports
from stayalive.training.supervision import NOTHING, Supervision, SupervisionConfig

log = structlog.get_logger()


class Run:
    """One rank's view of a stayalive run; construct it once the model (and optimizer) exist."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        dataloader: Stateful | None = None,
        state: dict[str, Stateful] | None = None,
        target_step: int | None = None,
        exact_resume: bool = False,
        rejoin_in_place: bool = False,
    ) -> None:
        """`dataloader`: this rank's position in the data, saved per rank. `state`: more objects the
        same on every rank (an LR scheduler, say). `target_step`: where `steps()` ends outside
        stayalive; under stayalive the run spec's `target_step` decides. `exact_resume`: a DDP
        model's gradients are summed one tensor per all-reduce, so a resumed run ends bitwise equal
        to an uninterrupted one at any width (DDP's bucket layout changes after a process's first
        step, and with it a ring all-reduce's summation order); it costs a collective per tensor.
        `rejoin_in_place`: the loop holds no process group of its own (no DDP or FSDP: it all-reduces
        through `all_reduce_gradients` or on the default group) and reads `run.rank` and
        `run.world_size` where it splits its data, so a held rank joins the next generation in its
        own process, keeping its memory; otherwise it re-executes itself."""
        self.exact_resume, self.rejoin_in_place = exact_resume, rejoin_in_place
        self.model, self.optimizer = model, optimizer
        per_rank: dict[str, Stateful] = {"dataloader": dataloader} if dataloader is not None else {}
        self.state = LoopState(model, optimizer, shared=dict(state or {}), per_rank=per_rank)
        self.step = 0  # the last step completed (or restored)
        self._logged_step: int | str = "-"  # what this rank's log lines say its step is
        self._loss: float | torch.Tensor | None = None
        self._samples: list[int] = []
        self._started = 0.0
        self._compute_s: float | None = None
        self._finished = False
        self.checks: LoopChecks | None = None
        self.route: GradientRoute | None = None
        self.speeds: list[float] | None = None  # the ranks' relative speeds, once stayalive asks for a rebalance
        # This rank's place in the group (a rank that rejoins in place may take another).
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if "STAYALIVE_RUN_ID" not in os.environ:
            if target_step is None:
                raise ValueError("outside stayalive, Run needs target_step: the step steps() ends at")
            self.config: SupervisionConfig | None = None
            self.target_step = target_step
            return
        init_process_group()  # where the loop has not: the spec's backend, on this rank's device
        rank_process.watch_from_outside()
        self.channel: AgentChannel | None = None
        if optimizer is not None:  # one hook for every generation this process joins
            optimizer.register_step_pre_hook(self._before_update)
        self._join(carried=False)
        if isinstance(model, DistributedDataParallel):
            # A lambda: DDP checks a hook's annotations against real classes, and this module's are strings.
            model.register_comm_hook(None, lambda _, bucket: self._route().ddp_hook(bucket))

    def _join(self, carried: bool) -> None:
        """This process's part in a generation, its group already formed: the API's groups, the agent's
        channel, the checks, the checkpoints, and the state to resume from (`carried`: this process
        held in the last generation and keeps its own RNG streams and data position)."""
        verified = self._last_verified() if carried else 0  # the last generation's checks, still in place
        self.config = config = SupervisionConfig.from_env()
        self.target_step = config.target_step
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.speeds = None  # a rebalance is for the generation that asked for it
        node = os.environ.get("STAYALIVE_NODE", "-")
        configure_logging(step=lambda: self._logged_step, run_id=config.run_id, node=node, rank=self.rank)
        collectives.begin(config.generation)
        hello = Hello(run_id=config.run_id, rank=self.rank, generation=config.generation, pid=os.getpid())
        if self.channel is not None:
            self.channel.send(hello)  # the agent files this connection under the new rank and generation
        elif config.agent:
            self.channel = AgentChannel(config.agent, hello, config.run_token)
        # The API's collectives run on gloo groups of their own, apart from the loop's (NCCL on GPUs):
        # the command vote on the training thread, DCP's planning on the checkpoint writer's.
        self.control = dist.new_group(backend="gloo")
        checkpoint_group = dist.new_group(backend="gloo")
        self.reports = StepReports(self.rank, config.generation, self._send)
        self.faults = FaultInjector(config.faults, self.rank, config.generation, self.world_size)
        self.supervision = Supervision(config, self.rank, self.world_size, self.channel, group=self.control)
        self.faults.attach(self.model)
        if self.optimizer is not None:
            self.checks = LoopChecks(
                config.sdc,
                self.rank,
                self.world_size,
                config.generation,
                self.model,
                self.faults,
                self._report,
                self._halt,
            )
        self.route = route = GradientRoute(
            self.supervision, self.checks, self.exact_resume, self._before_collectives, self.control
        )
        if self.checks is not None:
            self.checks.ride, self.checks.gradient_norm = route.ride, route.gradient_norm
        resume = agreed_checkpoint(config.resume_from, self.rank, self.world_size, self.control)
        self.checkpointer, tier = open_checkpoints(
            config,
            self.rank,
            self.world_size,
            checkpoint_group,
            self.faults,
            durable=resume.name if resume is not None else None,
            on_commit=self._committed,
            on_outage=self._outage,
            overlap=self.optimizer is not None,  # its step pre-hook waits for the copy (_before_update)
        )
        if resume is None:
            return
        if self._everyone_carried(carried):
            # Nobody new: every rank holds the held step's state already, which is what the checkpoint has.
            if self.checks is not None:
                self.checks.last_verified = verified
            log.info("resuming in place: every rank kept the held step's state", checkpoint=resume.name)
        else:
            self._restore(resume, tier, checkpoint_group, carried)

    def _everyone_carried(self, carried: bool) -> bool:
        """Whether every rank of the new group is a process carried over from the last generation."""
        everyone = torch.tensor([int(carried)])
        collectives.all_reduce(everyone, Site.RESTORE, op=dist.ReduceOp.MIN, group=self.control)
        return bool(everyone.item())

    def _route(self) -> GradientRoute:
        assert self.route is not None
        return self.route

    # -- the loop's side -----------------------------------------------------------------------------

    def steps(self) -> Iterator[int]:
        """The steps to train, from the one after the restored step to the target. Between two
        steps every rank carries out the commands it agreed on; after the last (or an exit command),
        the final checkpoint is on storage before this returns."""
        while self.step < self.target_step:
            step = self.begin_step()
            yield step
            if not self.end_step():
                break
        self.finish()

    # A loop that keeps its own counter (or a framework's callbacks) brackets each step instead:
    #     run.begin_step(); ...; run.record(loss); if not run.end_step(): break
    # and calls run.finish() once after the last.

    def begin_step(self) -> int:
        """A step begins (the one after `self.step`); its number."""
        step = self.step + 1
        self._logged_step = step
        collectives.at_step(step)
        if self.checks is not None:
            self.checks.begin(step)
        self._loss, self._samples, self._compute_s = None, [], None
        if self.route is not None:
            self.route.begin()
        self._started = time.perf_counter()
        return step

    def end_step(self) -> bool:
        """The step is done: report it, agree on commands with every rank, carry them out. False:
        stop training (an exit command, or the target step reached); a held rank does not return."""
        step = self.step + 1
        if self.config is None:
            self.step = step
            return step < self.target_step
        assert self.route is not None
        compute_s = self._before_collectives()
        votes = self.route.summed_votes()
        if votes is None:  # no gradient all-reduce carried it (FSDP2, the loop's own): a small all-reduce
            summed = self.supervision.votes().clone()
            collectives.all_reduce(summed, Site.CONTROL, group=self.control)
            votes = summed.tolist()
        decision = self.supervision.decide(step, votes)
        self.step = step
        self.reports.add(step, compute_s, time.perf_counter() - self._started, self._loss, self._samples)
        if decision is NOTHING:  # most steps
            return step < self.target_step
        if decision.speeds is not None:  # a loop that can split its batch unevenly reads them
            self.speeds = decision.speeds
            log.info("rebalance asked for: run.speeds", speeds=[round(s, 3) for s in decision.speeds])
        if decision.checkpoint:
            self.reports.flush()  # the agent hears of the step before its checkpoint commits
            self.checkpointer.save(step, self._state, self._last_verified())
        if decision.hold:
            self._hold()
        return not decision.stop and step < self.target_step

    def finish(self) -> None:
        """Training is over: the last checkpoint reaches storage and the run hears this rank is done.
        Called once, after the last step."""
        if self.config is None or self._finished:
            return
        self._finished = True
        self._report(Finished(rank=self.rank, generation=self.config.generation, step=self.step))
        self.checkpointer.wait()
        if self.channel is not None:
            self.channel.close()

    def record(self, loss: float | torch.Tensor | None = None, samples: list[int] | None = None) -> None:
        """This step's loss (this rank's), and the indices of the samples it trained on, if known. A
        tensor is read when the step's report is sent, with others (training/step_reports.py)."""
        if isinstance(loss, torch.Tensor) and loss.numel() != 1:
            raise ValueError(f"record(loss): one number, this rank's loss; got a tensor of shape {tuple(loss.shape)}")
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) and loss.requires_grad else loss
        self._samples = list(samples or [])

    def checkpoint(self) -> float:
        """Save now (every rank at the same step, as with any collective); the seconds it blocked. The
        tensors are copied while the loop goes on, until the optimizer's next step, which waits for
        the copy first (`run.checkpointer.blocking_s` is both, once that step began)."""
        if self.config is None:
            return 0.0
        return self.checkpointer.save(self.step, self._state, self._last_verified())

    def replay_with(
        self, replay: Callable[[], object] | None = None, *, of_rank: Callable[[int], object] | None = None
    ) -> None:
        """This step's forward and backward, as the loop computes them again (from the same inputs,
        deterministically); call it before the optimizer's step. `replay()` recomputes this rank's
        micro-batch: where this rank's bitwise self-check is due (every `sdc.self_check_every` steps,
        one rank in turn), it runs before the update, without the gradient all-reduce, and must give
        bitwise the gradient the step computed. `of_rank(r)` recomputes any rank r's micro-batch (a
        loop whose sampler can tell): it serves the self-check too, and every `sdc.cross_check_every`
        steps two ranks compute the same micro-batch and compare (every rank must hand it over)."""
        if self.checks is not None:
            self.checks.replay, self.checks.replay_of = replay, of_rank

    def all_reduce_gradients(self, params: Iterable[torch.nn.Parameter], *, average: bool = True) -> None:
        """For a loop that all-reduces its data-parallel gradients itself (no DDP, no FSDP): every
        gradient of `params` in one all-reduce, counted for a hang's culprit, with the step's
        command vote riding in it; `average`: divided by the world size first, as DDP does, else
        summed. Call it after backward, before the optimizer's step."""
        if self.route is None:
            plain_all_reduce(params, average)
        else:
            self.route.all_reduce(params, average)

    # -- between steps -------------------------------------------------------------------------------

    def _before_collectives(self) -> float:
        """Once per step, where its first collective begins: the compute time the straggler checks
        compare, and where a dying, hanging or slow GPU shows (fault injection)."""
        if self._compute_s is None:
            if self.faults.faults:
                self.faults.before_collective(self.step + 1, time.perf_counter() - self._started)
            self._compute_s = time.perf_counter() - self._started  # an injected straggler's too
        return self._compute_s

    def _state(self) -> dict[str, Any]:
        return self.state.state(self.rank)

    def _before_update(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        """The optimizer is about to change the parameters and its state: the last checkpoint's copy
        of them is complete first, then the SDC checks see the step's gradient."""
        self.checkpointer.staged()
        if self.checks is not None:
            self.checks.before_update()

    def _last_verified(self) -> int:
        return self.checks.last_verified if self.checks is not None else 0

    def _halt(self) -> None:
        """An SDC check failed on every rank at once: nothing of this state may go on. The checkpoints
        already saved reach storage (the workflow judges them by their watermark); then wait to be stopped."""
        self.checkpointer.wait()
        self.supervision.await_rejoin()
        sys.exit(EXIT_SDC)

    def _hold(self) -> None:
        """Held at an agreed step: the checkpoint just saved reaches storage, then this process leaves,
        or joins the next generation: in place, or re-executed (a model bound to its old group); either
        way that generation resumes from this checkpoint, resharded."""
        assert self.config is not None
        held = self.config.checkpoint_dir / self.checkpointer.wait_committed(self.step)
        self._report(Held(rank=self.rank, generation=self.config.generation, step=self.step))
        rejoin = self.supervision.await_rejoin()
        env = rejoin.env | {"STAYALIVE_RESUME_FROM": str(held)} if rejoin is not None else {}
        if rejoin is None or not self.rejoin_in_place:
            if self.channel is not None:
                self.channel.close()
            if rejoin is None:
                log.info("leaving the group", step=self.step)
                raise SystemExit(0)
            log.info("rejoining as a new process", checkpoint=held.name, rank=rejoin.env.get("RANK"))
            rank_process.execute_again(dict(os.environ) | env)
        log.info("rejoining in place", checkpoint=held.name, rank=env.get("RANK"))
        os.environ.update(env)
        self.faults.detach()
        dist.destroy_process_group()  # every group: nothing is pending, every rank stopped after the same step
        init_process_group()
        self._join(carried=True)

    # -- state ---------------------------------------------------------------------------------------

    def _restore(self, resume: Path, tier: memory.MemoryTier | None, group: dist.ProcessGroup, carried: bool) -> None:
        assert self.config is not None
        try:
            directory = within_root(self.config.checkpoint_dir, resume)
            state_for = self.state.loadable(self.rank, carried)
            restored = restore_state(directory, self.config.run_id, self.rank, self.world_size, tier, group, state_for)
        except CheckpointError as exc:
            log.error("cannot resume", checkpoint=str(resume), error=str(exc))
            sys.exit(EXIT_CHECKPOINT_UNUSABLE)
        self.step = restored.manifest.step
        self.state.load(restored.state, self.rank, self.step, carried)
        if self.checks is not None:
            self.checks.last_verified = restored.manifest.last_verified_step
        self._report(
            Resumed(
                rank=self.rank,
                generation=self.config.generation,
                step=self.step,
                source=restored.source,
                seconds=restored.seconds,
            )
        )

    # -- reports -------------------------------------------------------------------------------------

    def _report(self, message: Any) -> None:
        """From the training thread: after the steps it has not reported yet."""
        self.reports.flush()
        self._send([message])

    def _send(self, messages: list[Any]) -> None:
        if self.channel is not None:
            self.channel.send(*messages)

    def _committed(self, manifest: DcpManifest, path: Path) -> None:
        assert self.config is not None
        self._send(  # from the checkpoint writer's thread
            [
                CheckpointCommitted(
                    rank=self.rank,
                    generation=self.config.generation,
                    step=manifest.step,
                    path=str(path),
                    blocking_s=manifest.blocking_s,
                    last_verified_step=manifest.last_verified_step,
                    at=time.time(),
                )
            ]
        )

    def _outage(self, step: int, since: float, error: OSError) -> None:
        assert self.config is not None
        generation, why = self.config.generation, str(error)
        self._send([StorageUnavailable(rank=self.rank, generation=generation, step=step, since=since, error=why)])
