"""Failures a GPU shows without getting slow (docs/architecture.md §11): an uncorrectable memory error,
a row that could not be remapped, a critical Xid, a GPU that fell off the bus, an NVLink gone down.
The straggler diagnosis never sees them (nothing is slow until the GPU dies), yet faulty GPUs and their
HBM are the two largest causes of interruption in the Llama 3 405B run (148 and 72 of 419, Dubey et
al. 2024, table 5). Judged from two consecutive readings of a node's GPUs, so a counter that was
already up before the run watched it is news only once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from stayalive.core.judgement.diagnosis import GpuHealth

GpuFaultKind = Literal["gpu_lost", "ecc_uncorrectable", "row_remap_failure", "xid", "nvlink_down"]

# Xids that say the hardware failed, from NVIDIA's Xid catalogue; the rest (13, 31, 43: a program's
# own illegal access or assert) are the program's, and the rank that hit them crashes on its own.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    64: "row remapper could not record a failing row",
    74: "NVLink error",
    79: "GPU fell off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

# A GPU with a link down computes (over the links left, slower), and one whose row could not be
# remapped keeps its pages retired until a reset: the run can hold at an agreed step and drain the
# node. The others cannot be trusted to finish a step: the run restarts without the node.
STEPS_ON: frozenset[GpuFaultKind] = frozenset({"nvlink_down", "row_remap_failure"})


class GpuFault(BaseModel):
    model_config = ConfigDict(frozen=True)

    node: str
    gpu: int
    kind: GpuFaultKind
    detail: str

    @property
    def steps_on(self) -> bool:
        """The GPU still computes: the node can be drained at an agreed step instead of restarting."""
        return self.kind in STEPS_ON


def hard_faults(before: list[GpuHealth] | None, now: list[GpuHealth]) -> list[GpuFault]:
    """What `now` shows failed that `before` (the node's previous reading; None: the first) did not."""
    earlier = {h.gpu: h for h in before or []}
    found = [fault for h in now for fault in _news(earlier.get(h.gpu), h)]
    for gpu in sorted(earlier.keys() - {h.gpu for h in now}):
        found.append(_fault(earlier[gpu], "gpu_lost", "gone from NVML"))
    return found


def _news(prev: GpuHealth | None, h: GpuHealth) -> list[GpuFault]:
    if h.lost:
        return [_fault(h, "gpu_lost", "fell off the bus (NVML: GPU is lost)")]  # nothing else it says holds
    found = []
    was = (prev.ecc_uncorrected or 0) if prev is not None else 0
    if h.ecc_uncorrected is not None and h.ecc_uncorrected > was:
        found.append(_fault(h, "ecc_uncorrectable", f"{h.ecc_uncorrected - was} uncorrectable ECC errors"))
    if h.row_remap_failure and not (prev is not None and prev.row_remap_failure):
        found.append(_fault(h, "row_remap_failure", "a failing memory row could not be remapped"))
    if critical := sorted({x for x in h.xids if x in CRITICAL_XIDS}):
        found.append(_fault(h, "xid", "; ".join(f"Xid {x}: {CRITICAL_XIDS[x]}" for x in critical)))
    up, expected = h.nvlink_links_up, h.nvlink_links_expected
    up_before = prev.nvlink_links_up if prev is not None else expected
    if up is not None and expected is not None and up < expected and (up_before is None or up < up_before):
        found.append(_fault(h, "nvlink_down", f"NVLink {up}/{expected} links up"))
    return found


def _fault(h: GpuHealth, kind: GpuFaultKind, detail: str) -> GpuFault:
    return GpuFault(node=h.node, gpu=h.gpu, kind=kind, detail=f"{h.node} GPU {h.gpu}: {detail}")
