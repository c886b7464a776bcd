"""The soak's schedule: a seeded random draw from the whole fault matrix, laid out into runs.

Each run of the soak trains the same spec (bench/soak.py) and meets several faults, one after the
other: in-rank faults go into its spec's fault plan, each in the generation it must land in; the
rest (a node agent, the supervisor or the dev server killed, a node cut off, a drain) the bench
carries out itself when the run reaches their step. A fault that interrupts the run ends its
generation, so the next fault is planned for the next one; one that does not (the supervisor killed,
storage away) lands in the generation it found.

Steps only grow along a run, and no two faults share one: the same step failing twice is a
poisoned batch, which stops a run on purpose (checked on its own). Pure: a seed in, a plan out.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel

WORLD_SIZE = 4
CHECKPOINT_EVERY = 10  # steps; the SDC self-check runs as often (a rotating rank replays its micro-batch)
TARGET_STEP = 400
FIRST_STEP = 25  # after the first checkpoint has been validated
LAST_STEP = TARGET_STEP - 40  # the last fault leaves the run room to show it recovered
FAULTS_PER_RUN = (4, 6)
STORAGE_AWAY_S = 3.0
FILLER = "crash"  # placed where no fault left in the deck fits (those that need a restart before them)
# A straggler's generation lasts this long: enough for its k = 20 slow steps to flag it, too short for
# its rent to buy S2. A rebalance splits the batch anew, which changes the order the gradient's floats
# are summed in: the run would no longer end bitwise where the reference does (S2: test_escalation).
STRAGGLER_STEPS = 40
STRAGGLER_FACTOR = 1.5

DAMAGES = ("truncate_shard", "flip_byte", "delete_shard", "delete_manifest", "edit_manifest")


class Expect(BaseModel):
    """What the run's timeline must say about a fault: an interruption of its generation with this
    cause (and this rank, or the node the bench acted on), or only a detection of this kind."""

    cause: str | None = None  # None: the fault must not interrupt the run
    rank: int | None = None
    blame_node: bool = True  # the interruption names the node (False: a hang nobody can be blamed for)
    detection: str | None = None  # a Detection kind the run must (storage) or may (straggler) record
    required: bool = True  # the detection must be there (a straggler on a shared host may go unflagged)


class PlannedFault(BaseModel):
    kind: str
    generation: int
    step: int
    rank: int | None = None
    injected: list[dict[str, Any]] = []  # faults for the spec's plan (core/run/faults.py)
    action: str | None = None  # what the bench does itself (bench/soak.py ACTIONS)
    on_restart: bool = False  # the action waits for the previous fault's restart, not a step
    expect: Expect
    damaged_step: int | None = None  # a damaged checkpoint: the restart after it must resume earlier

    @property
    def interrupts(self) -> bool:
        return self.expect.cause is not None


class RunPlan(BaseModel):
    index: int
    faults: list[PlannedFault]

    def spec_faults(self) -> list[dict[str, Any]]:
        return [f for fault in self.faults for f in fault.injected]


# kind → what it says in the soak's table
KINDS = {
    "crash": "rank crash in a step",
    "crash_in_checkpoint": "rank crash while writing its checkpoint",
    "crash_after_restart": "rank crash in the first steps after a restart",
    "hang": "hang in compute",
    "collective_hang_before": "hang at the all-reduce, never entered",
    "collective_hang_inside": "hang inside the all-reduce, nobody to blame",
    "bitflip": "transient SDC (a gradient bit flips)",
    **{f"damage_{d}": f"checkpoint damage: {d.replace('_', ' ')}" for d in DAMAGES},
    "storage_outage": "storage unreachable during a write",
    "disk_full": "disk full during a write",
    "straggler": "straggler (1.5× slower compute)",
    "agent_killed": "node agent killed",
    "supervisor_killed": "supervisor worker killed",
    "supervisor_killed_in_restart": "supervisor worker killed during a restart",
    "supervisor_killed_in_drain": "drain, and the supervisor killed during it",
    "server_killed": "Temporal dev server killed, restarted on its database",
    "partition": "node partitioned (network namespace, link cut)",
}
PARTITION_KINDS = {"partition"}
_FIRST_ONLY = {"partition"}  # the namespaced node is in the group only in a run's first generation
_LAST_ONLY = {"storage_outage", "disk_full"}  # storage away outlasts the steps after it
_AFTER_AN_INTERRUPTION = {"crash_after_restart", "supervisor_killed_in_restart"}


def _fits(kind: str, position: int, length: int, previous: list[PlannedFault]) -> bool:
    if kind in _FIRST_ONLY and position != 0:
        return False
    if kind in _LAST_ONLY and position != length - 1:
        return False
    if kind in _AFTER_AN_INTERRUPTION and not (previous and previous[-1].interrupts):
        return False
    if kind == "crash_after_restart" and previous:
        if previous[-1].expect.cause == "drain":
            return False  # a drain resumes from the checkpoint it took: the steps before it are not run again
        if (previous[-1].step - 1) % CHECKPOINT_EVERY == 0:
            return False  # its last completed step would equal the previous fault's: a "poisoned batch"
    if previous and previous[-1].kind == "straggler" and kind not in _INTERRUPTING:
        return False  # a straggler's generation ends with the next fault
    return kind != "straggler" or position < length - 1


_INTERRUPTING = {k for k in KINDS if k not in {"storage_outage", "disk_full", "straggler"}} - {
    "supervisor_killed",
    "supervisor_killed_in_restart",
    "server_killed",
}


def _next_multiple(step: int, of: int) -> int:
    return -(-step // of) * of


def _place(kind: str, generation: int, step: int, rng: random.Random, previous: list[PlannedFault]) -> PlannedFault:
    """The fault of `kind` at or after `step` in `generation`."""
    rank = rng.randrange(WORLD_SIZE)
    crash = {"kind": "crash", "rank": rank, "generation": generation}

    def fault(at: int, injected: list[dict[str, Any]], expect: Expect, **more: Any) -> PlannedFault:
        return PlannedFault(kind=kind, generation=generation, step=at, injected=injected, expect=expect, **more)

    if kind == "crash":
        return fault(step, [crash | {"at_step": step}], Expect(cause="crash", rank=rank), rank=rank)
    if kind == "crash_in_checkpoint":
        at = _next_multiple(step, CHECKPOINT_EVERY)
        return fault(
            at, [crash | {"at_step": at, "during": "checkpoint_write"}], Expect(cause="crash", rank=rank), rank=rank
        )
    if kind == "crash_after_restart":
        # The first step after the newest checkpoint the previous fault's restart can resume from.
        at = (previous[-1].step - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY + 1
        return fault(at, [crash | {"at_step": at}], Expect(cause="crash", rank=rank), rank=rank)
    if kind in ("hang", "collective_hang_before", "collective_hang_inside"):
        hang: dict[str, Any] = {"kind": "hang", "rank": rank, "at_step": step, "generation": generation}
        if kind != "hang":
            hang |= {"kind": "collective_hang", "where": kind.rsplit("_", 1)[1]}
        inside = kind == "collective_hang_inside"
        return fault(
            step, [hang], Expect(cause="hang", rank=None if inside else rank, blame_node=not inside), rank=rank
        )
    if kind == "bitflip":
        # Only a flip in a step its rank replays is caught: step s is replayed by rank (s / every) mod W.
        at = _next_multiple(step, CHECKPOINT_EVERY)
        rank = at // CHECKPOINT_EVERY % WORLD_SIZE
        flip = {"kind": "bitflip", "rank": rank, "at_step": at, "generation": generation}
        return fault(at, [flip], Expect(cause="sdc", rank=rank), rank=rank)
    if kind.startswith("damage_"):
        # A damaged checkpoint matters once a restart would resume from it: a crash 3 steps on.
        damaged = _next_multiple(step, CHECKPOINT_EVERY)
        damage = {"kind": "corrupt_checkpoint", "at_step": damaged, "damage": kind.removeprefix("damage_")}
        damage |= {"shard": rng.randrange(WORLD_SIZE), "generation": generation}
        probe = crash | {"at_step": damaged + 3}
        return fault(damaged + 3, [damage, probe], Expect(cause="crash", rank=rank), rank=rank, damaged_step=damaged)
    if kind in ("storage_outage", "disk_full"):
        at = _next_multiple(step, CHECKPOINT_EVERY)
        away = {"kind": kind, "at_step": at, "seconds": STORAGE_AWAY_S, "generation": generation}
        return fault(at, [away], Expect(detection="storage_outage"))
    if kind == "straggler":
        slow = {
            "kind": "straggler",
            "rank": rank,
            "factor": STRAGGLER_FACTOR,
            "from_step": step,
            "generation": generation,
        }
        return fault(step, [slow], Expect(rank=rank, detection="straggler", required=False), rank=rank)
    cause = {"agent_killed": "node_lost", "partition": "partition", "supervisor_killed_in_drain": "drain"}.get(kind)
    return fault(step, [], Expect(cause=cause), action=kind, on_restart=kind in _AFTER_AN_INTERRUPTION)


def plan(seed: int, faults: int, partitions: bool = True) -> list[RunPlan]:
    """At least `faults` faults, every kind as often as the others give or take one, in random order,
    laid into runs of FAULTS_PER_RUN faults wherever each fits (the rules in `_fits`); where none
    left fits, a FILLER crash."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS if partitions or k not in PARTITION_KINDS]
    deck: list[str] = []
    while len(deck) < faults:
        deck += rng.sample(kinds, len(kinds))
    deck = deck[:faults]
    runs: list[RunPlan] = []
    while deck:
        length = min(rng.randint(*FAULTS_PER_RUN), len(deck))
        placed: list[PlannedFault] = []
        generation, step = 0, FIRST_STEP
        for position in range(length):
            kind = next((k for k in deck if _fits(k, position, length, placed)), None)
            if kind is not None:
                deck.remove(kind)
            elif _fits(FILLER, position, length, placed):
                kind = FILLER  # nothing left fits here (a fault that needs a restart before it): a crash
            else:
                break
            fault = _place(kind, generation, step, rng, placed)
            placed.append(fault)
            gap = STRAGGLER_STEPS if kind == "straggler" else rng.randint(14, 22)
            step = max(step, fault.step) + gap
            generation += fault.interrupts
        if placed[-1].step > LAST_STEP:
            raise ValueError(f"run {len(runs)}'s faults reach step {placed[-1].step}, past {LAST_STEP}")
        runs.append(RunPlan(index=len(runs), faults=placed))
    return runs
