"""GPU telemetry: the NVML source against pynvml's real API (no GPU here, so decoding runs against
pynvml's functions replaced by a fake device), the fallback, and the simulated source's faults."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeAlias

import pydantic
import pynvml
import pytest

from stayalive.agent.gpu import NVLINKS, NvmlTelemetry, SimulatedTelemetry, gpu_telemetry, throttle_reasons
from stayalive.core.judgement.diagnosis import Diagnosis, GpuHealth, diagnose
from stayalive.core.judgement.gpu_faults import hard_faults
from stayalive.core.run.faults import (
    EccErrors,
    HotAmbient,
    NicSaturated,
    NvlinkDegraded,
    PowerCap,
    TelemetryFault,
    ThermalThrottle,
)

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


def nvml_available() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


# ── the real library ─────────────────────────────────────────────────────────────────────────────────


@pytest.mark.skipif(nvml_available(), reason="this machine has NVML: test_reads_this_machines_gpus covers it")
def test_without_nvml_the_simulated_source_stands_in() -> None:
    with pytest.raises(pynvml.NVMLError):  # LibraryNotFound or DriverNotLoaded, from the real pynvml
        pynvml.nvmlInit()
    telemetry = gpu_telemetry("n1", "r1", gpus=4)
    assert isinstance(telemetry, SimulatedTelemetry)
    assert [g.gpu for g in telemetry.read()] == [0, 1, 2, 3]


@pytest.mark.skipif(not nvml_available(), reason="no NVML on this machine")
def test_reads_this_machines_gpus() -> None:
    telemetry = gpu_telemetry("n1", "r1")
    assert isinstance(telemetry, NvmlTelemetry)
    try:
        readings = telemetry.read()
    finally:
        telemetry.close()
    assert readings and all(r.temperature_c is not None and 0 < r.temperature_c < 120 for r in readings)


# ── decoding, against a fake device behind pynvml's functions ────────────────────────────────────────


def error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml maps the code to its subclass, e.g. NVMLError_NotSupported


Answer: TypeAlias = "int | pynvml.NVMLError"  # a value, or the NVML error the call raises


@dataclass
class FakeGpu:
    """What one device's NVML calls answer."""

    temperature: Answer = 71
    power_mw: Answer = 412_345
    limit_mw: Answer = 700_000
    event_reasons: Answer = 0
    throttle_reasons: Answer = 0
    ecc: dict[int, Answer] = field(default_factory=lambda: {0: 3, 1: 0})
    links: list[int] = field(default_factory=lambda: [pynvml.NVML_FEATURE_ENABLED] * 18)
    link_errors: dict[int, Answer] = field(default_factory=dict)  # counter → per-link count
    pcie_replays: Answer = 7
    remapped_rows: tuple[int, int, int, int] | pynvml.NVMLError = (
        0,
        0,
        0,
        0,
    )  # corrected, uncorrected, pending, failed
    retired_pending: Answer = pynvml.NVML_FEATURE_DISABLED
    xids: list[int] = field(default_factory=list)  # Xid events raised, not yet read


def answer_rows(value: tuple[int, int, int, int] | pynvml.NVMLError) -> tuple[int, int, int, int]:
    if isinstance(value, pynvml.NVMLError):
        raise value
    return value


def answer(value: Answer) -> int:
    if isinstance(value, pynvml.NVMLError):
        raise value
    return value


