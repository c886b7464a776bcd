"""The fault plan: failures a run injects into itself, for tests, the demo and benchmarks.

Each fault fires in one generation (the launch it belongs to, 0 = the first), so that re-running
the same steps after a restart does not crash again; `generation: null` fires in every generation,
which is how a deterministic failure (a bad batch, a code bug) looks.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stayalive.core.judgement.diagnosis import GpuHealth


class _Fault(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: int | None = Field(default=0, ge=0)

    def fires_in(self, generation: int) -> bool:
        return self.generation is None or self.generation == generation


class Crash(_Fault):
    """The rank's process exits abruptly (as on an OOM kill or a GPU fell off the bus): in the middle
    of a step, or while its checkpoint writer is halfway through the shard of `at_step`."""

    kind: Literal["crash"] = "crash"
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)
    during: Literal["step", "checkpoint_write"] = "step"
    exit_code: int = Field(default=137, ge=1, le=255)

    def __str__(self) -> str:
        where = "" if self.during == "step" else " while writing its checkpoint"
        return f"crash of rank {self.rank} at step {self.at_step}{where}"


class Hang(_Fault):
    """The rank blocks inside a collective its peers never join (a wedged NIC, a deadlock): alive,
    no progress, every peer waiting in the all-reduce."""

    kind: Literal["hang"] = "hang"
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)

    def __str__(self) -> str:
        return f"hang of rank {self.rank} at step {self.at_step}"


class CollectiveHang(_Fault):
    """The rank's gradient all-reduce of `at_step` never completes, and it stalls at the very call
    site its peers wait in, so every rank's Python stack is the same. `before`: it never issues
    the collective (an enqueue wedged in the driver); its peers enter it and wait. `inside`: it
    enters, and its contribution is lost on the way (a link that drops it): every rank waits in the
    same collective and nothing tells them apart."""

    kind: Literal["collective_hang"] = "collective_hang"
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)
    where: Literal["before", "inside"] = "before"

    def __str__(self) -> str:
        return f"rank {self.rank}'s all-reduce of step {self.at_step} never completes ({self.where} it)"


class Straggler(_Fault):
    """The rank computes `factor`× slower from `from_step` on (a throttled GPU): slow, never wrong."""

    kind: Literal["straggler"] = "straggler"
    rank: int = Field(ge=0)
    factor: float = Field(gt=1.0)
    from_step: int = Field(default=1, ge=1)

    def __str__(self) -> str:
        return f"rank {self.rank} {self.factor:g}× slower from step {self.from_step}"


class Slowdown(_Fault):
    """Every rank computes `factor`× slower from `from_step` on (a hot aisle): no rank stands out."""

    kind: Literal["slowdown"] = "slowdown"
    factor: float = Field(gt=1.0)
    from_step: int = Field(default=1, ge=1)

    def __str__(self) -> str:
        return f"every rank {self.factor:g}× slower from step {self.from_step}"


class BitFlip(_Fault):
    """One bit of one element of the rank's gradient flips after backward (a transient SDC)."""

    kind: Literal["bitflip"] = "bitflip"
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)
    bit: int = Field(default=22, ge=0, le=31)  # 22: the top mantissa bit, a value off by up to half

    def __str__(self) -> str:
        return f"a bit flips in rank {self.rank}'s gradient at step {self.at_step}"


class WeightFlip(_Fault):
    """One bit of one element of the rank's weights flips before the update (a memory fault): from
    then on its data-parallel replica differs from every other rank's."""

    kind: Literal["weightflip"] = "weightflip"
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)
    bit: int = Field(default=22, ge=0, le=31)

    def __str__(self) -> str:
        return f"a bit flips in rank {self.rank}'s weights at step {self.at_step}"


class FlakyRank(_Fault):
    """The rank's GPU flips a gradient bit with `probability` each step (an intermittent SDC)."""

    kind: Literal["flaky"] = "flaky"
    rank: int = Field(ge=0)
    probability: float = Field(gt=0.0, le=1.0)
    bit: int = Field(default=22, ge=0, le=31)

    def __str__(self) -> str:
        return f"rank {self.rank} flips a gradient bit with probability {self.probability:g} per step"


class WrongRank(_Fault):
    """The rank computes the same wrong answer every time: one activation scaled by 1 + ε."""

    kind: Literal["wrong"] = "wrong"
    rank: int = Field(ge=0)
    epsilon: float = Field(default=1e-3, gt=0.0)

    def __str__(self) -> str:
        return f"rank {self.rank} deterministically wrong by {self.epsilon:g}"


