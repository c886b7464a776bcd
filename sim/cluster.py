"""The simulated cluster: what the simulated activities (sim/activities.py) answer from. Plain Python,
in memory, on one event loop; no Temporal, no processes, no files, and nothing per rank: a run of
2,048 nodes × 8 ranks costs what a run of 2 costs.

A generation is planned when it is launched, from the launch itself, the way a rank reads it: it
resumes from the checkpoint the launch names (or, rejoining after a hold, from the held step),
checkpoints as often as the launch asks, and ends where the failure schedule says or at the target
step. Step `s` completes at `first_step_at + (s - resume - 1) * step_seconds` on the cluster's clock.
What people ask along the way (a hold, a forced checkpoint) moves the plan: a command lands at the
next step boundary, as the ranks' vote makes it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from stayalive.core.protocol.telemetry import Command
from stayalive.core.run.launch import Launch
from stayalive.training.checkpoint import parse_checkpoint_dirname

# "damage": the next checkpoint to commit reads back wrong (a shard on a dying drive).
FaultKind = Literal["crash", "node_lost", "hang", "sdc", "straggler", "slowdown", "damage"]
# What ends a generation; a straggler, a slowdown or a damaged checkpoint is reported and the
# generation goes on.
ENDING: frozenset[str] = frozenset({"crash", "node_lost", "hang", "sdc"})
ENDED = ("rank_failed", "node_lost", "hang", "sdc")  # how a monitor reports each ending fault
HANG_TIMEOUT_S = 10.0  # the run monitor's step timeout, in the simulator
DEFECT_REPEATS_AFTER_S = 600.0


@dataclass(frozen=True)
class Fault:
    """What happens to a generation `after_steps` past its resume step. `rank` (modulo the world size)
    picks the rank, and its node, that fails or straggles; `ratio` is how slow."""

    kind: FaultKind
    after_steps: int
    rank: int = 0
    ratio: float = 2.0
    exit_code: int = 137
    lasting: bool = False  # an SDC the node repeats: its self-test fails, and so would it, back in a run


class Schedule(Protocol):
    """What each generation meets: faults by generation (FailureSchedule), or by the time ranks have
    trained (sim/month.TrainingTimeSchedule)."""

    def plan(self, generation: int, uptime_s: float, step_seconds: float) -> Sequence[Fault]:
        """The faults of generation `generation`, launched once its run's ranks had trained `uptime_s`."""
        ...

    def pace(self, generation: int) -> float | None:
        """The generation's seconds per step, where the schedule sets them."""
        ...


@dataclass(frozen=True)
class FailureSchedule:
    """The faults each generation meets, in order. A generation with no ending fault runs to the
    target step (or until a hold). `step_seconds` slows chosen generations down: long enough for a
    person (a test) to act on them while they run."""

    faults: Mapping[int, Sequence[Fault]] = field(default_factory=dict)
    step_seconds: Mapping[int, float] = field(default_factory=dict)

    @classmethod
    def crash_every_generation(cls, count: int, after_steps: int, world_size: int) -> FailureSchedule:
        """Generations 0 … count-1 each lose one rank `after_steps` past their resume step (ranks 0, 1,
        2 … in turn, so every node position fails); generation `count` finishes the run."""
        return cls({g: [Fault("crash", after_steps, rank=g % world_size)] for g in range(count)})

    def plan(self, generation: int, uptime_s: float, step_seconds: float) -> Sequence[Fault]:
        return self.faults.get(generation, ())

    def pace(self, generation: int) -> float | None:
        return self.step_seconds.get(generation)


