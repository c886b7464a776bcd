"""How a step's gradients reach their all-reduce under `stayalive.Run`: through DDP's communication
hook, or through the loop's own call (`Run.all_reduce_gradients`, for a loop without DDP or FSDP).

Either way the all-reduce is counted for a hang's culprit (training/collectives.py), the step's
command vote rides in the first one (a float32/64 gradient, which sums the vote exactly), so agreeing
on commands costs no collective, and the SDC checks see the gradient before and after it
(training/loop_checks.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from stayalive.core.hangs import Site
from stayalive.training import collectives
from stayalive.training.loop_checks import LoopChecks
from stayalive.training.sdc import flat_grads, set_grads
from stayalive.training.supervision import Supervision

EXACT_DTYPES = (torch.float32, torch.float64)


class GradientRoute:
    """One process's route; `before_collectives()` marks where the step's compute ends."""

    def __init__(
        self,
        supervision: Supervision,
        checks: LoopChecks | None,
        exact_resume: bool,
        before_collectives: Callable[[], float],
        control: dist.ProcessGroup,
    ) -> None:
        self.supervision, self.checks, self.exact_resume, self.control = supervision, checks, exact_resume, control
        self.before_collectives = before_collectives
        self.votes: torch.Tensor | None = None  # every rank's vote, summed, once it has ridden an all-reduce
        self._vote_sent = False
        self._first = True  # no gradient of this step has gone to its all-reduce yet
        self._buckets: list[collectives.BucketAllReduce] = []  # this step's, issued and not yet waited for
        self._carriers: dict[int, collectives.Carrier] = {}  # by bucket index

    def begin(self) -> None:
        self.votes, self._vote_sent, self._first = None, False, True
        self._buckets.clear()  # a backward pass the loop abandoned

    def ddp_hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Each gradient bucket's all-reduce: DDP's averaging, counted, the vote in the first. All are
        waited for at the last bucket's, which DDP waits for right away anyway: the buckets before it
        still overlap the backward pass."""
        self._leaving(bucket.parameters, bucket.gradients)
        if self.checks is not None:
            self.checks.entering(bucket.buffer())
        rides = not self._vote_sent and bucket.buffer().dtype in EXACT_DTYPES
        self._vote_sent = self._vote_sent or rides
        rider = self.supervision.votes() if rides else None
        # Summed per tensor (exact_resume), the rider goes alone: no carrier.
        carrier = None
        if rider is not None and not self.exact_resume:
            carrier = self._carrier(bucket.index(), bucket.buffer(), rider)
        issued = collectives.bucket_all_reduce(bucket, self.supervision.world_size, rider, self.exact_resume, carrier)
        self._buckets.append(issued)
        if bucket.is_last():
            for pending in self._buckets:
                pending.finish()
                if pending.rider is not None:
                    self._arrived(pending.rider)
                self._reduced(pending.reduced)
            self._buckets.clear()
        return issued.future

    def _carrier(self, index: int, gradients: torch.Tensor, rider: torch.Tensor) -> collectives.Carrier:
        """The bucket's carrier, made again where DDP has rebuilt its buckets (after the first step)."""
        carrier = self._carriers.get(index)
        if carrier is None or carrier.reduced.shape != gradients.shape or carrier.flat.dtype != gradients.dtype:
            carrier = self._carriers[index] = collectives.Carrier.fitting(gradients, rider)
        return carrier

    def all_reduce(self, params: Iterable[torch.nn.Parameter], average: bool) -> None:
        """Every gradient of `params` in one flat all-reduce, the vote riding at its end."""
        params = [p for p in params if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        self._leaving(lambda: params, lambda: grads)
        dtype = grads[0].dtype if grads else torch.float32
        rides = not self._vote_sent and dtype in EXACT_DTYPES
        votes = self.supervision.votes() if rides else torch.zeros(0)
        self._vote_sent = self._vote_sent or rides
        flat = flat_grads(params, votes.to(dtype))  # one copy, the vote at its end
        local, summed = flat.split([flat.numel() - votes.numel(), votes.numel()])
        if self.checks is not None:
            self.checks.entering(local)
        if average:
            local.div_(self.supervision.world_size)
        collectives.all_reduce(flat, Site.GRADIENTS)
        if rides:
            self._arrived(summed.to(votes.dtype))
        self._reduced(local)
        set_grads(params, local)

    def ride(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over every rank in one small all-reduce on the API's gloo group, with the
        step's vote riding (for a loop whose gradient all-reduce the API does not see: FSDP2)."""
        self.before_collectives()
        votes = self.supervision.votes()
        flat = torch.cat([values.double(), votes.double()])
        collectives.all_reduce(flat, Site.CONTROL, group=self.control)
        self._vote_sent = True
        self._arrived(flat[values.numel() :].to(votes.dtype))
        return flat[: values.numel()]

    def _leaving(
        self, parameters: Callable[[], Sequence[torch.Tensor]], gradients: Callable[[], Sequence[torch.Tensor]]
    ) -> None:
        if self.checks is not None:
            self.checks.before_all_reduce(self._first, parameters, gradients)
        self._first = False
        self.before_collectives()

    def _arrived(self, votes: torch.Tensor) -> None:
        self.votes = votes

    def _reduced(self, reduced: torch.Tensor) -> None:
        if self.checks is not None:
            self.checks.after_all_reduce(reduced)


def plain_all_reduce(params: Iterable[torch.nn.Parameter], average: bool) -> None:
    """Outside stayalive (plain torchrun): the loop's gradient all-reduce, and nothing more."""
    params = [p for p in params if p.grad is not None]
    if not (dist.is_initialized() and params):
        return
    flat = flat_grads(params)
    dist.all_reduce(flat.div_(dist.get_world_size() if average else 1))
    set_grads(params, flat)
