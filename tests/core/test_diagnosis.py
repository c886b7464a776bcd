"""The verdict on a slow node from GPU telemetry (docs/architecture.md §11), as a table of cases."""

from __future__ import annotations

from typing import Any

import pytest

from stayalive.core.judgement.diagnosis import Diagnosis, GpuHealth, Limits, counters_since, diagnose

GPUS = 8


def gpus(node: str, rack: str = "r1", count: int = GPUS, only: int | None = None, **change: Any) -> list[GpuHealth]:
    """A node's GPUs in good health, with `change` applied to all of them, or to GPU `only`."""
    healthy = dict(
        temperature_c=58.0,
        power_w=310.0,
        power_limit_w=700.0,
        ecc_corrected=0,
        ecc_uncorrected=0,
        nvlink_links_up=18,
        nvlink_links_expected=18,
        nvlink_errors=0,
        pcie_replays=0,
        nic_utilization=0.3,
    )
    return [
        GpuHealth(node=node, rack=rack, gpu=i, **(healthy | (change if only in (None, i) else {})))
        for i in range(count)
    ]


def rack(count: int = 3, **change: Any) -> list[GpuHealth]:
    """The other nodes of rack r1."""
    return [g for n in range(count) for g in gpus(f"peer{n}", **change)]


THERMAL: dict[str, Any] = {"temperature_c": 92.0, "throttle_reasons": {"thermal"}}


@pytest.mark.parametrize(
    ("node", "peers", "diagnosis", "evict", "evidence"),
    [
        # the rules of the diagnosis table, in order
        (
            gpus("n1", **THERMAL),
            rack(temperature_c=88.0),
            Diagnosis.ENVIRONMENTAL,
            False,
            "rack r1 peers: median 88 °C, 0/24 GPUs throttling: the rack is hot too",
        ),
        (gpus("n1", **THERMAL), rack(**THERMAL), Diagnosis.ENVIRONMENTAL, False, "the rack is hot too"),
        (
            gpus("n1", **THERMAL),
            rack(temperature_c=80.0, throttle_reasons={"thermal"}),  # throttling under the limit: still the air
            Diagnosis.ENVIRONMENTAL,
            False,
            "24/24 GPUs throttling: the rack throttles too",
        ),
        (
            gpus("n1", only=3, **THERMAL),
            rack(),
            Diagnosis.NODE_THERMAL,
            True,
            "n1 GPU 3 throttling (thermal) at up to 92 °C; rack r1 peers: median 58",
        ),
        (gpus("n1", only=3, **THERMAL), [], Diagnosis.NODE_THERMAL, True, "no rack peers"),
        (gpus("n1", only=4, nvlink_links_up=16), rack(), Diagnosis.NODE_LINK, True, "GPU 4 NVLink 16/18 links up"),
        (gpus("n1", only=2, nvlink_errors=5000), rack(), Diagnosis.NODE_LINK, True, "GPU 2: 5000 NVLink replay/CRC"),
        (gpus("n1", only=2, pcie_replays=400), rack(), Diagnosis.NODE_LINK, True, "GPU 2: 400 PCIe replays"),
        (gpus("n1", nic_utilization=0.97), rack(), Diagnosis.NETWORK_CONTENTION, True, "97% utilization"),
        (gpus("n1", nic_utilization=0.85), rack(), Diagnosis.UNKNOWN, True, "no throttling"),  # busy, not saturated
        (
            gpus("n1", **THERMAL),
            [rack()[0].model_copy(update=THERMAL), *rack()[1:]],  # 1 of 24 peer GPUs throttles: not the rack
            Diagnosis.NODE_THERMAL,
            True,
            "1/24 GPUs throttling: this node alone",
        ),
        (gpus("n1"), rack(), Diagnosis.UNKNOWN, True, "no throttling, link, NIC or memory fault"),
        ([], rack(), Diagnosis.UNKNOWN, True, "no GPU telemetry"),
        # temperature is a lead, not a verdict: heat that slows a GPU shows as a throttle reason
        (gpus("n1", only=5, temperature_c=88.0), rack(), Diagnosis.UNKNOWN, True, "n1 GPU 5 hot (up to 88 °C) but not"),
        (gpus("n1", temperature_c=88.0), rack(temperature_c=88.0), Diagnosis.UNKNOWN, True, "not throttling"),
        (
            gpus("n1", only=5, temperature_c=88.0, nvlink_links_up=17),
            rack(),
            Diagnosis.NODE_LINK,
            True,
            "17/18 links up; lead: n1 GPU 5 hot",
        ),
        # ECC: uncorrectable is a failing GPU whatever else is true; corrected is a lead
        (gpus("n1", only=1, ecc_uncorrected=2), rack(), Diagnosis.NODE_MEMORY, True, "GPU 1: 2"),
        (gpus("n1", only=1, ecc_uncorrected=1, **THERMAL), rack(**THERMAL), Diagnosis.NODE_MEMORY, True, "uncorrect"),
        (gpus("n1", only=1, ecc_corrected=900), rack(), Diagnosis.UNKNOWN, True, "corrected ECC errors above 100"),
        # power: a cap the rack does not share sets the node apart; one it shares is full load as usual
        (
            gpus("n1", throttle_reasons={"power_cap"}, power_limit_w=450.0),
            rack(),
            Diagnosis.NODE_THERMAL,
            True,
            "(power_cap)",
        ),
        (
            gpus("n1", throttle_reasons={"power_cap"}, nic_utilization=0.95),
            rack(throttle_reasons={"power_cap"}),
            Diagnosis.NETWORK_CONTENTION,
            True,
            "like most of its rack: normal at full load",
        ),
        (gpus("n1", only=0, throttle_reasons={"hw_slowdown"}), rack(), Diagnosis.NODE_THERMAL, True, "hw_slowdown"),
    ],
)
def test_diagnose(
    node: list[GpuHealth], peers: list[GpuHealth], diagnosis: Diagnosis, evict: bool, evidence: str
) -> None:
    verdict = diagnose(node, peers, Limits())
    assert (verdict.diagnosis, verdict.evict) == (diagnosis, evict), verdict.evidence
    assert evidence in verdict.evidence


