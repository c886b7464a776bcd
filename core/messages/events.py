"""What the run monitor tells its workflow, by signal, when the workflow has a decision to make: how
a generation ended (a rank failed, a node fell silent, every rank finished or holds), what the
detectors found, and each checkpoint's verdict."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field

from stayalive.core.judgement.detectors import HANG_STARTUP_S
from stayalive.core.judgement.diagnosis import Verdict
from stayalive.core.judgement.gpu_faults import GpuFault
from stayalive.core.protocol.telemetry import Anomaly, SdcCheck
from stayalive.core.run.status import CheckpointRecord, Outage, Progress
from stayalive.core.run.timeline import Classification

# What a rank prints when a collective failed because a peer went away: it died of someone else's
# failure, so it is a witness, not the culprit.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe", "Socket Timeout")


class KeeperInput(BaseModel):
    """The run monitor's checkpoint keeper: judge each checkpoint the generation commits, and delete
    what retention (core/decisions/retention.py) no longer needs."""

    root: str
    checkpoints: list[CheckpointRecord]  # the run's records not yet deleted, as the workflow has them
    verified_step: int = 0  # the SDC watermark
    started_at: datetime  # retention's six-hour milestones count from the run's start
    sdc_check_steps: float
    checkpoint_steps: float  # the interval this generation's ranks were given, in steps
    validation: list[str] = []  # CheckpointSpec.validation: the user's own check, after stayalive's
    # The run's target, where this generation writes its checkpoint (None where it resumed from that
    # one): once every rank has finished there, the monitor waits for that checkpoint's verdict.
    final_step: int | None = None


class MonitorInput(BaseModel):
    """One generation, as the run monitor watches it. Where the monitor is in each node's stream is
    not here: every node agent keeps its readers' places (core.protocol.telemetry.Subscribe)."""

    run_id: str
    generation: int
    nodes: list[str]  # the group, in rank order
    ranks_per_node: int
    hooks: bool = True  # False: a plain script, with no telemetry: only exits and silent nodes
    resume_step: int = 0
    await_first_step: bool = False
    node_silence: float = 15.0  # a node agent silent this long is gone (HealthSpec.node_heartbeat_timeout)
    exit_grace: float = 30.0  # the others' time to exit once a rank has finished (HealthSpec.exit_grace)
    # Detection: the progress watchdog, the straggler checks, and what is already known (not re-reported).
    step_timeout: float | None = None  # None: auto, 3 × p99 of step times with a floor
    startup_timeout: float = HANG_STARTUP_S  # until the generation's first step (HealthSpec.startup_timeout)
    known_step_s: float | None = None  # the run's slowest recent step before this generation (auto's warm-up)
    straggler_sigma: float = 3.0
    straggler_steps: int = 20
    baseline: list[float] = []  # healthy window medians of this configuration (the absolute check)
    known_stragglers: list[int] = []
    slowdown_known: bool = False
    healthy_windows: int = 10  # report this many healthy window medians at a time (for the baseline)
    tally_s: float = 30.0  # how often a known straggler's or slowdown's cost is reported (SlownessTally)
    progress_s: float = 30.0  # how often the live numbers are reported when nothing else was (ProgressRefresh)
    keeper: KeeperInput | None = None  # judge the generation's checkpoints too
    storage_outage: Outage | None = None  # storage was away when the generation started (until a commit)
    restored_from: Literal["memory", "storage"] | None = None  # what its ranks resumed from, once they said so

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.ranks_per_node


class FirstStep(BaseModel):
    kind: Literal["first_step"] = "first_step"
    step: int
    at: float
    restored_from: Literal["memory", "storage"] | None = None
    progress: Progress


class Hang(BaseModel):
    """No step completed within the timeout, and no rank died: someone is alive and stuck."""

    kind: Literal["hang"] = "hang"
    step: int
    stalled_s: float
    timeout_s: float
    at: float
    progress: Progress


class StragglerFound(BaseModel):
    """One rank's compute time stands out from its peers' for `straggler_steps` steps (relative check)."""

    kind: Literal["straggler"] = "straggler"
    rank: int
    node: str
    step: int
    ratio: float
    z: float
    verdict: Verdict | None  # None: no GPU telemetry from the node yet
    rack: str | None = None  # from the node's GPU telemetry
    progress: Progress


class SlowdownFound(BaseModel):
    """The whole run is slower than healthy runs of its configuration (absolute check)."""

    kind: Literal["slowdown"] = "slowdown"
    step: int
    ratio: float
    window_median: float
    baseline_median: float
    verdicts: dict[str, Verdict]  # per node of the run
    progress: Progress


class GpuFailed(BaseModel):
    """NVML saw GPUs of a node fail without getting slow (core/judgement/gpu_faults.py): the node is
    cordoned as a crashed one is, drained at an agreed step while every GPU still computes."""

    kind: Literal["gpu_failed"] = "gpu_failed"
    node: str
    faults: list[GpuFault]
    progress: Progress

    @property
    def steps_on(self) -> bool:
        """Every failed GPU still computes: the run can hold at a step and drain the node."""
        return all(f.steps_on for f in self.faults)

    def detail(self) -> str:
        return "; ".join(f.detail for f in self.faults)


def ends_generation(event: MonitorEvent | None) -> bool:
    """What the run cannot step past: a failed rank, a silent node, a hang, corruption, a GPU that no
    longer computes. (A GPU that still does is cordoned by a drain at an agreed step.)"""
    return isinstance(event, RankFailed | NodeLost | Hang | SdcDetected) or (
        isinstance(event, GpuFailed) and not event.steps_on
    )