class NanLoss(_Fault):
    """The rank's loss of `at_step` is NaN (an overflow, a bad sample): every gradient it yields is too."""

    kind: Literal["nan_loss"] = "nan_loss"
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)

    def __str__(self) -> str:
        return f"NaN in rank {self.rank}'s loss at step {self.at_step}"


class GradSpike(_Fault):
    """The rank's gradient of `at_step` is `factor`× too large (a loss spike, a corrupted activation)."""

    kind: Literal["grad_spike"] = "grad_spike"
    rank: int = Field(ge=0)
    at_step: int = Field(ge=1)
    factor: float = Field(default=1000.0, gt=1.0)

    def __str__(self) -> str:
        return f"rank {self.rank}'s gradient ×{self.factor:g} at step {self.at_step}"


class CorruptCheckpoint(_Fault):
    """Storage damages the checkpoint of `at_step` right after it is committed (bit rot, a torn write,
    a lost file), before validation sees it."""

    kind: Literal["corrupt_checkpoint"] = "corrupt_checkpoint"
    at_step: int = Field(ge=1)
    damage: Literal["truncate_shard", "flip_byte", "delete_shard", "delete_manifest", "edit_manifest"]
    shard: int = Field(default=0, ge=0)

    def __str__(self) -> str:
        return f"{self.damage.replace('_', ' ')} in the checkpoint of step {self.at_step}"


class _StorageFault(_Fault):
    """Checkpoint storage fails for `seconds`, from the moment half of the shard of `at_step` is written."""

    at_step: int = Field(ge=1)
    seconds: float = Field(gt=0.0)


class StorageOutage(_StorageFault):
    """The run's checkpoint directory is unreachable (a dropped mount): every path under it fails
    with ENOENT for every process, the supervisor's validation included. Rank 0's writer takes it
    away and brings it back: the directory is shared, so one process must."""

    kind: Literal["storage_outage"] = "storage_outage"

    def __str__(self) -> str:
        return f"checkpoint storage unreachable for {self.seconds:g}s from step {self.at_step}"


class DiskFull(_StorageFault):
    """Storage is full: every write of a checkpoint file fails with ENOSPC, on every rank; reads work."""

    kind: Literal["disk_full"] = "disk_full"

    def __str__(self) -> str:
        return f"checkpoint storage full for {self.seconds:g}s from step {self.at_step}"


class BrokenNode(_Fault):
    """The node's hardware is bad in a way its self-test sees: the GEMM unit returns a wrong element,
    its memory a flipped bit (the check runs on GPU hosts), or its collectives a wrong value. It
    stays bad for the rest of the node agent's life."""

    kind: Literal["broken_node"] = "broken_node"
    node: str
    part: Literal["gemm", "memory", "collective"] = "gemm"

    def __str__(self) -> str:
        return f"broken {self.part} on {self.node}"


class _TelemetryFault(_Fault):
    """Where a telemetry fault shows: one node or every node of a rack (a hot aisle); one GPU or all."""

    generation: int | None = None  # hardware state: it shows in every generation
    node: str | None = None
    rack: str | None = None
    gpu: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one_target(self) -> _TelemetryFault:
        if (self.node is None) == (self.rack is None):
            raise ValueError("name either the node or the rack the fault is on")
        return self

    def hits(self, reading: GpuHealth) -> bool:
        where = reading.node == self.node if self.node is not None else reading.rack == self.rack
        return where and (self.gpu is None or self.gpu == reading.gpu)

    def apply(self, reading: GpuHealth) -> GpuHealth:
        raise NotImplementedError


class ThermalThrottle(_TelemetryFault):
    """The GPU overheats and its clocks are held down: a failed fan, dried paste, or (on a rack) a
    cooling failure."""

    kind: Literal["thermal"] = "thermal"
    temperature_c: float = 92.0

    def apply(self, reading: GpuHealth) -> GpuHealth:
        reasons = reading.throttle_reasons | {"thermal"}
        return reading.model_copy(update={"temperature_c": self.temperature_c, "throttle_reasons": reasons})


class HotAmbient(_TelemetryFault):
    """Hot, but within what the GPU tolerates: no throttling (a lead, not a verdict: docs/architecture.md §11)."""

    kind: Literal["hot_ambient"] = "hot_ambient"
    temperature_c: float = 88.0

    def apply(self, reading: GpuHealth) -> GpuHealth:
        return reading.model_copy(update={"temperature_c": self.temperature_c})