@dataclass
class FakeNvml:
    devices: list[FakeGpu] = field(default_factory=lambda: [FakeGpu()])
    inits: int = 0
    shutdowns: int = 0

    def link_state(self, handle: int, link: int) -> int:
        links = self.devices[handle].links
        if link >= len(links):
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return answer(links[link])

    def link_errors(self, handle: int, link: int, counter: int) -> int:
        return answer(self.devices[handle].link_errors.get(counter, 0))

    def next_event(self, events: object, timeout_ms: int) -> Any:
        for index, gpu in enumerate(self.devices):
            if gpu.xids:
                # the fields of pynvml.c_nvmlEventData_t the reader uses (its `device` is a handle)
                return SimpleNamespace(device=index, eventData=gpu.xids.pop(0))
        raise error(pynvml.NVML_ERROR_TIMEOUT)

    def read_one(self, gpu: FakeGpu, **kwargs: Any) -> GpuHealth:
        self.devices[:] = [gpu]
        telemetry = NvmlTelemetry("n1", "r1", **kwargs)
        (reading,) = telemetry.read()
        telemetry.close()
        return reading


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """pynvml with the functions NvmlTelemetry calls answered by fake devices (one healthy to start)."""
    fake = FakeNvml()

    def count_init() -> None:
        fake.inits += 1

    def count_shutdown() -> None:
        fake.shutdowns += 1

    d = fake.devices
    replacements = {
        "nvmlInit": count_init,
        "nvmlShutdown": count_shutdown,
        "nvmlDeviceGetCount": lambda: len(d),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetTemperature": lambda h, sensor: answer(
            d[h].temperature if sensor == pynvml.NVML_TEMPERATURE_GPU else error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        ),
        "nvmlDeviceGetPowerUsage": lambda h: answer(d[h].power_mw),
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: answer(d[h].limit_mw),
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: answer(d[h].event_reasons),
        "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: answer(d[h].throttle_reasons),
        "nvmlDeviceGetTotalEccErrors": lambda h, kind, counter: answer(  # volatile: since the driver loaded
            d[h].ecc[kind] if counter == pynvml.NVML_VOLATILE_ECC else error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        ),
        "nvmlDeviceGetNvLinkState": fake.link_state,
        "nvmlDeviceGetNvLinkErrorCounter": fake.link_errors,
        "nvmlDeviceGetPcieReplayCounter": lambda h: answer(d[h].pcie_replays),
        "nvmlDeviceGetRemappedRows": lambda h: answer_rows(d[h].remapped_rows),
        "nvmlDeviceGetRetiredPagesPendingStatus": lambda h: answer(d[h].retired_pending),
        "nvmlEventSetCreate": lambda: "events",
        "nvmlEventSetFree": lambda events: None,
        "nvmlDeviceRegisterEvents": lambda h, types, events: None,
        "nvmlEventSetWait_v2": fake.next_event,
        "nvmlDeviceGetIndex": lambda h: h,
    }
    for name, replacement in replacements.items():
        assert callable(getattr(pynvml, name)), f"pynvml has no {name}"  # the real API, not a guess
        monkeypatch.setattr(pynvml, name, replacement)
    return fake


def test_a_healthy_device_decodes_every_field(nvml: FakeNvml) -> None:
    gpu = FakeGpu(link_errors={pynvml.NVML_NVLINK_ERROR_DL_REPLAY: 2, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: 1})
    reading = nvml.read_one(gpu)
    assert reading == GpuHealth(
        node="n1",
        rack="r1",
        gpu=0,
        temperature_c=71,
        power_w=412.345,
        power_limit_w=700.0,
        throttle_reasons=frozenset(),
        ecc_corrected=3,
        ecc_uncorrected=0,
        nvlink_links_up=18,
        nvlink_links_expected=18,
        nvlink_errors=18 * (2 + 1),
        pcie_replays=7,
        nic_utilization=None,  # NVML does not see the NIC
        lost=False,
        row_remap_failure=False,
        row_remap_pending=False,
        retired_pages_pending=False,
        xids=(),
    )
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


@pytest.mark.parametrize(
    ("mask", "reasons"),
    [
        (pynvml.nvmlClocksEventReasonGpuIdle | pynvml.nvmlClocksEventReasonApplicationsClocksSetting, set()),
        (pynvml.nvmlClocksEventReasonSwThermalSlowdown, {"thermal"}),
        (pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonSyncBoost, {"thermal"}),
        (pynvml.nvmlClocksEventReasonSwPowerCap, {"power_cap"}),
        (pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown, {"power_brake"}),
        (pynvml.nvmlClocksEventReasonHwSlowdown | pynvml.nvmlClocksEventReasonSwPowerCap, {"hw_slowdown", "power_cap"}),
    ],
)
def test_throttle_bits(nvml: FakeNvml, mask: int, reasons: set[str]) -> None:
    assert throttle_reasons(mask) == reasons
    assert nvml.read_one(FakeGpu(event_reasons=mask)).throttle_reasons == reasons


def test_an_older_driver_answers_under_the_throttle_name(nvml: FakeNvml) -> None:
    gpu = FakeGpu(
        event_reasons=error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND),
        throttle_reasons=pynvml.nvmlClocksThrottleReasonHwThermalSlowdown,
    )
    assert nvml.read_one(gpu).throttle_reasons == {"thermal"}