class HealthyWindows(BaseModel):
    """Step-time window medians of a stretch with nothing flagged: what the fleet's baseline learns."""

    kind: Literal["healthy"] = "healthy"
    medians: list[float]
    progress: Progress


class SlownessTally(BaseModel):
    """While a straggler or slowdown is known: what it has cost since the monitor's last report
    (`progress.straggler_s`), every `tally_s`. The ledger's straggler loss and the S1→S4 ladder's
    rent both read it; history grows by one signal per tally, and only while something is slow."""

    kind: Literal["tally"] = "tally"
    progress: Progress


class ProgressRefresh(BaseModel):
    """The live numbers (step, loss, step times, slowest rank), when the monitor has reported nothing
    for `progress_s` while the ranks stepped: what keeps `health` fresh. History grows by one signal
    per `progress_s` of training, never per step."""

    kind: Literal["progress"] = "progress"
    progress: Progress


class SdcDetected(BaseModel):
    """A silent-data-corruption check failed: every rank halted before applying the step's update."""

    kind: Literal["sdc"] = "sdc"
    check: SdcCheck
    progress: Progress


class AnomalyFound(BaseModel):
    """A step's update was skipped (a non-finite loss or gradient, a gradient spike); training went on."""

    kind: Literal["anomaly"] = "anomaly"
    anomaly: Anomaly
    progress: Progress


class StorageOutage(BaseModel):
    """Checkpoint storage is away and training goes on: a rank's write failed (`began`), the outage
    outlasted paging's bound (`lasting`, with the page), or a checkpoint committed again (`over`)."""

    kind: Literal["storage"] = "storage"
    phase: Literal["began", "lasting", "over"]
    outage: Outage
    at: float  # when this phase was seen (seconds since the epoch)
    landed_step: int | None = None  # over: the checkpoint whose commit ended it
    paging: Classification | None = None  # lasting
    progress: Progress

    @property
    def lasted_s(self) -> float:
        return max(0.0, self.at - self.outage.since)


class RankFailed(BaseModel):
    """A rank of the generation exited with an error (its node agent reaped it). When it died of a
    lost peer, the monitor first waits for the rank or node that actually failed."""

    kind: Literal["rank_failed"] = "rank_failed"
    node: str
    generation: int
    rank: int
    exit_code: int
    last_step: int | None
    at: float
    log_tail: str = ""
    progress: Progress

    @property
    def peer_lost(self) -> bool:
        return any(marker in self.log_tail for marker in _PEER_LOST)


class NodeLost(BaseModel):
    """A node agent fell silent (dead host, partition, killed agent), or never answered a launch."""

    kind: Literal["node_lost"] = "node_lost"
    node: str
    detail: str
    progress: Progress = Progress()


# The signal that carries a CheckpointJudged from the run monitor's keeper to its RunWorkflow.
CHECKPOINT_JUDGED = "checkpoint_judged"


class CheckpointJudged(BaseModel):
    """A checkpoint the generation committed, with the keeper's verdict, and what retention deleted."""

    generation: int
    checkpoint: CheckpointRecord
    deleted: list[str]  # checkpoint directories retention dropped


class RanksFinished(BaseModel):
    """Every rank of the generation exited cleanly, or some did and the rest outstayed the exit
    grace (`lingering`: they are stopped with the run). The monitor ends with it once the keeper has
    judged the final checkpoint (KeeperInput.final_step), and carries the verdict, as AllHeld does."""

    kind: Literal["finished"] = "finished"
    generation: int
    last_step: int | None
    progress: Progress
    lingering: list[int] = []
    grace_s: float = 0.0
    judged: CheckpointJudged | None = None


class AllHeld(BaseModel):
    """Every rank finished the same step, checkpointed it, and holds, touching no collective. The
    monitor ends with it once the keeper has judged that checkpoint, and carries the verdict."""

    kind: Literal["held"] = "held"
    step: int
    judged: CheckpointJudged | None
    progress: Progress


class Quiet(BaseModel):
    """Nothing is due before `until` (seconds since the epoch, on the server's clock): the monitor
    stops, and the workflow waits on a timer, not an activity, until then or until it sends the ranks
    a command, then watches again. A watch with nothing outstanding is one a time-skipping server can
    skip through (the simulator's month); the real monitor never needs it."""

    kind: Literal["quiet"] = "quiet"
    until: float
    progress: Progress


MonitorEvent = Annotated[
    Union[  # noqa: UP007
        FirstStep,
        Hang,
        StragglerFound,
        SlowdownFound,
        GpuFailed,
        HealthyWindows,
        SlownessTally,
        ProgressRefresh,
        SdcDetected,
        AnomalyFound,
        StorageOutage,
        RankFailed,
        NodeLost,
        RanksFinished,
        AllHeld,
        Quiet,
    ],
    Field(discriminator="kind"),
]

# The signal that carries a MonitorReport from the run monitor to its RunWorkflow.
MONITOR_REPORT = "monitor_report"


class MonitorReport(BaseModel):
    """One thing the run monitor found in a generation, sent to the workflow as a signal, or what it
    completed with. A completion may bring what the monitor found before it and did not signal (a
    quiet monitor's first step and verdicts): the workflow takes those in first."""

    generation: int
    event: MonitorEvent
    first_step: FirstStep | None = None
    verdicts: list[CheckpointJudged] = []
