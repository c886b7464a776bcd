"""Silent data corruption, caught inside the step (docs/architecture.md §10).

Three layers, cheapest first:
- invariants every step: a non-finite loss or gradient, or a gradient norm above `spike` × the
  running p99, skips the update (every rank sees the same reduced gradient, so they all agree; one
  norm of it finds a NaN or inf on any rank);
- a bitwise self-check every N steps: one rank, rotating, recomputes its own micro-batch on the same
  device with the same kernels and compares with `==`; any difference is a hardware fault;
- a cross-rank check every ~10N steps: two ranks in different failure domains compute the same
  micro-batch and compare at a tolerance calibrated on this run's ranks, which catches the rank that
  is wrong the same way every time (a self-check cannot); a third rank breaks the tie;
- a replica check every N steps: data-parallel ranks must hold bitwise the same weights and the same
  all-reduced gradient, so each fingerprints both and they compare (as Megatron-LM's weight-hash
  check across data-parallel replicas does); the rank that differs from the others kept or received
  wrong numbers, at any step since the last check.

training/loop_checks.py runs them in any loop, before its update. The invariants cost no collective
(every rank screens the same all-reduced gradient, so all skip the same update); a recomputation
check's verdict, and the rank it blames, travel in the replica check's gather. So every rank knows at
the same step whether a check passed (the verification watermark every checkpoint records) and who
failed one.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from stayalive.core.judgement.hangs import Site
from stayalive.core.protocol.telemetry import Anomaly, SdcCheck
from stayalive.core.run.spec import SdcSpec
from stayalive.training import collectives

TOLERANCE_FLOOR = 1e-6  # float32 noise of a deterministic, same-kernel recomputation is exactly 0
TOLERANCE_SIGMAS = 5.0  # the rank-to-rank spread measured on this run's ranks, × 5 (docs/architecture.md §10, §16)
NORM_HISTORY = 200  # gradient norms kept for the running p99
NORMS_BEFORE_SPIKES = 20  # a p99 of fewer norms is noise
P99_EVERY = 10  # steps between recomputing the running p99: it moves slowly, and a sort is not free
FINGERPRINT_CHUNK = 1 << 20  # words fingerprinted at a time: the int64 copy and the weights stay small (8 MB)
FINGERPRINT_MODULUS = (1 << 61) - 1  # a Mersenne prime: the fold stays an int64 and loses no bit's effect


def fingerprint(tensors: Iterable[torch.Tensor]) -> int:
    """A position-weighted sum of the tensors' 32-bit words, folded group by group (small tensors
    laid end to end, so that a model's many small ones cost a few kernels, large ones a copy at a
    time of at most FINGERPRINT_CHUNK words): one flipped bit anywhere changes it, and so does a
    word moved to another place."""
    total, group, size = 0, [], 0
    for tensor in [*tensors, None]:
        if tensor is not None:
            group.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
            size += group[-1].numel()
        if group and (tensor is None or size >= 4 * FINGERPRINT_CHUNK):
            data = torch.cat(group)
            words = data[: data.numel() // 4 * 4].view(torch.int32)
            total = (total * 1_000_003 + int(data[words.numel() * 4 :].sum())) % FINGERPRINT_MODULUS
            for chunk in words.split(FINGERPRINT_CHUNK):
                summed = int((chunk.to(torch.int64) * _weights(chunk.numel(), chunk.device)).sum())
                total = (total * 1_000_003 + summed) % FINGERPRINT_MODULUS
            group, size = [], 0
    return total


def _weights(count: int, device: torch.device) -> torch.Tensor:
    """1, 2, …, 65521, 1, 2, …: a word's weight by its place (never 0, so no word is ignored)."""
    return _all_weights(device)[:count]


@functools.cache
def _all_weights(device: torch.device) -> torch.Tensor:  # on the device of the words it weighs
    return torch.arange(FINGERPRINT_CHUNK, dtype=torch.int64, device=device) % 65521 + 1


def flat_grads(params: list[torch.nn.Parameter], *tail: torch.Tensor) -> torch.Tensor:
    """Every gradient in one new flat tensor, then `tail` (slots that ride the same all-reduce)."""
    return torch.cat([*(p.grad.reshape(-1) for p in params if p.grad is not None), *tail])


def set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(part.view_as(grad))


@dataclass(frozen=True)
class Verdict:
    """What the invariants say about this step's all-reduced gradient: the same on every rank."""

    apply: bool = True  # apply the update
    skipped: str = ""  # why not, when no check failed
    reports: tuple[Anomaly | SdcCheck, ...] = ()  # what this rank tells its agent


APPLY = Verdict()  # most steps'


