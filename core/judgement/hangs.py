"""Who a hang's culprit is, from evidence: each rank's collective progress first, then its stack.

With every rank in the same collective, the rank whose stack differs is the culprit
(docs/architecture.md §9). A rank can stall at the very call site its peers wait in, though (a
collective wedged before it reached the wire), and then every stack is the same. Each rank therefore
counts the collectives it entered and completed in its generation, in a small file its node agent
reads from outside (training/collectives.py writes it; a rank blocked in C++ runs no Python and cannot
be asked). A rank that
entered fewer than the most any rank entered never reached the collective its peers are in: alone,
it is the culprit; several such are suspects, and none is blamed. When every rank entered the same
one and none completed it, the counts tell no rank apart, and unless a stack does, the finding says
so rather than blame a rank at random (its node would be quarantined for nothing).

Pure: stacks and counters in, a finding out.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from enum import IntEnum

from pydantic import BaseModel, ConfigDict

from stayalive.core.judgement.detectors import culprit, main_thread

# The progress file: these int64 fields, in this order, native byte order (writer and reader share
# the host). Aligned 8-byte stores are not torn on the hosts we run on, and each field only grows
# within a generation, so a read while the rank writes is at worst one collective stale.
PROGRESS_FIELDS = ("generation", "step", "entered", "completed", "site")
GENERATION, STEP, ENTERED, COMPLETED, SITE = range(len(PROGRESS_FIELDS))
_PROGRESS = struct.Struct(f"={len(PROGRESS_FIELDS)}q")
PROGRESS_BYTES = _PROGRESS.size


class Site(IntEnum):
    """Where a rank issued its newest collective (0 in the file: none yet this generation)."""

    GRADIENTS = 1  # the step's gradient all-reduce, which also carries the SDC flags and control votes
    SDC_CHECK = 2  # the SDC checks' own all-reduces (calibration, cross-rank comparison)
    AGREEMENT = 3  # ranks agreeing on a command's payload (a rebalance's speeds, a checkpoint interval)
    RESTORE = 4  # loading a checkpoint: where each shard comes from, then every shard
    CONTROL = 6  # the public training API's per-step vote on commands (stayalive.Run)


SITE_NAMES: dict[int, str] = {
    Site.GRADIENTS: "the gradient all-reduce",
    Site.SDC_CHECK: "an SDC check",
    Site.AGREEMENT: "a command's agreement",
    Site.RESTORE: "the checkpoint restore",
    Site.CONTROL: "the step's command vote",
}


class CollectiveProgress(BaseModel):
    """One rank's count of the collectives it entered and completed in `generation`, the step it was
    computing (0 before its first step of the generation) and where it issued its newest collective."""

    model_config = ConfigDict(frozen=True)

    generation: int
    step: int
    entered: int
    completed: int
    site: int

    @classmethod
    def decode(cls, data: bytes) -> CollectiveProgress | None:
        """The file's contents; None when it is too short to hold them (not yet written)."""
        if len(data) < PROGRESS_BYTES:
            return None
        return cls(**dict(zip(PROGRESS_FIELDS, _PROGRESS.unpack_from(data), strict=True)))

    def encode(self) -> bytes:
        """The file's contents, as a rank keeps them (training/collectives.py)."""
        return _PROGRESS.pack(*(getattr(self, name) for name in PROGRESS_FIELDS))

    def of(self, generation: int) -> CollectiveProgress:
        """As seen from `generation`: a rank still showing an earlier one (it has not joined the group
        yet) has entered none of this generation's collectives."""
        if self.generation == generation:
            return self
        return CollectiveProgress(generation=generation, step=0, entered=0, completed=0, site=0)


class HangFinding(BaseModel):
    culprit: int | None  # the one rank the evidence names, if there is one
    suspects: list[int]  # the ranks it points at (several: no single culprit), sorted
    odd_stacks: list[int] = []  # the ranks the stack comparison alone singles out (detectors.culprit)
    summary: str  # one line for the timeline


