"""Why a flagged node is slow, before anyone evicts it (docs/architecture.md §11).

Straggler detection says who; GPU health telemetry (NVML's readings, the fields NVIDIA's DCGM watches)
says why, and the why decides the remedy: a node whose whole rack runs hot is not fixed by replacing
it, the replacement is in the same air. The rules are a table read top to bottom; the first that
finds evidence decides, and every other observation that is worth a look but proves nothing rides
along in the evidence as a lead.

Pure: readings in, a verdict out. `activities/gpu.py` produces the readings.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# What NVML's clock-event bitmask says is holding the clocks down (activities/gpu.py decodes it).
# "hw_slowdown" is NVML's HW Slowdown: temperature, an external power brake or a power spike.
ThrottleReason = Literal["thermal", "power_cap", "power_brake", "hw_slowdown"]
HEAT = frozenset({"thermal", "hw_slowdown"})  # reasons that, shared by a rack, mean the air is too hot


class GpuHealth(BaseModel):
    """One GPU's health at one moment. None: the device does not report that field. The error
    counters are cumulative (since the driver loaded); `counters_since` turns them into increases."""

    model_config = ConfigDict(frozen=True)

    node: str
    rack: str
    gpu: int = Field(ge=0)
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    throttle_reasons: frozenset[ThrottleReason] = frozenset()
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    nvlink_links_up: int | None = None
    nvlink_links_expected: int | None = None
    nvlink_errors: int | None = None  # replay + recovery + CRC, summed over links
    pcie_replays: int | None = None
    nic_utilization: float | None = Field(default=None, ge=0.0, le=1.0)
    # Failures that need not make the GPU slow (core/judgement/gpu_faults.py).
    lost: bool = False  # the GPU fell off the bus: NVML answers "GPU is lost"
    row_remap_failure: bool | None = None  # a failing row could not be remapped: the GPU must be replaced
    row_remap_pending: bool | None = None  # a remapped row waits for a GPU reset to take effect
    retired_pages_pending: bool | None = None  # pages retired for ECC errors wait for a reboot
    xids: tuple[int, ...] = ()  # Xid events the driver raised since the previous reading


class Limits(BaseModel):
    """Where each reading stops being normal. Counter bands apply to what `diagnose` is given: pass
    `counters_since` a reading from before the slowdown began to judge rates rather than lifetimes."""

    model_config = ConfigDict(frozen=True)

    # Healthy GPUs under training load run 60-75 °C; data-center parts start slowing down around
    # 87-90 °C ("GPU Slowdown Temp" in `nvidia-smi -q`). A rack whose median is past 85 °C is breathing
    # air too hot for all of it.
    thermal_limit_c: float = 85.0
    # A condition held by at least this share of the rack peers' GPUs belongs to the rack, not the node.
    rack_share: float = Field(default=0.5, gt=0.0, le=1.0)
    # A healthy link shows no CRC errors and a handful of replays over days; a failing cable or
    # connector shows thousands within minutes, with bandwidth lost to the retransmissions.
    nvlink_error_band: int = 100
    pcie_replay_band: int = 100
    # Corrected errors are absorbed by ECC at no speed cost, but a climbing count is the usual
    # prelude to an uncorrectable one: a lead, never a verdict on its own.
    ecc_corrected_band: int = 100
    # Past ~90% of line rate a NIC queues; on a NIC shared with another job the collective waits.
    nic_utilization_band: float = Field(default=0.90, gt=0.0, le=1.0)


class Diagnosis(StrEnum):
    NODE_MEMORY = "node_memory"  # uncorrectable ECC errors: the GPU is failing, slow or not
    ENVIRONMENTAL = "environmental"  # the rack shares the cause: evicting moves the symptom
    NODE_THERMAL = "node_thermal"  # this node alone throttles: fan, paste, power supply
    NODE_LINK = "node_link"  # NVLink below width, or link / PCIe retransmissions
    NETWORK_CONTENTION = "network_contention"  # the NIC is saturated, usually by a neighbour
    UNKNOWN = "unknown"  # nothing in the telemetry explains it


class Verdict(BaseModel):
    model_config = ConfigDict(frozen=True)

    diagnosis: Diagnosis
    evidence: str
    evict: bool
    action: str


# A straggler whose node sent no GPU telemetry: nothing explains it, so it is treated as UNKNOWN
# (core.judgement.eviction lets an unexplained straggler be evicted once, then asks a person).
NO_TELEMETRY = Verdict(
    diagnosis=Diagnosis.UNKNOWN, evidence="no GPU telemetry", evict=True, action="evict once, then ask a person"
)


Finding = Callable[[list[GpuHealth], list[GpuHealth], Limits], str | None]


@dataclass(frozen=True)
class Rule:
    diagnosis: Diagnosis
    evict: bool
    action: str
    finding: Finding  # the evidence, or None when the rule does not apply


def _gpus(readings: Iterable[GpuHealth]) -> str:
    """'n1 GPUs 0, 3': the node (readings come from one node) and its GPUs in question."""
    readings = list(readings)
    indices = sorted({h.gpu for h in readings})
    return f"{readings[0].node} GPU{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


def _rack_median_c(peers: list[GpuHealth]) -> float | None:
    temperatures = [p.temperature_c for p in peers if p.temperature_c is not None]
    return statistics.median(temperatures) if temperatures else None


def _rack_reasons(peers: list[GpuHealth], limits: Limits) -> frozenset[str]:
    """Throttle reasons that at least `rack_share` of the peers' GPUs report."""
    if not peers:
        return frozenset()
    counts: dict[str, int] = {}
    for peer in peers:
        for reason in peer.throttle_reasons:
            counts[reason] = counts.get(reason, 0) + 1
    return frozenset(r for r, n in counts.items() if n >= limits.rack_share * len(peers))