def test_every_field_a_device_does_not_support_is_none(nvml: FakeNvml) -> None:
    unsupported = error(NOT_SUPPORTED)
    gpu = FakeGpu(
        temperature=unsupported,
        power_mw=unsupported,
        limit_mw=error(pynvml.NVML_ERROR_NO_PERMISSION),
        event_reasons=unsupported,
        throttle_reasons=unsupported,
        ecc={0: unsupported, 1: unsupported},  # ECC mode off
        links=[],  # a PCIe card: no NVLink
        pcie_replays=unsupported,
        remapped_rows=unsupported,
        retired_pending=unsupported,
    )
    reading = nvml.read_one(gpu)
    assert reading == GpuHealth(node="n1", rack="r1", gpu=0)


def test_nvlink_width_and_errors(nvml: FakeNvml) -> None:
    links = [pynvml.NVML_FEATURE_ENABLED] * 18
    links[5] = links[9] = pynvml.NVML_FEATURE_DISABLED
    gpu = FakeGpu(
        links=links,
        link_errors={
            pynvml.NVML_NVLINK_ERROR_DL_REPLAY: 10,
            pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: error(NOT_SUPPORTED),  # absent, not fatal
            pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: 1,
        },
    )
    reading = nvml.read_one(gpu)
    assert (reading.nvlink_links_up, reading.nvlink_links_expected, reading.nvlink_errors) == (16, 18, 18 * 11)
    # A link the driver no longer lists at all is only missed when the expected count is known.
    short = nvml.read_one(FakeGpu(links=[pynvml.NVML_FEATURE_ENABLED] * 17), expected_nvlinks=18)
    assert (short.nvlink_links_up, short.nvlink_links_expected) == (17, 18)
    assert diagnose([reading], []).diagnosis is Diagnosis.NODE_LINK


def test_a_lost_gpu_is_reported_not_hidden(nvml: FakeNvml) -> None:
    """A GPU that fell off the bus is a reading that says so (the run acts on it), not an error that
    stops the node agent reading the others."""
    nvml.devices[:] = [FakeGpu(), FakeGpu(temperature=error(pynvml.NVML_ERROR_GPU_IS_LOST))]
    telemetry = NvmlTelemetry("n1", "r1")
    healthy, lost = telemetry.read()
    telemetry.close()
    assert not healthy.lost and healthy.temperature_c == 71
    assert lost == GpuHealth(node="n1", rack="r1", gpu=1, lost=True)
    assert [f.kind for f in hard_faults(None, [healthy, lost])] == ["gpu_lost"]


def test_remapped_rows_retired_pages_and_xid_events_are_read(nvml: FakeNvml) -> None:
    nvml.devices[:] = [
        FakeGpu(remapped_rows=(2, 1, 1, 1), retired_pending=pynvml.NVML_FEATURE_ENABLED, xids=[48, 13]),
        FakeGpu(xids=[79]),
    ]
    telemetry = NvmlTelemetry("n1", "r1")
    first, second = telemetry.read()
    again = telemetry.read()
    telemetry.close()
    assert (first.row_remap_pending, first.row_remap_failure, first.retired_pages_pending) == (True, True, True)
    assert (first.xids, second.xids) == ((48, 13), (79,))
    assert [r.xids for r in again] == [(), ()], "an event is read once"
    faults = hard_faults(None, [first, second])
    assert [(f.gpu, f.kind) for f in faults] == [(0, "row_remap_failure"), (0, "xid"), (1, "xid")]
    assert "Xid 48" in faults[1].detail and "Xid 13" not in faults[1].detail, "13 is the program's, not the GPU's"


def test_several_devices_are_read_in_index_order(nvml: FakeNvml) -> None:
    nvml.devices[:] = [FakeGpu(temperature=60), FakeGpu(temperature=90, event_reasons=0x40)]
    telemetry = gpu_telemetry("n1", "r1")
    assert isinstance(telemetry, NvmlTelemetry)
    readings = telemetry.read()
    telemetry.close()
    assert [(r.gpu, r.temperature_c, r.throttle_reasons) for r in readings] == [
        (0, 60, frozenset()),
        (1, 90, {"thermal"}),
    ]


def test_nvml_without_devices_falls_back_and_shuts_down(nvml: FakeNvml) -> None:
    nvml.devices.clear()
    assert isinstance(gpu_telemetry("n1", "r1"), SimulatedTelemetry)
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


# ── simulated ────────────────────────────────────────────────────────────────────────────────────────


