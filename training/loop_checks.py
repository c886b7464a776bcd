"""The silent-data-corruption checks of training/sdc.py, fitted around a user's own loop (training/run.py).

A user's loop owns its collectives and its update, so the checks run where every rank's loop passes
with the step's gradient all-reduced and the update not yet applied: the optimizer's step pre-hook.
There, for a data-parallel model (DistributedDataParallel, a loop that all-reduces through
`Run.all_reduce_gradients`, or one process):
- every step, the invariants on the all-reduced gradient: non-finite, or a norm far above the running
  p99, and the update is skipped (every gradient set to None, so the optimizer leaves every parameter
  and its state as they were);
- every `self_check_every` steps, the replica check: every rank fingerprints its weights and the
  all-reduced gradient, and a rank whose replica differs is named;
- at the same steps, where the loop handed over the step's replay (`Run.replay_with`), one rank in
  turn recomputes its micro-batch, without the gradient all-reduce, and compares bitwise with what
  it computed first (kept from DDP's communication hook before the all-reduce).
A failed check halts every rank before the update; the workflow rolls the run back to the newest
checkpoint at or before the last passing check (the watermark each checkpoint records).

An FSDP2 model (sharded parameters) gets the invariants: every rank's sum of squares of its shard of
the reduced gradient, summed in the small all-reduce that carries the step's vote anyway (so it
costs no collective of its own). It has no replicas to compare and no local gradient to replay
against, and a non-finite gradient is reported by rank 0, without the rank it came from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import structlog
import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from stayalive.core.protocol.telemetry import Anomaly, SdcCheck
from stayalive.core.run.spec import SdcSpec
from stayalive.training.faults import FaultInjector
from stayalive.training.sdc import SdcGuard, flat_grads, set_grads

log = structlog.get_logger()


class LoopChecks:
    """One rank's checks for one process of a user's loop; `last_verified` is the watermark."""

    def __init__(
        self,
        spec: SdcSpec,
        rank: int,
        world_size: int,
        generation: int,
        model: torch.nn.Module,
        faults: FaultInjector,
        report: Callable[[Anomaly | SdcCheck], None],
        halt: Callable[[], None],
    ) -> None:
        self.guard = SdcGuard(spec, rank, world_size, generation, last_verified=0)
        self.rank, self.model, self.faults, self.report, self.halt = rank, model, faults, report, halt
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.enabled = spec.enabled
        self.sharded = any(isinstance(p, DTensor) for p in self.params)  # FSDP2: the invariants only
        self.world_size = world_size
        # Sums values over every rank in one small all-reduce with the step's vote riding (set by the
        # route): a sharded gradient's norm needs every rank's shard.
        self.ride: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.step = 0
        self.updating = False  # a step of the loop's is under way and its update not yet made
        self.replay: Callable[[], object] | None = None  # this rank's micro-batch of the step, again
        self.replay_of: Callable[[int], object] | None = None  # any rank's
        self.own: dict[torch.Tensor, torch.Tensor] = {}  # gradient as this rank computed it, by parameter
        self.passed_through = False  # this step's gradient came through the API before its all-reduce
        self.keeps_own = False  # this step's own gradient is kept: a recomputation check is due
        self.screen_only = True  # this step's only check is the invariants'
        # This rank's own gradient, bucket by bucket, as it entered the all-reduce: the bucket itself where
        # DDP leaves it as it was until the update (it took the result from elsewhere), else its sum.
        self.local: list[torch.Tensor] = []
        self.buckets_stay_local = self.ddp is not None and not self.ddp.gradient_as_bucket_view
        # The all-reduced gradient's norm, read (set by the route, which reads it with the step's vote).
        self.gradient_norm: Callable[[], float | None] = lambda: None

    @property
    def last_verified(self) -> int:
        return self.guard.last_verified

    @last_verified.setter
    def last_verified(self, step: int) -> None:
        self.guard.last_verified = step

    def begin(self, step: int) -> None:
        self.step, self.replay, self.replay_of, self.passed_through = step, None, None, False
        guard = self.guard
        due = self.enabled and guard.may_be_due(step)
        self.keeps_own = due and (guard.self_check_due(step) or guard.cross_check_due(step))
        # Most steps: no check but the invariants can be due, and no fault is planned.
        self.screen_only = not (due or self.faults.faults)
        self.updating = True
        self.own.clear()
        self.local.clear()

    def before_all_reduce(
        self,
        first: bool,
        parameters: Callable[[], Sequence[torch.Tensor]],
        gradients: Callable[[], Sequence[torch.Tensor]],
    ) -> None:
        """Before (a bucket of) the step's gradient goes into its all-reduce: injected gradient faults,
        and this rank's own gradient kept where a recomputation check is due."""
        self.passed_through = True
        if first and self.faults.corrupts_gradients:
            self.faults.after_backward(self.step, list(gradients()))
        if self.keeps_own:
            self.own |= {p: g.clone() for p, g in zip(parameters(), gradients(), strict=True)}

    def entering(self, local: torch.Tensor, kept: bool = False) -> None:
        """The bucket (or flat gradient) as it enters the all-reduce, to name the rank whose numbers went
        non-finite should the reduced ones be: the bucket itself where it stays as it is (`kept`, and
        DDP does not make gradients views of it), looked at only then; else its sum, which only a NaN
        or inf makes non-finite."""
        if self.enabled:
            self.local.append(local if kept and self.buckets_stay_local else local.sum())

    def after_all_reduce(self, reduced: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor | None:
        """The step's all-reduced buckets: their norm (into `out`, where given), taken while each is one
        contiguous tensor (one kernel; the gradients one by one cost ten times as much on the tiny GPT)."""
        if not self.enabled:
            return None
        norms = reduced[0] if len(reduced) == 1 else torch.stack([torch.linalg.vector_norm(r) for r in reduced])
        return torch.linalg.vector_norm(norms, out=out)

    # -- before the update (the optimizer's step pre-hook) --------------------------------------------

    def before_update(self) -> None:
        """Called by the optimizer's step pre-hook (Run's)."""
        if not (self.enabled and self.updating):  # or not the loop's update: DCP steps a fresh optimizer
            return
        self.updating = False
        if self.screen_only:
            self._screen(self.step)
            return
        step, params = self.step, self.params
        if not self.passed_through:  # one process, or FSDP2: the gradient (shard) as it stands
            grads = [g.to_local() if isinstance(g, DTensor) else g for p in params if (g := p.grad) is not None]
            self.faults.after_backward(step, grads)
        self.faults.before_update(step, params)
        checks = self._recomputations(step)
        if self.guard.replicas_due(step) and not self.sharded:
            failed = next((c for c in checks if c.method == "self" and not c.passed), None)
            blamed = 0 if failed is None or failed.culprit is None else 1 + failed.culprit
            grads = [p.grad for p in params if p.grad is not None]
            fingerprints, blame = self.guard.gather([*params, *grads], blamed)
            checks.append(self.guard.replicas(step, fingerprints))
            if blame and failed is None:  # another rank's replay differed: halt with it
                checks.append(self.guard.blamed(step, blame - 1))
        for check in checks:
            if check.method == "self" or self.rank == 0:
                self.report(check)
        if failed := next((c for c in checks if not c.passed), None):
            log.error("silent data corruption", culprit=failed.culprit, detail=failed.detail)
            self.halt()
        if checks:
            self.guard.last_verified = step
        self._screen(step)

    def _recomputations(self, step: int) -> list[SdcCheck]:
        """The checks that recompute a micro-batch, with this rank's own gradient in place (the
        all-reduced one is put back after): the cross-rank check (a collective: every rank that
        hands over `replay_of` takes part), then this rank's self-check where it is its turn."""
        cross_due = self.replay_of is not None and self.guard.cross_check_due(step)
        self_due = (self.replay or self.replay_of) is not None and self.guard.self_check_due(step)
        own_known = (self.passed_through and bool(self.own)) or self.world_size == 1
        if not (self.enabled and own_known and (cross_due or self_due)) or self.sharded:
            return []
        params = [p for p in self.params if p.grad is not None]
        reduced = flat_grads(params)  # a copy: the replays overwrite the gradients
        checks = []
        if cross_due:
            self._own_in_place(params)
            self.guard.calibrate(params, self._replay_of)  # once: it sets the tolerance
            self._own_in_place(params)
            checks.append(self.guard.cross_check(step, params, self._replay_of))
        if self_due:
            self._own_in_place(params)
            checks.append(self.guard.self_check(step, params, lambda: self._replay_of(self.rank)))
        set_grads(params, reduced)
        return checks

    def _own_in_place(self, params: list[torch.nn.Parameter]) -> None:
        for param in params:
            if (own := self.own.get(param)) is not None and param.grad is not None:
                param.grad.copy_(own)

    def _screen(self, step: int) -> None:
        """The invariants on the all-reduced gradient: a step that breaks one is not applied."""
        if self.sharded and self.ride is not None:
            shards = [g.to_local() for p in self.params if isinstance(g := p.grad, DTensor)]
            squares = sum(
                (torch.linalg.vector_norm(s.double()) ** 2 for s in shards), torch.zeros((), dtype=torch.float64)
            )
            norm = math.sqrt(float(self.ride(squares.reshape(1))[0]))
        elif (reduced := self.gradient_norm()) is not None:
            norm = reduced
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        verdict = self.guard.screen(step, norm, self._went_nonfinite)
        for report in verdict.reports:
            self.report(report)
        if not verdict.apply:
            log.warning("update skipped", why=verdict.skipped)
            for param in self.params:  # the optimizer passes over a parameter without a gradient
                param.grad = None

    def _went_nonfinite(self) -> bool | None:
        """Whether this rank's own gradient was non-finite (None: it never passed through the API)."""
        if not self.local:
            return None
        return not all(bool(torch.isfinite(local).all()) for local in self.local)

    def _replay_of(self, rank: int) -> None:
        """Rank `rank`'s micro-batch of this step into fresh gradients, without the all-reduce."""
        for param in self.params:
            if param.grad is not None:
                param.grad.zero_()
        if (replay_of := self.replay_of) is not None:
            replay: Callable[[], object] = lambda: replay_of(rank)  # noqa: E731
        else:
            assert self.replay is not None and rank == self.rank
            replay = self.replay
        if self.ddp is None:
            replay()
            return
        # Without the gradient all-reduce; and DDP's forward broadcasts buffers from rank 0, a
        # collective the other ranks are not in.
        syncing, self.ddp.require_forward_param_sync = self.ddp.require_forward_param_sync, False
        try:
            with self.ddp.no_sync():
                replay()
        finally:
            self.ddp.require_forward_param_sync = syncing