def _throttled(node: list[GpuHealth]) -> list[GpuHealth]:
    return [h for h in node if h.throttle_reasons]


def _describe_throttle(throttled: list[GpuHealth]) -> str:
    reasons = sorted({r for h in throttled for r in h.throttle_reasons})
    hottest = max((h.temperature_c for h in throttled if h.temperature_c is not None), default=None)
    at = f" at up to {hottest:.0f} °C" if hottest is not None else ""
    return f"{_gpus(throttled)} throttling ({', '.join(reasons)}){at}"


def _describe_rack(peers: list[GpuHealth]) -> str:
    if not peers:
        return "no rack peers reported to compare with"
    median = _rack_median_c(peers)
    held = sum(1 for p in peers if p.throttle_reasons)
    temperature = f"median {median:.0f} °C" if median is not None else "no temperatures"
    return f"rack {peers[0].rack} peers: {temperature}, {held}/{len(peers)} GPUs throttling"


# ── the rules, in the order they are tried ───────────────────────────────────────────────────────────


def _uncorrected_ecc(node: list[GpuHealth], peers: list[GpuHealth], limits: Limits) -> str | None:
    failing = [h for h in node if h.ecc_uncorrected]
    if not failing:
        return None
    counts = ", ".join(f"GPU {h.gpu}: {h.ecc_uncorrected}" for h in failing)
    return f"{failing[0].node} uncorrectable ECC errors ({counts}): a hardware failure in progress"


def _rack_shares_heat(node: list[GpuHealth], peers: list[GpuHealth], limits: Limits) -> str | None:
    throttled = _throttled(node)
    if not throttled:
        return None
    median = _rack_median_c(peers)
    rack_hot = median is not None and median > limits.thermal_limit_c
    node_reasons = {r for h in throttled for r in h.throttle_reasons}
    if rack_hot:
        return f"{_describe_throttle(throttled)}; {_describe_rack(peers)}: the rack is hot too"
    if _rack_reasons(peers, limits) & node_reasons & HEAT:
        return f"{_describe_throttle(throttled)}; {_describe_rack(peers)}: the rack throttles too"
    return None


def _node_throttles(node: list[GpuHealth], peers: list[GpuHealth], limits: Limits) -> str | None:
    # A power cap most of the rack also reports is how GPUs at full load normally run (the clocks ride
    # the power limit); only a throttle reason the rack does not share sets this node apart.
    rack_reasons = _rack_reasons(peers, limits)
    own = [h for h in _throttled(node) if h.throttle_reasons - rack_reasons]
    if not own:
        return None
    return f"{_describe_throttle(own)}; {_describe_rack(peers)}: this node alone"


def _degraded_link(node: list[GpuHealth], peers: list[GpuHealth], limits: Limits) -> str | None:
    found: list[str] = []
    for h in node:
        up, expected = h.nvlink_links_up, h.nvlink_links_expected
        if up is not None and expected is not None and up < expected:
            found.append(f"{h.node} GPU {h.gpu} NVLink {up}/{expected} links up")
        if h.nvlink_errors is not None and h.nvlink_errors > limits.nvlink_error_band:
            found.append(
                f"{h.node} GPU {h.gpu}: {h.nvlink_errors} NVLink replay/CRC errors (band {limits.nvlink_error_band})"
            )
        if h.pcie_replays is not None and h.pcie_replays > limits.pcie_replay_band:
            found.append(f"{h.node} GPU {h.gpu}: {h.pcie_replays} PCIe replays (band {limits.pcie_replay_band})")
    return "; ".join(found) or None