class SdcGuard:
    """One rank's checks for one generation. `last_verified` is the watermark: the newest step at which
    a check passed, carried by every checkpoint this rank writes."""

    def __init__(self, spec: SdcSpec, rank: int, world_size: int, generation: int, last_verified: int) -> None:
        self.spec, self.rank, self.world_size, self.generation = spec, rank, world_size, generation
        self.last_verified = last_verified
        self.tolerance = spec.cross_check_tolerance if spec.cross_check_tolerance != "auto" else None
        self.calibration = "configured in the run spec" if self.tolerance is not None else ""
        self.norms: deque[float] = deque(maxlen=NORM_HISTORY)
        self.p99 = math.inf  # of `norms`, refreshed every P99_EVERY norms
        self.counted = 0  # norms appended

    def may_be_due(self, step: int) -> bool:
        """Whether a check besides the invariants can be due at `step` (none is, most steps)."""
        return step % self.spec.self_check_every == 0 or step % self.spec.cross_check_every == 0

    # -- the bitwise self-check ----------------------------------------------------------------------

    def self_check_due(self, step: int) -> bool:
        """One rank per check, rotating: every rank is covered once every `world_size` checks."""
        every = self.spec.self_check_every
        return step % every == 0 and self.rank == (step // every) % self.world_size

    def self_check(self, step: int, params: list[torch.nn.Parameter], recompute: Callable[[], object]) -> SdcCheck:
        first = flat_grads(params).clone()
        recompute()
        second = flat_grads(params)
        differing = int((first != second).sum())
        difference = float((first - second).norm() / first.norm().clamp_min(1e-30)) if differing else 0.0
        set_grads(params, first)  # the step goes on (or stops) with what this rank computed first
        return SdcCheck(
            rank=self.rank,
            generation=self.generation,
            step=step,
            method="self",
            passed=differing == 0,
            culprit=None if differing == 0 else self.rank,
            difference=difference,
            tolerance=0.0,
            last_verified=self.last_verified,
            detail=f"rank {self.rank} replayed its micro-batch: "
            + ("bitwise equal" if differing == 0 else f"{differing} of {first.numel()} gradient elements differ"),
        )

    # -- the cross-rank check (a collective: every rank takes part) ----------------------------------

    def cross_check_due(self, step: int) -> bool:
        return self.world_size >= 3 and step % self.spec.cross_check_every == 0

    def calibrate(self, params: list[torch.nn.Parameter], compute_on: Callable[[int], object]) -> None:
        """Every rank computes rank 0's micro-batch; 5 × the spread of their gradients on this run's
        own hardware is the tolerance. The spread is the median relative distance to the mean of the
        others, leaving out the rank farthest from everyone (it may be the bad one; the check exists
        to catch it). A collective: every rank calls it, at the start of a generation."""
        if not self.spec.enabled or self.tolerance is not None or self.world_size < 3:
            return
        compute_on(0)
        mine = flat_grads(params).clone()
        outlier = int(self._distances(mine, None).argmax())
        spread = float(self._distances(mine, outlier).median())
        self.tolerance = max(TOLERANCE_SIGMAS * spread, TOLERANCE_FLOOR)
        self.calibration = (
            f"{TOLERANCE_SIGMAS:g} × the spread of {self.world_size - 1} ranks on one batch at start-up "
            f"({spread:.3g}), at least {TOLERANCE_FLOOR:g}"
        )

    def _distances(self, mine: torch.Tensor, left_out: int | None) -> torch.Tensor:
        """Every rank's ‖g − mean‖ / ‖mean‖, the mean and the result without `left_out`."""
        counted = self.rank != left_out
        mean = mine.clone() if counted else torch.zeros_like(mine)
        collectives.all_reduce(mean, Site.SDC_CHECK)
        mean /= self.world_size - (left_out is not None)
        distances = torch.zeros(self.world_size, device=mine.device)  # the default group's: NCCL's on GPUs
        if counted:
            distances[self.rank] = float((mine - mean).norm() / mean.norm().clamp_min(1e-30))
        collectives.all_reduce(distances, Site.SDC_CHECK)
        distances = distances.cpu()
        return distances if left_out is None else distances[torch.arange(self.world_size) != left_out]

    def cross_check(self, step: int, params: list[torch.nn.Parameter], compute_on: Callable[[int], object]) -> SdcCheck:
        """Ranks a and b (half the world apart: another failure domain) compute a's micro-batch; when
        they disagree, c (a's neighbour) breaks the tie."""
        assert self.tolerance is not None, "calibrate() first"
        mine = flat_grads(params).clone()
        a = (step // self.spec.cross_check_every) % self.world_size
        b, c = (a + self.world_size // 2) % self.world_size, (a + 1) % self.world_size
        difference = self._difference(params, mine, a, b, compute_on)
        detail = f"ranks {a} and {b} computed rank {a}'s micro-batch: relative difference {difference:.3g}"
        culprit = None
        if difference > self.tolerance:
            tie = self._difference(params, mine, a, c, compute_on)
            culprit = b if tie <= self.tolerance else a
            detail += f"; rank {c} sides with rank {a if culprit == b else b} (difference to rank {a}: {tie:.3g})"
        set_grads(params, mine)
        return SdcCheck(
            rank=self.rank,
            generation=self.generation,
            step=step,
            method="cross",
            passed=culprit is None,
            culprit=culprit,
            difference=difference,
            tolerance=self.tolerance,
            last_verified=self.last_verified,
            detail=f"{detail}; tolerance {self.tolerance:.3g} = {self.calibration}",
        )

    def _difference(
        self, params: list[torch.nn.Parameter], mine: torch.Tensor, a: int, b: int, compute_on: Callable[[int], object]
    ) -> float:
        """‖g_a − g_b‖ / ‖g_a‖ for rank a's micro-batch computed on a and on b (one all-reduce)."""
        delta = torch.zeros(mine.numel() + 1, device=mine.device)
        if self.rank == a:
            delta[:-1] = mine
            delta[-1] = mine.norm()
        elif self.rank == b:
            compute_on(a)
            delta[:-1] = -flat_grads(params)
            set_grads(params, mine)
        collectives.all_reduce(delta, Site.SDC_CHECK)
        return float(delta[:-1].norm() / delta[-1].clamp_min(1e-30))

    # -- the replica check (every rank's fingerprint, gathered by one all-reduce) --------------------

    def replicas_due(self, step: int) -> bool:
        return self.spec.enabled and self.world_size >= 2 and step % self.spec.self_check_every == 0

    def gather(self, tensors: list[torch.Tensor], blamed: int = 0) -> tuple[list[int], int]:
        """One all-reduce (a collective: every rank calls it at a due step): every rank's fingerprint
        of `tensors`, and `blamed` summed (1 + the rank a self-check blames, 0 from everyone else)."""
        device = tensors[0].device if tensors else torch.device("cpu")  # the default group's: NCCL's on GPUs
        slots = torch.zeros(self.world_size + 1, dtype=torch.int64, device=device)
        slots[self.rank] = fingerprint(tensors)
        slots[-1] = blamed
        collectives.all_reduce(slots, Site.SDC_CHECK)
        *prints, blame = slots.tolist()
        return prints, blame

    def replicas(self, step: int, fingerprints: list[int]) -> SdcCheck:
        """Every rank's fingerprint of its weights and all-reduced gradient. The odd one out is the
        culprit; with no majority (two ranks, or several odd ones) the check fails naming nobody."""
        (common, holders), *_ = Counter(fingerprints).most_common()
        odd = [r for r, value in enumerate(fingerprints) if value != common]
        culprit = odd[0] if len(odd) == 1 and holders > 1 else None
        if not odd:
            detail = f"the {self.world_size} replicas' weights and gradients are bitwise equal"
        elif culprit is not None:
            detail = f"rank {culprit}'s weights or gradient differ from the other {holders} replicas'"
        else:
            others = sorted(set(range(self.world_size)) - set(odd))
            detail = f"no majority among the replicas: ranks {odd} differ from ranks {others}"
        return SdcCheck(
            rank=self.rank,
            generation=self.generation,
            step=step,
            method="replicas",
            passed=not odd,
            culprit=culprit,
            last_verified=self.last_verified,
            detail=detail,
        )

    def blamed(self, step: int, culprit: int) -> SdcCheck:
        """The failed self-check of another rank, as this rank learns it from a summed flag."""
        return SdcCheck(
            rank=self.rank,
            generation=self.generation,
            step=step,
            method="self",
            passed=False,
            culprit=culprit,
            last_verified=self.last_verified,
            detail=f"rank {culprit}'s replay differs",
        )

    def screen(self, step: int, norm: float, went_nonfinite: Callable[[], bool | None]) -> Verdict:
        """The invariants on the all-reduced gradient's norm, the same on every rank: non-finite, or a
        spike. `went_nonfinite()`: whether this rank's own numbers did (None: not known here, and rank
        0 reports it for everyone)."""
        if not math.isfinite(norm):
            why = "non-finite loss or gradient"
            own = went_nonfinite()
            if not (own or (own is None and self.rank == 0)):
                return Verdict(apply=False, skipped=why)
            where = f"on rank {self.rank}" if own else "in the all-reduced gradient, from a rank unknown"
            anomaly = self._anomaly(step, "nonfinite", f"{why} {where}: update skipped", origin_known=own is not None)
            return Verdict(apply=False, skipped=why, reports=(anomaly,))
        ceiling = self.spec.grad_spike_factor * self.p99
        if norm > ceiling:
            why = f"gradient norm {norm:.3g} > {ceiling:.3g} ({self.spec.grad_spike_factor:g} × the running p99)"
            spike = (self._anomaly(step, "grad_spike", f"{why}: update skipped"),)
            return Verdict(apply=False, skipped=why, reports=spike if self.rank == 0 else ())
        self.norms.append(norm)
        self.counted += 1
        if self.counted >= NORMS_BEFORE_SPIKES and self.counted % P99_EVERY == 0:
            self.p99 = sorted(self.norms)[math.ceil(0.99 * len(self.norms)) - 1]  # nearest rank
        return APPLY

    def _anomaly(
        self, step: int, kind: Literal["nonfinite", "grad_spike"], detail: str, origin_known: bool = True
    ) -> Anomaly:
        return Anomaly(
            rank=self.rank, generation=self.generation, step=step, kind=kind, detail=detail, origin_known=origin_known
        )