def stack_groups(stacks: dict[int, str]) -> list[list[int]]:
    """The ranks sharing each distinct main-thread stack, smallest group first."""
    groups: dict[tuple[tuple[str, str], ...], list[int]] = defaultdict(list)
    for rank in sorted(stacks):
        groups[tuple(main_thread(stacks[rank]))].append(rank)
    return sorted(groups.values(), key=len)


def find_culprit(stacks: dict[int, str], progress: dict[int, CollectiveProgress], generation: int) -> HangFinding:
    """The culprit of a hang among the ranks that dumped their `stacks`, by their collective
    `progress` (of `generation`) where every one of them reported it, else by the stacks alone.

    1. Some ranks entered fewer collectives than the most any rank entered: they never reached the
       collective the others are in. One such rank is the culprit; several are suspects.
    2. Every rank entered collective #N and none completed it: the counters cannot tell the ranks
       apart, but a rank whose stack differs (one that wrote none: stopped, or wedged below Python)
       still stands out; with none, no rank differs and nobody is blamed.
    3. Otherwise (no counters, or no rank inside a collective) the stacks decide, as before.
    """
    if not stacks:
        return HangFinding(culprit=None, suspects=[], summary="no rank dumped its stacks")
    by_stack = culprit(stacks)
    identical = len(stack_groups(stacks)) == 1
    stacks_say = _stacks_say(stacks, by_stack, identical)
    if not stacks.keys() <= progress.keys():
        return _by_stacks(stacks, by_stack, stacks_say)
    seen = {rank: progress[rank].of(generation) for rank in stacks}
    top = max(p.entered for p in seen.values())
    behind = sorted(rank for rank, p in seen.items() if p.entered < top)
    reached = next(p for p in seen.values() if p.entered == top)
    collective = f"collective #{top} ({_where(reached)})"
    if behind:
        who = f"rank {behind[0]}" if len(behind) == 1 else f"ranks {_ranks(behind)}"
        others = len(stacks) - len(behind)
        alone = len(behind) == 1
        summary = f"{who} never entered {collective}, which the other {others} entered"
        summary += f"; {stacks_say}" if alone else f": no single culprit; {stacks_say}"
        return HangFinding(culprit=behind[0] if alone else None, suspects=behind, odd_stacks=by_stack, summary=summary)
    if all(p.completed < p.entered for p in seen.values()):
        if len(by_stack) == 1:
            summary = f"every rank entered {collective} and none completed it; {stacks_say}"
            return HangFinding(culprit=by_stack[0], suspects=by_stack, odd_stacks=by_stack, summary=summary)
        if identical:
            summary = f"every rank waits in {collective}; no rank differs: {stacks_say}"
        else:
            summary = f"every rank waits in {collective}, and the counters tell no rank apart; {stacks_say}"
        return HangFinding(culprit=None, suspects=by_stack, odd_stacks=by_stack, summary=summary)
    if all(p.completed == p.entered for p in seen.values()):
        done = f"each completed all {top} it entered" if top else "none entered one in this generation"
        stacks_say = f"no rank waits in a collective ({done}); {stacks_say}"
    return _by_stacks(stacks, by_stack, stacks_say)


def _by_stacks(stacks: dict[int, str], by_stack: list[int], stacks_say: str) -> HangFinding:
    found = by_stack[0] if len(by_stack) == 1 else None
    return HangFinding(culprit=found, suspects=by_stack, odd_stacks=by_stack, summary=stacks_say)


def _stacks_say(stacks: dict[int, str], by_stack: list[int], identical: bool) -> str:
    if identical:
        return "every rank's main-thread stack is the same"
    if len(by_stack) == 1:
        return f"rank {by_stack[0]}'s stack differs from the other {len(stacks) - 1}"
    return f"no single rank's stack stands out (suspects: {_ranks(by_stack) or 'none'})"


def _where(progress: CollectiveProgress) -> str:
    site = SITE_NAMES.get(progress.site, f"site {progress.site}")
    return f"{site} of step {progress.step}" if progress.step else f"{site}, before the generation's first step"


def _ranks(ranks: list[int], most: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:most])
    return shown + (f", … ({len(ranks)} ranks)" if len(ranks) > most else "")