def _nic_saturated(node: list[GpuHealth], peers: list[GpuHealth], limits: Limits) -> str | None:
    busy = [h for h in node if h.nic_utilization is not None and h.nic_utilization > limits.nic_utilization_band]
    if not busy:
        return None
    peak = max(h.nic_utilization or 0.0 for h in busy)
    return f"NIC of {_gpus(busy)} at {peak:.0%} utilization (band {limits.nic_utilization_band:.0%})"


RULES: tuple[Rule, ...] = (
    Rule(
        Diagnosis.NODE_MEMORY,
        True,
        "evict and quarantine; the self-test decides whether it returns",
        _uncorrected_ecc,
    ),
    Rule(
        Diagnosis.ENVIRONMENTAL,
        False,
        "do not evict (the replacement breathes the same air); alert facilities about the rack's cooling",
        _rack_shares_heat,
    ),
    Rule(
        Diagnosis.NODE_THERMAL,
        True,
        "evict at the next checkpoint; likely a fan, thermal paste or power supply",
        _node_throttles,
    ),
    Rule(
        Diagnosis.NODE_LINK,
        True,
        "evict at the next checkpoint; the link (cable, connector, riser) needs service",
        _degraded_link,
    ),
    Rule(
        Diagnosis.NETWORK_CONTENTION,
        True,
        "evict and change placement: keep the run's ranks off the shared NIC",
        _nic_saturated,
    ),
)
UNKNOWN_ACTION = "evict once; if the straggle survives the eviction, stop evicting and ask a human"


def _leads(node: list[GpuHealth], peers: list[GpuHealth], limits: Limits) -> list[str]:
    """Observations worth a look that prove nothing by themselves."""
    leads: list[str] = []
    hot = [
        h
        for h in node
        if h.temperature_c is not None and h.temperature_c > limits.thermal_limit_c and not h.throttle_reasons
    ]
    if hot:
        hottest = max(h.temperature_c or 0.0 for h in hot)
        leads.append(
            f"{_gpus(hot)} hot (up to {hottest:.0f} °C) but not throttling, so not the cause on its own: "
            "a GPU that heat slows throttles, and says so"
        )
    rack_reasons = _rack_reasons(peers, limits)
    shared_cap = [h for h in _throttled(node) if h.throttle_reasons <= rack_reasons - HEAT]
    if shared_cap:
        leads.append(f"{_describe_throttle(shared_cap)} like most of its rack: normal at full load")
    corrected = [h for h in node if h.ecc_corrected is not None and h.ecc_corrected > limits.ecc_corrected_band]
    if corrected:
        counts = ", ".join(f"GPU {h.gpu}: {h.ecc_corrected}" for h in corrected)
        leads.append(
            f"corrected ECC errors above {limits.ecc_corrected_band} ({counts}): may precede an uncorrectable one"
        )
    return leads


def diagnose(node_health: list[GpuHealth], rack_peers: list[GpuHealth], limits: Limits | None = None) -> Verdict:
    """The verdict on a slow node from its GPUs' readings and those of the other nodes in its rack."""
    limits = limits or Limits()
    if not node_health:
        return Verdict(
            diagnosis=Diagnosis.UNKNOWN, evidence="no GPU telemetry from the node", evict=True, action=UNKNOWN_ACTION
        )
    leads = _leads(node_health, rack_peers, limits)
    for rule in RULES:
        evidence = rule.finding(node_health, rack_peers, limits)
        if evidence is not None:
            return Verdict(
                diagnosis=rule.diagnosis,
                evidence="; ".join([evidence, *(f"lead: {x}" for x in leads)]),
                evict=rule.evict,
                action=rule.action,
            )
    evidence = "; ".join(["no throttling, link, NIC or memory fault in the telemetry", *(f"lead: {x}" for x in leads)])
    return Verdict(diagnosis=Diagnosis.UNKNOWN, evidence=evidence, evict=True, action=UNKNOWN_ACTION)


def counters_since(now: list[GpuHealth], before: list[GpuHealth]) -> list[GpuHealth]:
    """`now` with each cumulative counter replaced by its increase since `before` (matched by node and
    GPU). A counter that went down was reset (driver reload): its whole current value is new."""
    earlier = {(h.node, h.gpu): h for h in before}
    fields = ("ecc_corrected", "ecc_uncorrected", "nvlink_errors", "pcie_replays")
    result = []
    for reading in now:
        base = earlier.get((reading.node, reading.gpu))
        changes: dict[str, int] = {}
        for name in fields:
            current = getattr(reading, name)
            previous = getattr(base, name) if base is not None else None
            if current is not None and previous is not None:
                changes[name] = current - previous if current >= previous else current
        result.append(reading.model_copy(update=changes))
    return result