@dataclass
class SimulatedGeneration:
    launch: Launch
    directory: str  # the run's checkpoint directory
    resume_step: int
    target: int
    faults: Sequence[Fault]
    every: int  # checkpoint every this many steps (0: never)
    first_step_at: float
    step_seconds: float
    blocking_seconds: float
    detect_after: Mapping[str, float] = field(default_factory=dict)  # seconds from a fault to its report, by kind
    first_of_run: bool = False  # no earlier generation of the run committed a checkpoint
    launched_at: float = 0.0
    tallied_at: float = 0.0  # a quiet monitor's last tally of a straggler's rent
    hold_step: int | None = None  # the step every rank holds at, once a hold command landed
    retuned: list[tuple[int, int]] = field(default_factory=list)  # (from step, every): interval commands
    forced: set[int] = field(default_factory=set)  # steps checkpointed because a person asked
    commands: int = 0  # rebalance commands received (each earns the straggler ladder another tally)
    reported: set[str] = field(default_factory=set)  # what a monitor already signalled (a new one skips it)

    @property
    def number(self) -> int:
        return self.launch.generation

    def at(self, step: int) -> float:
        """When `step` completes."""
        return self.first_step_at + (step - self.resume_step - 1) * self.step_seconds

    def step_at(self, now: float) -> int:
        """The newest step completed by `now`."""
        done = int((now - self.first_step_at) / self.step_seconds) + 1 if now >= self.first_step_at else 0
        return min(self.resume_step + max(0, done), self.last_step)

    def fault_step(self, fault: Fault) -> int:
        return self.resume_step + fault.after_steps

    @property
    def ending(self) -> Fault | None:
        """The fault that ends this generation, if it comes before the target and any hold."""
        last = self.target if self.hold_step is None else self.hold_step
        return next((f for f in self.faults if f.kind in ENDING and self.fault_step(f) < last), None)

    @property
    def last_step(self) -> int:
        """The last step the generation completes."""
        if (fault := self.ending) is not None:
            return self.fault_step(fault)
        return self.target if self.hold_step is None else self.hold_step

    def checkpoint_steps(self) -> list[int]:
        """Every checkpoint the generation commits, in order. A rank dies before its step's
        checkpoint commits; ranks checkpoint the target step and a held step before they stop."""
        last = self.last_step
        steps = {*self._regular(last), *(s for s in self.forced if s <= last)}
        if self.ending is not None:  # what was still being written when the rank died never commits
            steps = {s for s in steps if self.committed_at(s) <= self.at(last)}
        else:
            steps.add(last)
        return sorted(s for s in steps if s > self.resume_step)

    def damaged(self, step: int) -> bool:
        """The checkpoint of `step` reads back wrong: it is the first to commit after a "damage" fault."""
        steps = self.checkpoint_steps()
        return any(
            f.kind == "damage" and step == next((s for s in steps if s >= self.fault_step(f)), None)
            for f in self.faults
        )

    @property
    def trained_seconds(self) -> float:
        """How long the ranks trained, first step to last (planned to; a generation that runs on has
        not yet)."""
        return max(0.0, self.at(self.last_step) + self.step_seconds - self.first_step_at)

    def _regular(self, last: int) -> list[int]:
        """The interval's checkpoints up to `last`: multiples of the launch's interval, then, from the
        step an `interval` command landed at, one every new interval after the newest before it (as
        a rank's checkpoint clock counts from its last checkpoint)."""
        if not self.every:
            return []
        steps = list(range((self.resume_step // self.every + 1) * self.every, last + 1, self.every))
        for at, every in self.retuned:
            steps = [s for s in steps if s < at]
            step = max(at, (steps[-1] if steps else self.resume_step) + every)
            steps += range(step, last + 1, every)
        return steps

    def committed_at(self, step: int) -> float:
        return self.at(step) + self.blocking_seconds

    def ended_at(self) -> float:
        """When the monitor reports the generation's end: once the last checkpoint commits, or the
        time it takes to notice the fault that ended it after the last step."""
        if (fault := self.ending) is None:
            return self.committed_at(self.last_step)
        return self.at(self.last_step) + self.detect_after.get(fault.kind, 0.0)

    def node_of(self, rank: int) -> str:
        launch = self.launch
        return launch.nodes[(rank % launch.world_size) // launch.ranks_per_node]


@dataclass
class _Run:
    generations: dict[int, SimulatedGeneration] = field(default_factory=dict)
    launches: list[float] = field(default_factory=list)  # when each launch reached the cluster
    endings: list[tuple[float, str]] = field(default_factory=list)  # when each generation's end was reported, and what
    kept: list[tuple[float, float]] = field(default_factory=list)  # when ranks took up each interval, its seconds

    def uptime(self) -> float:
        """Seconds the run's ranks have trained, over every generation so far."""
        return sum(g.trained_seconds for g in self.generations.values())


class SimulatedCluster:
    """The runs on the simulated nodes and their generations. Every change sets `changed` (then
    replaces it), which is what the simulated activities wait on."""

    def __init__(
        self,
        nodes: list[str],
        schedule: Schedule,
        *,
        step_seconds: float = 0.001,
        startup_seconds: float = 0.0,
        rejoin_seconds: float | None = None,
        checkpoint_blocking_seconds: float = 0.0005,
        detect_after: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # The clock must be the Temporal server's: the workflow subtracts its own times from these.
        # The time-skipping test server keeps real time while any activity is outstanding, and a
        # run always has one, so `time.time` is its clock for a whole run.
        self.nodes = list(nodes)
        self.schedule = schedule
        self.step_seconds = step_seconds
        self.startup_seconds = startup_seconds
        self.rejoin_seconds = startup_seconds if rejoin_seconds is None else rejoin_seconds
        self.detect_after = dict(detect_after or {})
        self.defective: set[str] = set()  # nodes with an SDC they repeat (Fault.lasting)
        self.self_tests: list[tuple[float, str, bool]] = []  # when, which node, whether it passed
        self.holds: list[float] = []  # when each hold command reached a run (a drain, a pause, an eviction)
        self.blocking_seconds = checkpoint_blocking_seconds
        self.clock = clock
        self.changed = asyncio.Event()
        self.marks: list[tuple[float, str]] = []  # (when, what) of every interruption and finding reported
        self._runs: dict[str, _Run] = {}

    def launch(self, launch: Launch) -> SimulatedGeneration:
        """Plan the generation `launch` starts (a retried launch gets the same plan)."""
        run = self._runs.setdefault(launch.run_id, _Run())
        if (planned := run.generations.get(launch.generation)) is not None:
            return planned
        env = launch.env
        if launch.rejoin:  # the survivors held at a step of the last generation and go on from it
            held = run.generations[max(run.generations)].hold_step
            assert held is not None, "a rejoin follows a hold"
            resume = held
        elif resume_from := env.get("STAYALIVE_RESUME_FROM"):
            resume = parse_checkpoint_dirname(resume_from.rstrip("/").rsplit("/", 1)[-1])[0]
        else:
            resume = 0
        every = int(env.get("STAYALIVE_CHECKPOINT_EVERY_STEPS", "0")) or round(
            float(env.get("STAYALIVE_CHECKPOINT_EVERY_SECONDS", "0")) / self.step_seconds
        )
        step_seconds = self.schedule.pace(launch.generation) or self.step_seconds
        faults = [
            *self.schedule.plan(launch.generation, run.uptime(), step_seconds),
            *self._defects(launch, step_seconds),
        ]
        planned = run.generations[launch.generation] = SimulatedGeneration(
            launch=launch,
            directory=env["STAYALIVE_CHECKPOINT_DIR"],
            resume_step=resume,
            target=int(env["STAYALIVE_TARGET_STEP"]),
            faults=sorted(faults, key=lambda f: f.after_steps),
            every=every,
            first_step_at=self.clock() + (self.rejoin_seconds if launch.rejoin else self.startup_seconds),
            step_seconds=step_seconds,
            blocking_seconds=self.blocking_seconds,
            detect_after=self.detect_after,
            first_of_run=not any(g.checkpoint_steps() for g in run.generations.values()),
            launched_at=self.clock(),
        )
        run.launches.append(self.clock())
        run.kept.append((self.clock(), every * step_seconds))
        self.notify()
        return planned

    def _defects(self, launch: Launch, step_seconds: float) -> list[Fault]:
        """A defective node back in a run corrupts a step again, DEFECT_REPEATS_AFTER_S in."""
        after = max(1, round(DEFECT_REPEATS_AFTER_S / step_seconds))
        return [
            Fault("sdc", after, rank=i * launch.ranks_per_node, lasting=True)
            for i, node in enumerate(launch.nodes)
            if node in self.defective
        ]

    def self_test(self, node: str) -> bool:
        """A node passes its self-test unless its SDC is one it repeats."""
        passed = node not in self.defective
        self.self_tests.append((self.clock(), node, passed))
        return passed

    def generation(self, run_id: str, number: int) -> SimulatedGeneration | None:
        run = self._runs.get(run_id)
        return run.generations.get(number) if run else None

    def generations(self, run_id: str) -> list[SimulatedGeneration]:
        run = self._runs.get(run_id)
        return [run.generations[n] for n in sorted(run.generations)] if run else []

    def current(self, run_id: str) -> SimulatedGeneration | None:
        run = self._runs.get(run_id)
        return run.generations[max(run.generations)] if run and run.generations else None

    def command(self, run_id: str, command: Command) -> int:
        """A command reaches the current generation's ranks; they act on it at the next step."""
        generation = self.current(run_id)
        if generation is None:
            return 0
        next_step = generation.step_at(self.clock()) + 1
        kind = command.kind
        if kind == "hold" and generation.hold_step is None:
            generation.hold_step = max(next_step, generation.resume_step + 1)
            self.holds.append(self.clock())
        elif kind == "checkpoint":
            generation.forced.add(next_step)
        elif kind == "rebalance":
            generation.commands += 1
        elif kind == "interval" and command.seconds is not None:
            every = max(1, round(command.seconds / generation.step_seconds))
            generation.retuned.append((next_step, every))
            self._runs[run_id].kept.append((self.clock(), every * generation.step_seconds))
        self.notify()
        return generation.launch.world_size

    def kept_intervals(self, run_id: str) -> list[tuple[float, float]]:
        """When the run's ranks took up each checkpoint interval (at a launch or by a command), and
        its seconds, as they count it (whole steps)."""
        run = self._runs.get(run_id)
        return list(run.kept) if run else []

    def ended(self, run_id: str, what: str) -> None:
        """A monitor reported how its generation ended (for the time from a failure to the next
        launch); a failure is also marked as an interruption."""
        self._runs[run_id].endings.append((self.clock(), what))
        if what in ENDED:
            self.mark(what)

    def mark(self, what: str) -> None:
        """Something happened that the workflow must deal with: a benchmark counts what each cost."""
        self.marks.append((self.clock(), what))

    def relaunch_latencies(
        self, run_id: str, kinds: tuple[str, ...] = ("rank_failed", "node_lost", "sdc")
    ) -> list[float]:
        """Seconds from each failure of these kinds, as the monitor reported it, to the next launch."""
        run = self._runs.get(run_id)
        if run is None:
            return []
        return [
            next(t - at for t in run.launches if t >= at)
            for at, what in run.endings
            if what in kinds and any(t >= at for t in run.launches)
        ]

    def notify(self) -> None:
        """Wake every wait on the cluster (sim/activities.until)."""
        self.changed.set()
        self.changed = asyncio.Event()
