"""How a step's gradients reach their all-reduce under `stayalive.Run`: through DDP's communication
hook, or through the loop's own call (`Run.all_reduce_gradients`, for a loop without DDP or FSDP).

Either way the all-reduce is counted for a hang's culprit (training/collectives.py), the step's
command vote rides in the first one (a float32/64 gradient, which sums the vote exactly), so agreeing
on commands costs no collective, and the SDC checks see the gradient before and after it
(training/loop_checks.py). The vote rides with a slot after it, where the all-reduced gradient's
norm goes, so that the step's summed vote and its norm reach the host in one read: a torch op costs
a step on a shared host some 10 µs of CPU (bench.api).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from stayalive.core.judgement.hangs import Site
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
        self._summed: torch.Tensor | None = None  # every rank's vote summed, then the norm's slot
        self._norm: torch.Tensor | None = None  # the all-reduced gradient's norm (the SDC checks'), not read yet
        self._read: list[float] | None = None  # `_summed` as it reached the host
        self._slot: torch.Tensor | None = None  # the norm's place in `_summed`, where it rode in a carrier
        self._votes = torch.zeros(0)  # the vote that `_rider` holds
        self._rider = torch.zeros(0)
        self._vote_sent = False
        self._first = True  # no gradient of this step has gone to its all-reduce yet
        self._buckets: list[collectives.BucketAllReduce] = []  # this step's, issued and not yet waited for
        self._carriers: dict[int, collectives.Carrier] = {}  # by bucket index

    def begin(self) -> None:
        self._summed = self._norm = self._read = self._slot = None
        self._vote_sent, self._first = False, True
        self._buckets.clear()  # a backward pass the loop abandoned

    def ddp_hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Each gradient bucket's all-reduce: DDP's averaging, counted, the vote in the first. All are
        waited for at the last bucket's, which DDP waits for right away anyway: the buckets before it
        still overlap the backward pass."""
        self._leaving(bucket.parameters, bucket.gradients)
        buffer = bucket.buffer()
        rides = not self._vote_sent and buffer.dtype in EXACT_DTYPES
        self._vote_sent = self._vote_sent or rides
        rider = self._vote_rider() if rides else None
        # Summed per tensor (exact_resume), the rider goes alone: no carrier.
        carrier = None
        if rider is not None and not self.exact_resume:
            carrier = self._carrier(bucket.index(), buffer, rider)
            self._slot = carrier.rider_last
        if self.checks is not None:  # DDP reads a carried bucket's result from the carrier: the bucket stays local
            self.checks.entering(buffer, kept=carrier is not None)
        issued = collectives.bucket_all_reduce(bucket, self.supervision.world_size, rider, self.exact_resume, carrier)
        self._buckets.append(issued)
        if bucket.is_last():
            for pending in self._buckets:
                pending.finish()
                if pending.rider is not None:
                    self._summed = pending.rider
            self._reduced([pending.reduced for pending in self._buckets], self._slot)
            self._buckets.clear()
        return issued.future

    def _carrier(self, index: int, gradients: torch.Tensor, rider: torch.Tensor) -> collectives.Carrier:
        """The bucket's carrier, made again where DDP has rebuilt its buckets (after the first step)."""
        carrier = self._carriers.get(index)
        if carrier is None or carrier.reduced.numel() != gradients.numel() or carrier.flat.dtype != gradients.dtype:
            carrier = self._carriers[index] = collectives.Carrier.fitting(gradients, rider)
        return carrier

    def all_reduce(self, params: Iterable[torch.nn.Parameter], average: bool) -> None:
        """Every gradient of `params` in one flat all-reduce, the vote riding at its end."""
        params = [p for p in params if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        self._leaving(lambda: params, lambda: grads)
        dtype = grads[0].dtype if grads else torch.float32
        device = grads[0].device if grads else torch.device("cpu")
        rides = not self._vote_sent and dtype in EXACT_DTYPES
        rider = self._vote_rider() if rides else torch.zeros(0)
        self._vote_sent = self._vote_sent or rides
        flat = flat_grads(params, rider.to(device, dtype))  # one copy, the vote at its end
        local, summed = flat.split([flat.numel() - rider.numel(), rider.numel()])
        if self.checks is not None:
            self.checks.entering(local)
        if average:
            local.div_(self.supervision.world_size)
        collectives.all_reduce(flat, Site.GRADIENTS)
        if rides:
            self._summed = summed
        self._reduced([local], None)
        set_grads(params, local)

    def ride(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over every rank in one small all-reduce on the API's gloo group, with the
        step's vote riding (for a loop whose gradient all-reduce the API does not see: FSDP2)."""
        self.before_collectives()
        flat = torch.cat([values.double().cpu(), self._vote_rider().double()])  # on the API's gloo group
        collectives.all_reduce(flat, Site.CONTROL, group=self.control)
        self._vote_sent = True
        self._summed = flat[values.numel() :]
        return flat[: values.numel()]

    def summed_votes(self) -> list[float] | None:
        """Every rank's vote of this step, summed (None: it rode no all-reduce the API saw)."""
        return None if self._summed is None else self._summed_read()[:-1]

    def gradient_norm(self) -> float | None:
        """The SDC checks' norm of this step's all-reduced gradient (None: none the API saw)."""
        if self._norm is None:
            return None
        return self._summed_read()[-1] if self._slot is not None else float(self._norm)

    def _summed_read(self) -> list[float]:
        assert self._summed is not None
        if self._read is None:
            self._read = self._summed.tolist()
        return self._read

    def _vote_rider(self) -> torch.Tensor:
        """This rank's vote, and a zero for the norm's slot (made again only when the vote changes)."""
        votes = self.supervision.votes()
        if votes is not self._votes:
            self._votes, self._rider = votes, torch.cat([votes, torch.zeros(1, dtype=votes.dtype)])
        return self._rider

    def _leaving(
        self, parameters: Callable[[], Sequence[torch.Tensor]], gradients: Callable[[], Sequence[torch.Tensor]]
    ) -> None:
        if self.checks is not None:
            self.checks.before_all_reduce(self._first, parameters, gradients)
        self._first = False
        self.before_collectives()

    def _reduced(self, reduced: list[torch.Tensor], slot: torch.Tensor | None) -> None:
        if self.checks is not None:
            self._norm = self.checks.after_all_reduce(reduced, slot)


def plain_all_reduce(params: Iterable[torch.nn.Parameter], average: bool) -> None:
    """Outside stayalive (plain torchrun): the loop's gradient all-reduce, and nothing more."""
    params = [p for p in params if p.grad is not None]
    if not (dist.is_initialized() and params):
        return
    flat = flat_grads(params)
    dist.all_reduce(flat.div_(dist.get_world_size() if average else 1))
    set_grads(params, flat)
