"""The simulated cluster: what the simulated activities (sim/activities.py) answer from. Plain Python,
in memory, on one event loop; no Temporal, no processes, no files.

A generation is planned when its ranks are launched, from the launch itself, the way a rank reads
it: it resumes from the checkpoint the launch names, checkpoints as often as the launch asks, and
ends where the failure schedule says (a rank crashes) or at the target step. Step `s` completes at
`first_step_at + (s - resume - 1) * step_seconds`, on the cluster's clock.

The simulation stays in lockstep with the workflow: a generation reports its end only once the
workflow has its first step and every checkpoint it committed, which the simulated monitor knows
when the workflow run accepted its signal (a signal in history comes before the crash report that
follows it, and a verdict signalled as a run continues-as-new is carried to the next one). So the
timeline the workflow records is exactly the one the schedule describes, however the activities
interleave.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from core.events import RankFailed, RanksFinished
from core.fleet import EvictionOutcome, Quarantine
from core.fleet_requests import Grant
from core.launch import NodeLaunch
from core.run import CheckpointRecord, Progress
from training.checkpoint import checkpoint_dirname, parse_checkpoint_dirname
from training.supervision import SupervisionConfig

# The key of the checkpoint cursor: the sequence number of the last checkpoint the workflow has.
CURSOR = "sim"


@dataclass(frozen=True)
class RankCrash:
    """A rank's process exits `after_steps` steps past its generation's resume step."""

    rank: int
    after_steps: int
    exit_code: int = 137


@dataclass(frozen=True)
class FailureSchedule:
    """Which generations lose a rank, and where. Every generation not listed runs to the target step."""

    crashes: Mapping[int, RankCrash] = field(default_factory=dict)

    @classmethod
    def crash_every_generation(cls, count: int, after_steps: int, world_size: int) -> FailureSchedule:
        """Generations 0 … count-1 each lose one rank `after_steps` past their resume step (ranks 0, 1,
        2 … in turn, so every node position fails); generation `count` finishes the run."""
        return cls({g: RankCrash(rank=g % world_size, after_steps=after_steps) for g in range(count)})

    def crash_in(self, generation: int) -> RankCrash | None:
        return self.crashes.get(generation)


@dataclass
class SimulatedGeneration:
    run_id: str
    number: int
    directory: str  # the run's checkpoint directory
    resume_step: int
    last_step: int  # the last step it completes
    crash: RankCrash | None  # None: it finishes, and `last_step` is the target
    checkpoints: dict[int, int]  # cursor sequence number → step, in the order they commit
    first_step_at: float
    step_seconds: float
    blocking_seconds: float
    first_step_taken: bool = False  # the workflow has recorded the first step

    def at(self, step: int) -> float:
        """When `step` completes."""
        return self.first_step_at + (step - self.resume_step - 1) * self.step_seconds

    @property
    def ends_at(self) -> float:
        return self.at(self.last_step)

    def committed_at(self, step: int) -> float:
        return self.at(step) + self.blocking_seconds

    def checkpoint_after(self, cursor: int) -> tuple[int, int] | None:
        """The first checkpoint of this generation the workflow has not recorded: (sequence, step)."""
        return next(((seq, step) for seq, step in self.checkpoints.items() if seq > cursor), None)

    def checkpoint(self, step: int) -> CheckpointRecord:
        return CheckpointRecord(
            step=step,
            path=f"{self.directory}/{checkpoint_dirname(step, self.number)}",
            generation=self.number,
            blocking_seconds=self.blocking_seconds,
            written_at=datetime.fromtimestamp(self.committed_at(step), UTC),
            validated=True,
            reason="simulated: every checkpoint is valid",
        )

    def first_step(self) -> Progress:
        return Progress(
            step=self.resume_step + 1,
            steps_per_second=1 / self.step_seconds,
            step_seconds_p50=self.step_seconds,
            step_seconds_max=self.step_seconds,
            at=self.first_step_at,
        )

    def outcome(self, node: str, ranks: list[int]) -> RankFailed | RanksFinished | None:
        """What `node`'s agent reports at the end. None: its ranks outlive the generation (another node's
        rank crashed, and the workflow stops watching them)."""
        if self.crash is None:
            return RanksFinished(node=node, generation=self.number, last_step=self.last_step)
        if self.crash.rank not in ranks:
            return None
        return RankFailed(
            node=node,
            generation=self.number,
            rank=self.crash.rank,
            exit_code=self.crash.exit_code,
            last_step=self.last_step,
            at=self.ends_at,
            log_tail=f"simulated crash of rank {self.crash.rank} after step {self.last_step}",
        )


@dataclass
class _Run:
    generations: dict[int, SimulatedGeneration] = field(default_factory=dict)
    recorded: int = 0  # the sequence number of the last checkpoint the workflow run accepted
    next_checkpoint: int = 1  # the sequence number of the next checkpoint committed


class SimulatedCluster:
    """Nodes, the runs on them and their generations. Every change sets `changed` (then replaces it),
    which is what the simulated activities wait on."""

    def __init__(
        self,
        nodes: list[str],
        schedule: FailureSchedule,
        *,
        step_seconds: float = 0.001,
        startup_seconds: float = 0.0,
        checkpoint_blocking_seconds: float = 0.0005,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # The clock must be the Temporal server's: the workflow subtracts its own times from these.
        # The time-skipping test server keeps real time while any activity is outstanding, and a
        # run always has one, so `time.time` is its clock for a whole run.
        self.schedule = schedule
        self.step_seconds = step_seconds
        self.startup_seconds = startup_seconds
        self.blocking_seconds = checkpoint_blocking_seconds
        self.clock = clock
        self.nodes = list(nodes)
        self.holders: dict[str, str | None] = dict.fromkeys(nodes)  # node → the run holding it
        self.quarantines: list[Quarantine] = []
        self.suspects: list[tuple[str, str]] = []  # (node, reason), as detectors flagged them
        self.evictions: list[EvictionOutcome] = []  # what the fleet learned of straggler evictions
        self.baselines: dict[str, list[float]] = {}  # config digest → healthy window medians
        self.changed = asyncio.Event()
        self._runs: dict[str, _Run] = {}

    # -- ranks -----------------------------------------------------------------------------------

    def launch(self, launch: NodeLaunch) -> SimulatedGeneration:
        """Plan the generation `launch` starts; every other node of it (and a re-attach after
        continue-as-new) gets the same plan."""
        run = self._runs.setdefault(launch.run_id, _Run())
        if (planned := run.generations.get(launch.generation)) is not None:
            return planned
        config = SupervisionConfig.from_env(launch.env)
        resume = parse_checkpoint_dirname(config.resume_from.name)[0] if config.resume_from else 0
        crash = self.schedule.crash_in(launch.generation)
        if crash is not None and resume + crash.after_steps < config.target_step:
            crash, last = replace(crash, rank=crash.rank % launch.world_size), resume + crash.after_steps
        else:
            crash, last = None, config.target_step
        every = config.every_steps or round((config.every_seconds or 0.0) / self.step_seconds)
        steps = list(range((resume // every + 1) * every, last + 1, every)) if every > 0 else []
        if crash is not None:
            steps = [s for s in steps if s < last]  # the checkpoint of the step it dies in never commits
        elif last not in steps:
            steps.append(last)  # ranks checkpoint the target step before they exit
        checkpoints = dict(enumerate(steps, start=run.next_checkpoint))
        run.next_checkpoint += len(steps)
        planned = run.generations[launch.generation] = SimulatedGeneration(
            run_id=launch.run_id,
            number=launch.generation,
            directory=str(config.checkpoint_dir),
            resume_step=resume,
            last_step=last,
            crash=crash,
            checkpoints=checkpoints,
            first_step_at=self.clock() + self.startup_seconds,
            step_seconds=self.step_seconds,
            blocking_seconds=self.blocking_seconds,
        )
        self.notify()
        return planned

    def generation(self, run_id: str, number: int) -> SimulatedGeneration | None:
        run = self._runs.get(run_id)
        return run.generations.get(number) if run else None

    def take_first_step(self, generation: SimulatedGeneration) -> None:
        generation.first_step_taken = True
        self.notify()

    def take_checkpoints(self, run_id: str, cursor: int) -> None:
        """The workflow has every checkpoint up to `cursor`."""
        run = self._runs.setdefault(run_id, _Run())
        if cursor > run.recorded:
            run.recorded = cursor
            self.notify()

    def caught_up(self, generation: SimulatedGeneration) -> bool:
        """The workflow has recorded everything the generation reported before its end."""
        recorded = self._runs[generation.run_id].recorded
        return generation.first_step_taken and all(seq <= recorded for seq in generation.checkpoints)

    # -- the fleet: quarantined nodes pass their self-test at once and are free again ---------------

    def acquire(self, run_id: str, wanted: list[str]) -> Grant:
        granted, refused = [], {}
        for node in wanted:
            if node not in self.holders:
                refused[node] = f"{node} is not a node of the simulated cluster"
            elif self.holders[node] not in (None, run_id):
                refused[node] = f"{node} is running {self.holders[node]}"
            else:
                self.holders[node] = run_id
                granted.append(node)
        return Grant(granted=granted, refused=refused)

    def quarantine(self, run_id: str, node: str, reason: str) -> Quarantine:
        now = datetime.fromtimestamp(self.clock(), UTC)
        record = Quarantine(node=node, reason=reason, since=now, run_ids_affected=[run_id], released_at=now)
        self.quarantines.append(record)
        self.holders[node] = None
        return record

    def take_spare(self, run_id: str, candidates: list[str]) -> str | None:
        # As the fleet's: a candidate this run holds was taken by an earlier attempt of the same request.
        spare = next((n for n in candidates if n in self.holders and self.holders[n] in (None, run_id)), None)
        if spare is not None:
            self.holders[spare] = run_id
        return spare

    def release(self, run_id: str) -> list[str]:
        released = sorted(n for n, holder in self.holders.items() if holder == run_id)
        for node in released:
            self.holders[node] = None
        return released

    def notify(self) -> None:
        """Wake every wait on the cluster (sim/activities.until)."""
        self.changed.set()
        self.changed = asyncio.Event()