def test_a_throttling_gpu_is_not_called_hot_but_not_throttling() -> None:
    verdict = diagnose(gpus("n1", only=3, **THERMAL), rack())
    assert "not throttling" not in verdict.evidence


def test_hot_but_not_throttling_is_never_node_thermal() -> None:
    """Whatever the temperature, without active throttling there is no thermal verdict."""
    for temperature in (86.0, 95.0, 105.0):
        for peers in (rack(), rack(temperature_c=temperature)):
            verdict = diagnose(gpus("n1", temperature_c=temperature), peers)
            assert verdict.diagnosis not in (Diagnosis.NODE_THERMAL, Diagnosis.ENVIRONMENTAL)
            assert "but not throttling, so not the cause on its own" in verdict.evidence


@pytest.mark.parametrize(("limit", "diagnosis"), [(85.0, Diagnosis.ENVIRONMENTAL), (90.0, Diagnosis.NODE_THERMAL)])
def test_the_thermal_limit_decides_whether_the_rack_is_hot(limit: float, diagnosis: Diagnosis) -> None:
    verdict = diagnose(gpus("n1", **THERMAL), rack(temperature_c=88.0), Limits(thermal_limit_c=limit))
    assert verdict.diagnosis is diagnosis


def test_actions_say_what_to_do() -> None:
    assert "facilities" in diagnose(gpus("n1", **THERMAL), rack(**THERMAL)).action
    assert "placement" in diagnose(gpus("n1", nic_utilization=0.99), rack()).action
    assert "once" in diagnose(gpus("n1"), rack()).action


def test_counters_since_turns_lifetimes_into_increases() -> None:
    before = gpus("n1", ecc_corrected=5000, nvlink_errors=70, pcie_replays=9)
    now = gpus("n1", ecc_corrected=5010, nvlink_errors=3, pcie_replays=None)  # link counters were reset
    (first, *_) = counters_since(now, before)
    assert (first.ecc_corrected, first.nvlink_errors, first.pcie_replays) == (10, 3, None)
    # 5,000 lifetime corrected errors were a lead; 10 new ones are not.
    assert "corrected ECC" in diagnose(before, rack()).evidence
    assert "corrected ECC" not in diagnose(counters_since(now, before), rack()).evidence
    (new_gpu,) = counters_since(gpus("n2", count=1, ecc_corrected=4), before)  # nothing earlier to subtract
    assert new_gpu.ecc_corrected == 4