def simulated(*faults: TelemetryFault, node: str = "n1", rack: str = "r1") -> list[GpuHealth]:
    return SimulatedTelemetry(node, rack, gpus=4, faults=lambda: faults).read()


def test_simulated_gpus_are_healthy_without_faults() -> None:
    readings = simulated()
    assert [r.gpu for r in readings] == [0, 1, 2, 3]
    assert all(
        r.throttle_reasons == set()
        and r.ecc_uncorrected == 0
        and r.nvlink_links_up == r.nvlink_links_expected == NVLINKS
        for r in readings
    )
    assert diagnose(readings, simulated(node="n2")).diagnosis is Diagnosis.UNKNOWN


@pytest.mark.parametrize(
    ("fault", "changed", "diagnosis"),
    [
        (ThermalThrottle(node="n1"), {"temperature_c": 92.0, "throttle_reasons": {"thermal"}}, Diagnosis.NODE_THERMAL),
        (HotAmbient(node="n1"), {"temperature_c": 88.0}, Diagnosis.UNKNOWN),
        (
            PowerCap(node="n1"),
            {"power_w": 450.0, "power_limit_w": 450.0, "throttle_reasons": {"power_cap"}},
            Diagnosis.NODE_THERMAL,
        ),
        (EccErrors(node="n1"), {"ecc_uncorrected": 1}, Diagnosis.NODE_MEMORY),
        (EccErrors(node="n1", corrected=500, uncorrected=0), {"ecc_corrected": 500}, Diagnosis.UNKNOWN),
        (NvlinkDegraded(node="n1"), {"nvlink_links_up": 16}, Diagnosis.NODE_LINK),
        (NvlinkDegraded(node="n1", links_down=0, errors=900), {"nvlink_errors": 900}, Diagnosis.NODE_LINK),
        (NicSaturated(node="n1"), {"nic_utilization": 0.97}, Diagnosis.NETWORK_CONTENTION),
    ],
)
def test_each_simulated_fault(fault: TelemetryFault, changed: dict[str, object], diagnosis: Diagnosis) -> None:
    healthy, faulty = simulated()[0], simulated(fault)[0]
    differs = {name for name in GpuHealth.model_fields if getattr(healthy, name) != getattr(faulty, name)}
    assert differs == set(changed)
    assert {name: getattr(faulty, name) for name in changed} == changed
    assert diagnose(simulated(fault), simulated(node="n2") + simulated(node="n3")).diagnosis is diagnosis


def test_a_hot_aisle_is_environmental() -> None:
    aisle: list[TelemetryFault] = [
        HotAmbient(rack="r1"),
        ThermalThrottle(node="n1"),
    ]  # the rack runs hot; n1 throttles first
    verdict = diagnose(simulated(*aisle), simulated(*aisle, node="n2") + simulated(*aisle, node="n3"))
    assert (verdict.diagnosis, verdict.evict) == (Diagnosis.ENVIRONMENTAL, False)


def test_faults_hit_only_their_node_rack_and_gpu() -> None:
    fault = ThermalThrottle(node="n1", gpu=2)
    assert [r.throttle_reasons for r in simulated(fault)] == [set(), set(), {"thermal"}, set()]
    assert all(not r.throttle_reasons for r in simulated(fault, node="n2"))
    assert all(r.temperature_c == 88.0 for r in simulated(HotAmbient(rack="r1"), node="n9"))
    assert all(r.temperature_c == 55.0 for r in simulated(HotAmbient(rack="r1"), node="n9", rack="r2"))


def test_a_fault_names_a_node_or_a_rack_and_parses_from_a_plan() -> None:
    with pytest.raises(pydantic.ValidationError, match="either the node or the rack"):
        ThermalThrottle(node="n1", rack="r1")
    with pytest.raises(pydantic.ValidationError):
        ThermalThrottle()
    parsed = pydantic.TypeAdapter(TelemetryFault).validate_python({"kind": "nvlink", "node": "n4", "links_down": 4})
    assert parsed == NvlinkDegraded(node="n4", links_down=4)


def test_faults_are_read_at_every_read() -> None:
    active: list[TelemetryFault] = []
    telemetry = SimulatedTelemetry("n1", "r1", gpus=1, faults=lambda: active)
    assert telemetry.read()[0].nic_utilization == 0.30
    active.append(NicSaturated(node="n1"))
    assert telemetry.read()[0].nic_utilization == 0.97
    active.clear()
    assert telemetry.read()[0].nic_utilization == 0.30
