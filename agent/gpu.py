"""GPU health readings, for the straggler diagnosis (core/judgement/diagnosis.py) and the failures a GPU
shows without getting slow (core/judgement/gpu_faults.py); one interface, two sources:

- `NvmlTelemetry` reads the node's GPUs through NVML (pynvml, from nvidia-ml-py);
- `SimulatedTelemetry` returns healthy readings, changed by the telemetry faults currently injected
  (docs/architecture.md §15), so the whole path from a hot GPU to a verdict runs on a machine without one.

`gpu_telemetry` picks NVML when it initializes and sees a device, else the simulated source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import pynvml
import structlog

from stayalive.core.judgement.diagnosis import GpuHealth, ThrottleReason
from stayalive.core.run.faults import TelemetryFault

log = structlog.get_logger()

T = TypeVar("T")


class GpuTelemetry(Protocol):
    def read(self) -> list[GpuHealth]:
        """One reading of every GPU of this node."""
        ...


# ── NVML ─────────────────────────────────────────────────────────────────────────────────────────────

# Clock-event reasons that cost speed; the rest (idle, application clocks, sync boost, display) don't.
# The "ClocksEvent" and deprecated "ClocksThrottle" masks share their bit values.
THROTTLE_BITS: tuple[tuple[int, ThrottleReason], ...] = (
    (pynvml.nvmlClocksEventReasonSwThermalSlowdown, "thermal"),
    (pynvml.nvmlClocksEventReasonHwThermalSlowdown, "thermal"),
    (pynvml.nvmlClocksEventReasonSwPowerCap, "power_cap"),
    (pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown, "power_brake"),
    (pynvml.nvmlClocksEventReasonHwSlowdown, "hw_slowdown"),
)
# Per-link counters of retransmitted or recovered traffic: each one is bandwidth the collective lost.
LINK_ERROR_COUNTERS = (
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
)
# A field this device, driver or user cannot read is absent from the reading, not a failed reading.
# Anything else (a GPU that fell off the bus: NVMLError_GpuIsLost) is news the caller must hear.
UNAVAILABLE: tuple[type[Exception], ...] = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_NoPermission,
)
# A GPU that fell off the bus answers every call with this: the reading says so, and nothing else.
GPU_LOST: tuple[type[Exception], ...] = (pynvml.NVMLError_GpuIsLost,)
# Asking for a link index past the device's last link answers "invalid argument".
NO_SUCH_LINK: tuple[type[Exception], ...] = (*UNAVAILABLE, pynvml.NVMLError_InvalidArgument)


def throttle_reasons(mask: int) -> frozenset[ThrottleReason]:
    return frozenset(reason for bit, reason in THROTTLE_BITS if mask & bit)


def _optional(call: Callable[..., T], *args: Any) -> T | None:
    try:
        return call(*args)
    except UNAVAILABLE:
        return None


class NvmlTelemetry:
    """This node's GPUs through NVML. The NIC is outside NVML's view: `nic_utilization` stays None.

    `expected_nvlinks` is how many NVLinks each GPU should have up (18 on H100/H200 SXM); by default,
    the links the driver knows of, which misses a link the driver no longer lists at all.
    """

    def __init__(self, node: str, rack: str, expected_nvlinks: int | None = None) -> None:
        pynvml.nvmlInit()  # reference-counted: every nvmlInit is paired with close()'s nvmlShutdown
        self.node, self.rack, self.expected_nvlinks = node, rack, expected_nvlinks
        try:
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError:
            pynvml.nvmlShutdown()
            raise
        self._xid_events = self._listen_for_xids()

    @property
    def count(self) -> int:
        return len(self._handles)

    def close(self) -> None:
        if self._xid_events is not None:
            pynvml.nvmlEventSetFree(self._xid_events)
        pynvml.nvmlShutdown()

    def read(self) -> list[GpuHealth]:
        xids = self._xids()
        readings = []
        for index, handle in enumerate(self._handles):
            try:
                reading = self._read(index, handle)
            except GPU_LOST:
                reading = GpuHealth(node=self.node, rack=self.rack, gpu=index, lost=True)
            readings.append(reading.model_copy(update={"xids": xids.get(index, ())}))
        return readings

    def _listen_for_xids(self) -> object | None:
        """An NVML event set that collects every GPU's critical Xid events (None: no GPU offers them)."""
        try:
            events = pynvml.nvmlEventSetCreate()
        except UNAVAILABLE:
            return None
        listening = 0
        for handle in self._handles:
            with contextlib.suppress(*UNAVAILABLE):
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
                listening += 1
        if listening == 0:
            pynvml.nvmlEventSetFree(events)
            return None
        return events

    def _xids(self) -> dict[int, tuple[int, ...]]:
        """The Xid events raised since the last read, by GPU index (waiting for none)."""
        found: dict[int, tuple[int, ...]] = {}
        while self._xid_events is not None:
            try:
                event = pynvml.nvmlEventSetWait_v2(self._xid_events, 0)
            except pynvml.NVMLError_Timeout:
                break
            index = pynvml.nvmlDeviceGetIndex(event.device)
            found[index] = (*found.get(index, ()), int(event.eventData))
        return found

    def _read(self, index: int, handle: object) -> GpuHealth:
        remapped = _optional(pynvml.nvmlDeviceGetRemappedRows, handle)  # (corrected, uncorrected, pending, failed)
        retired = _optional(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        power_mw = _optional(pynvml.nvmlDeviceGetPowerUsage, handle)
        limit_mw = _optional(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        mask = _optional(pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
        if mask is None:  # drivers before the rename only have the older name
            mask = _optional(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        links_up, links_expected, link_errors = self._nvlinks(handle)
        return GpuHealth(
            node=self.node,
            rack=self.rack,
            gpu=index,
            temperature_c=_optional(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
            power_w=power_mw / 1000 if power_mw is not None else None,
            power_limit_w=limit_mw / 1000 if limit_mw is not None else None,
            throttle_reasons=throttle_reasons(mask) if mask is not None else frozenset(),
            ecc_corrected=self._ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ecc_uncorrected=self._ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            nvlink_links_up=links_up,
            nvlink_links_expected=links_expected,
            nvlink_errors=link_errors,
            pcie_replays=_optional(pynvml.nvmlDeviceGetPcieReplayCounter, handle),
            row_remap_pending=bool(remapped[2]) if remapped is not None else None,
            row_remap_failure=bool(remapped[3]) if remapped is not None else None,
            retired_pages_pending=retired == pynvml.NVML_FEATURE_ENABLED if retired is not None else None,
        )

    @staticmethod
    def _ecc(handle: object, error_type: int) -> int | None:
        # Volatile: since the driver loaded. The aggregate counter also holds errors from before the
        # node's last reboot, which say nothing about the slowdown now.
        return _optional(pynvml.nvmlDeviceGetTotalEccErrors, handle, error_type, pynvml.NVML_VOLATILE_ECC)

    def _nvlinks(self, handle: object) -> tuple[int | None, int | None, int | None]:
        """(links up, links expected, error count summed over links); all None without NVLink."""
        known = up = 0
        errors: int | None = None
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = pynvml.nvmlDeviceGetNvLinkState(handle, link)
            except NO_SUCH_LINK:
                continue
            known += 1
            up += state == pynvml.NVML_FEATURE_ENABLED
            for counter in LINK_ERROR_COUNTERS:
                count = _optional(pynvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter)
                if count is not None:
                    errors = (errors or 0) + count
        if known == 0:
            return None, None, None
        return up, self.expected_nvlinks or known, errors


# ── simulated ────────────────────────────────────────────────────────────────────────────────────────

# An H100/H200 SXM node at work and well: cool, under its power limit, every NVLink up, no errors.
HEALTHY_TEMPERATURE_C = 55.0
HEALTHY_POWER_W = 300.0
POWER_LIMIT_W = 700.0
NVLINKS = 18
HEALTHY_NIC_UTILIZATION = 0.30


def _no_faults() -> Iterable[TelemetryFault]:
    return ()


class SimulatedTelemetry:
    """`gpus` healthy GPUs, with whatever telemetry faults `faults` returns at each read applied in
    order (so the provider can inject and clear faults while a run goes on)."""

    def __init__(
        self, node: str, rack: str, gpus: int = 8, faults: Callable[[], Iterable[TelemetryFault]] = _no_faults
    ) -> None:
        self.node, self.rack, self.gpus, self.faults = node, rack, gpus, faults

    def read(self) -> list[GpuHealth]:
        active = list(self.faults())
        readings = []
        for gpu in range(self.gpus):
            reading = GpuHealth(
                node=self.node,
                rack=self.rack,
                gpu=gpu,
                temperature_c=HEALTHY_TEMPERATURE_C,
                power_w=HEALTHY_POWER_W,
                power_limit_w=POWER_LIMIT_W,
                ecc_corrected=0,
                ecc_uncorrected=0,
                nvlink_links_up=NVLINKS,
                nvlink_links_expected=NVLINKS,
                nvlink_errors=0,
                pcie_replays=0,
                nic_utilization=HEALTHY_NIC_UTILIZATION,
            )
            for fault in active:
                if fault.hits(reading):
                    reading = fault.apply(reading)
            readings.append(reading)
        return readings


def gpu_telemetry(
    node: str, rack: str, gpus: int = 8, faults: Callable[[], Iterable[TelemetryFault]] = _no_faults
) -> GpuTelemetry:
    """NVML when it initializes and sees at least one GPU; otherwise `gpus` simulated ones."""
    try:
        nvml = NvmlTelemetry(node, rack)
    except pynvml.NVMLError as error:
        log.info("no NVML, simulated GPU telemetry", node=node, reason=str(error))
        return SimulatedTelemetry(node, rack, gpus, faults)
    if nvml.count == 0:
        nvml.close()
        log.info("NVML sees no GPU, simulated GPU telemetry", node=node)
        return SimulatedTelemetry(node, rack, gpus, faults)
    return nvml