class PowerCap(_TelemetryFault):
    """The GPU is held at a power limit below its normal one (a derated supply, a rack power budget)."""

    kind: Literal["power_cap"] = "power_cap"
    power_limit_w: float = 450.0

    def apply(self, reading: GpuHealth) -> GpuHealth:
        reasons = reading.throttle_reasons | {"power_cap"}
        update = {"power_w": self.power_limit_w, "power_limit_w": self.power_limit_w, "throttle_reasons": reasons}
        return reading.model_copy(update=update)


class EccErrors(_TelemetryFault):
    """Memory errors: corrected ones (absorbed, a warning) and uncorrectable ones (a failing GPU)."""

    kind: Literal["ecc"] = "ecc"
    corrected: int = Field(default=0, ge=0)
    uncorrected: int = Field(default=1, ge=0)

    def apply(self, reading: GpuHealth) -> GpuHealth:
        update = {
            "ecc_corrected": (reading.ecc_corrected or 0) + self.corrected,
            "ecc_uncorrected": (reading.ecc_uncorrected or 0) + self.uncorrected,
        }
        return reading.model_copy(update=update)


class NvlinkDegraded(_TelemetryFault):
    """Links down (the GPU runs at reduced NVLink width) and/or retransmissions on the links up."""

    kind: Literal["nvlink"] = "nvlink"
    links_down: int = Field(default=2, ge=0)
    errors: int = Field(default=0, ge=0)

    def apply(self, reading: GpuHealth) -> GpuHealth:
        update = {
            "nvlink_links_up": max(0, (reading.nvlink_links_up or 0) - self.links_down),
            "nvlink_errors": (reading.nvlink_errors or 0) + self.errors,
        }
        return reading.model_copy(update=update)


class GpuLost(_TelemetryFault):
    """The GPU fell off the bus (Xid 79): NVML answers "GPU is lost" for it."""

    kind: Literal["gpu_lost"] = "gpu_lost"

    def apply(self, reading: GpuHealth) -> GpuHealth:
        return reading.model_copy(update={"lost": True})


class RowRemapFailure(_TelemetryFault):
    """A failing HBM row could not be remapped (no spare rows left): the GPU must be replaced."""

    kind: Literal["row_remap"] = "row_remap"

    def apply(self, reading: GpuHealth) -> GpuHealth:
        return reading.model_copy(update={"row_remap_failure": True, "row_remap_pending": True})


class XidError(_TelemetryFault):
    """The driver raises an Xid event (NVML's event API), by default 48: a double-bit ECC error."""

    kind: Literal["xid"] = "xid"
    xid: int = Field(default=48, ge=1)

    def apply(self, reading: GpuHealth) -> GpuHealth:
        return reading.model_copy(update={"xids": (*reading.xids, self.xid)})


class NicSaturated(_TelemetryFault):
    """The node's NIC is near line rate, typically shared with another job's traffic."""

    kind: Literal["nic"] = "nic"
    utilization: float = Field(default=0.97, ge=0.0, le=1.0)

    def apply(self, reading: GpuHealth) -> GpuHealth:
        return reading.model_copy(update={"nic_utilization": self.utilization})


# What the simulated GPU source applies to a reading (agent/gpu.py); a node's hardware is these and a
# broken self-test.
TelemetryFault = (
    ThermalThrottle
    | HotAmbient
    | PowerCap
    | EccErrors
    | NvlinkDegraded
    | GpuLost
    | RowRemapFailure
    | XidError
    | NicSaturated
)
HardwareFault = Annotated[Union[BrokenNode, TelemetryFault], Field(discriminator="kind")]  # noqa: UP007

# Each fault kind joins this union as the detector that catches it lands.
Fault = Annotated[
    Union[  # noqa: UP007
        Crash,
        Hang,
        CollectiveHang,
        Straggler,
        Slowdown,
        BitFlip,
        WeightFlip,
        FlakyRank,
        WrongRank,
        NanLoss,
        GradSpike,
        CorruptCheckpoint,
        StorageOutage,
        DiskFull,
        BrokenNode,
        TelemetryFault,
    ],
    Field(discriminator="kind"),
]

HARDWARE = (
    BrokenNode,
    ThermalThrottle,
    HotAmbient,
    PowerCap,
    EccErrors,
    NvlinkDegraded,
    GpuLost,
    RowRemapFailure,
    XidError,
    NicSaturated,
)
