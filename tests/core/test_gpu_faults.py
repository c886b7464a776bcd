"""Failures a GPU shows without getting slow, judged from a node's consecutive readings: each is news
once, and only the ones that leave the GPU computing let the run drain instead of restart."""

from __future__ import annotations

import pytest

from stayalive.agent.gpu import NVLINKS, SimulatedTelemetry
from stayalive.core.judgement.diagnosis import GpuHealth
from stayalive.core.judgement.gpu_faults import CRITICAL_XIDS, GpuFaultKind, hard_faults
from stayalive.core.run.faults import EccErrors, GpuLost, NvlinkDegraded, RowRemapFailure, TelemetryFault, XidError


def gpu(index: int = 0, **fields: object) -> GpuHealth:
    healthy: dict[str, object] = {
        "ecc_uncorrected": 0,
        "nvlink_links_up": NVLINKS,
        "nvlink_links_expected": NVLINKS,
        "row_remap_failure": False,
    }
    return GpuHealth.model_validate({"node": "n1", "rack": "r1", "gpu": index} | healthy | fields)


@pytest.mark.parametrize(
    ("before", "now", "found"),
    [
        ([gpu()], [gpu()], []),  # healthy stays healthy
        (None, [gpu(ecc_uncorrected=2)], [(0, "ecc_uncorrectable", "2 uncorrectable ECC errors")]),
        ([gpu(ecc_uncorrected=2)], [gpu(ecc_uncorrected=2)], []),  # the same count again is not news
        ([gpu(ecc_uncorrected=2)], [gpu(ecc_uncorrected=3)], [(0, "ecc_uncorrectable", "1 uncorrectable")]),
        ([gpu()], [gpu(row_remap_failure=True)], [(0, "row_remap_failure", "could not be remapped")]),
        ([gpu(row_remap_failure=True)], [gpu(row_remap_failure=True)], []),
        ([gpu()], [gpu(xids=(79,))], [(0, "xid", "Xid 79: GPU fell off the bus")]),
        ([gpu()], [gpu(xids=(13, 31, 43))], []),  # a program's own errors: its rank crashes by itself
        ([gpu()], [gpu(nvlink_links_up=16)], [(0, "nvlink_down", "NVLink 16/18 links up")]),
        ([gpu(nvlink_links_up=16)], [gpu(nvlink_links_up=16)], []),
        ([gpu(nvlink_links_up=16)], [gpu(nvlink_links_up=14)], [(0, "nvlink_down", "NVLink 14/18")]),
        (None, [gpu(nvlink_links_up=None, nvlink_links_expected=None)], []),  # a PCIe card has no NVLink
        ([gpu()], [gpu(lost=True, ecc_uncorrected=None)], [(0, "gpu_lost", "fell off the bus")]),
        ([gpu(0), gpu(1)], [gpu(0)], [(1, "gpu_lost", "gone from NVML")]),  # a GPU the driver no longer lists
    ],
)
def test_each_failure_is_news_once(
    before: list[GpuHealth] | None, now: list[GpuHealth], found: list[tuple[int, GpuFaultKind, str]]
) -> None:
    faults = hard_faults(before, now)
    assert [(f.gpu, f.kind) for f in faults] == [(g, kind) for g, kind, _ in found]
    for fault, (g, _, detail) in zip(faults, found, strict=True):
        assert fault.detail.startswith(f"n1 GPU {g}: ") and detail in fault.detail


def test_only_a_gpu_that_still_computes_lets_the_run_drain() -> None:
    steps_on = hard_faults(None, [gpu(nvlink_links_up=17), gpu(1, row_remap_failure=True)])
    stops = hard_faults(None, [gpu(lost=True), gpu(1, ecc_uncorrected=1), gpu(2, xids=(48,))])
    assert [f.kind for f in steps_on] == ["nvlink_down", "row_remap_failure"] and all(f.steps_on for f in steps_on)
    assert [f.kind for f in stops] == ["gpu_lost", "ecc_uncorrectable", "xid"] and not any(f.steps_on for f in stops)


def test_the_critical_xids_are_the_hardwares() -> None:
    assert {48, 79, 94, 95} <= CRITICAL_XIDS.keys() and not {13, 31, 43} & CRITICAL_XIDS.keys()


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        (EccErrors(node="n1", gpu=3), "ecc_uncorrectable"),
        (RowRemapFailure(node="n1", gpu=3), "row_remap_failure"),
        (XidError(node="n1", gpu=3, xid=95), "xid"),
        (GpuLost(node="n1", gpu=3), "gpu_lost"),
        (NvlinkDegraded(node="n1", gpu=3), "nvlink_down"),
    ],
)
def test_the_simulated_source_injects_each_failure(fault: TelemetryFault, kind: GpuFaultKind) -> None:
    """Every NVML failure the run acts on can be injected on a machine without a GPU: it shows on the
    GPU it names, on the node it names, and only there."""
    first = SimulatedTelemetry("n1", "r1").read()
    faulty = SimulatedTelemetry("n1", "r1", faults=lambda: [fault]).read()
    other = SimulatedTelemetry("n2", "r1", faults=lambda: [fault]).read()
    assert [(f.gpu, f.kind) for f in hard_faults(first, faulty)] == [(3, kind)]
    assert hard_faults(None, other) == [] and hard_faults(None, first) == []
