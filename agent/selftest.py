"""A node's self-test, run by its own node agent (asked over its hub by the supervisor's `self_test`
activity) before a quarantined node may rejoin the pool.

Checks with known answers, each of which a sick accelerator fails in its own way, on every device of
the node (every GPU, or the CPU where there is none), and what the GPUs say of themselves:
- known-answer GEMM: small integers, so the exact product is representable; any wrong element is
  a wrong answer, not rounding;
- bitwise repeatability: the same float GEMM twice must agree bit for bit (silent corruption is
  rarely repeatable);
- memory (GPUs): a pattern test over a share of each GPU's free memory (agent/memory_test.py);
- a collective with known values: every rank adds rank+1 and must read the sum: an NCCL all-reduce
  across the node's GPUs, one rank each (the links between them in it), or two gloo ranks where the
  node has fewer than two GPUs;
- NVML (where the agent reads GPU telemetry): no GPU lost, no uncorrectable ECC error, no row that could
  not be remapped, no retired page waiting for a reboot, no critical Xid, every NVLink up. A node
  quarantined for a GPU failure stays quarantined while its GPU still shows it.

`broken()` names the simulated hardware faults currently set on this node (one per check name):
the check then corrupts its own result the way such hardware would (on the node's last device), so
the whole path from a bad node to its quarantine can be exercised on any machine.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import structlog
import torch
import torch.distributed as dist
from pydantic import BaseModel

from stayalive.agent.memory_test import free_bytes, memory_pattern
from stayalive.core.fleet.model import SelfTestResult
from stayalive.core.judgement.diagnosis import GpuHealth
from stayalive.core.judgement.gpu_faults import hard_faults

log = structlog.get_logger()

CHECKS = ("gemm", "repeatability", "collective")  # on the CPU
GPU_CHECKS = ("gemm", "repeatability", "memory", "collective")
NVML_CHECK = "nvml"
MEMORY_SHARE = 0.5  # of each GPU's free memory, under the pattern test
GEMM_SIZE = 256
REPEAT_SIZE = 512
COLLECTIVE_SIZE = 4096
SEED = 20260101


class Check(BaseModel):
    passed: bool
    detail: str


class SelfTest:
    def __init__(
        self,
        node: str,
        broken: Callable[[], set[str]] = set,
        devices: list[torch.device] | None = None,
        collective_timeout: timedelta = timedelta(seconds=20),
        vacate: Callable[[], Awaitable[int]] | None = None,
        gpus: Callable[[], list[GpuHealth]] | None = None,
        memory_share: float = MEMORY_SHARE,
    ) -> None:
        self.node = node
        self.broken = broken
        self.devices = devices if devices is not None else local_devices()
        self.collective_timeout = collective_timeout
        self.vacate = vacate  # stops whatever ranks still run here, so the checks have the node to themselves
        self.gpus = gpus  # one reading of this host's GPUs (agent/gpu.py), where the agent has telemetry
        self.memory_share = memory_share
        on_gpus = self.devices[0].type == "cuda"
        self.checks = (*(GPU_CHECKS if on_gpus else CHECKS), *((NVML_CHECK,) if gpus is not None else ()))

    async def run(self, progress: Callable[[str], None] = lambda check: None) -> SelfTestResult:
        """Run every check (a failing one does not skip the rest: the record shows them all);
        `progress` hears the name of each check as it starts."""
        if self.vacate is not None:
            # A node is quarantined with its ranks still up (a crash's neighbours, a hung rank): they
            # go before the checks, which would otherwise share the device with them.
            stopped = await self.vacate()
            log.info("node vacated for its self-test", node=self.node, stopped=stopped)
        faults = self.broken()
        checks: dict[str, Check] = {}
        for name in self.checks:
            progress(name)
            try:
                checks[name] = await self._run(name, corrupt=name in faults)
            except Exception as exc:  # a check that cannot run has not passed
                checks[name] = Check(passed=False, detail=f"{name}: could not run: {exc}")
        passed = all(c.passed for c in checks.values())
        detail = "; ".join(c.detail for c in checks.values())
        log.info("self-test finished", node=self.node, passed=passed, detail=detail)
        return SelfTestResult(
            node=self.node,
            passed=passed,
            checks={name: c.passed for name, c in checks.items()},
            detail=detail,
            at=datetime.now(UTC),
        )

    async def _run(self, name: str, corrupt: bool) -> Check:
        if name == NVML_CHECK and self.gpus is not None:
            return nvml_health(await asyncio.to_thread(self.gpus))
        if name == "collective":
            return await collective(self.devices, corrupt, self.collective_timeout)
        check: Callable[[torch.device, bool], Check] = {
            "gemm": known_answer_gemm,
            "repeatability": repeatable_gemm,
            "memory": self._memory,
        }[name]
        last = self.devices[-1]
        return await asyncio.to_thread(on_each, self.devices, lambda device: check(device, corrupt and device == last))

    def _memory(self, device: torch.device, corrupt: bool) -> Check:
        result = memory_pattern(device, int(self.memory_share * free_bytes(device)), corrupt)
        return Check(passed=result.passed, detail=result.detail)


def local_devices() -> list[torch.device]:
    """Every GPU of this host, or its CPU where it has none."""
    if torch.cuda.is_available():
        return [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def on_each(devices: list[torch.device], check: Callable[[torch.device], Check]) -> Check:
    """One check on every device, one after another: passed where it passed on each; the detail of
    the first device where all passed, else of every device where it failed."""
    results = [(device, check(device)) for device in devices]
    failed = [f"{device}: {result.detail}" for device, result in results if not result.passed]
    if failed:
        return Check(passed=False, detail="; ".join(failed))
    detail = results[0][1].detail
    return Check(passed=True, detail=detail if len(devices) == 1 else f"{detail}, on each of {len(devices)} devices")


def nvml_health(readings: list[GpuHealth]) -> Check:
    """What the GPUs say of themselves: every failure they still show, read as if seen for the first
    time (core/judgement/gpu_faults.py), and pages retired for ECC errors that wait for a reboot."""
    said = [f.detail for f in hard_faults(None, readings)]
    said += [f"{h.node} GPU {h.gpu}: retired pages wait for a reboot" for h in readings if h.retired_pages_pending]
    if said:
        return Check(passed=False, detail="NVML: " + "; ".join(said))
    return Check(passed=True, detail=f"NVML: {len(readings)} GPUs, none lost, no memory, Xid or link failure")


def known_answer_gemm(device: torch.device, corrupt: bool = False) -> Check:
    generator = torch.Generator().manual_seed(SEED)
    a = torch.randint(-4, 5, (GEMM_SIZE, GEMM_SIZE), generator=generator)
    b = torch.randint(-4, 5, (GEMM_SIZE, GEMM_SIZE), generator=generator)
    exact = a @ b  # int64: the answer, computed without floating point
    # |sum| <= 256 * 16 = 4096 < 2**24: every partial sum is exact in float32, whatever the order.
    product = (a.float().to(device) @ b.float().to(device)).cpu()
    if corrupt:
        product[GEMM_SIZE // 3, GEMM_SIZE // 7] += 1.0
    error = (product.double() - exact.double()).abs()
    wrong = int((error != 0).sum())
    if wrong:
        return Check(
            passed=False,
            detail=f"known-answer GEMM: {wrong} of {error.numel()} elements wrong (max error {error.max().item()})",
        )
    return Check(passed=True, detail=f"known-answer GEMM: all {error.numel()} elements exact")


def repeatable_gemm(device: torch.device, corrupt: bool = False) -> Check:
    generator = torch.Generator().manual_seed(SEED)
    a = torch.randn(REPEAT_SIZE, REPEAT_SIZE, generator=generator).to(device)
    b = torch.randn(REPEAT_SIZE, REPEAT_SIZE, generator=generator).to(device)
    first, second = (a @ b).cpu(), (a @ b).cpu()
    if corrupt:
        second[0, 0] = torch.nextafter(second[0, 0], torch.tensor(float("inf")))  # one bit off
    if torch.equal(first, second):
        return Check(passed=True, detail=f"bitwise repeatability: two {REPEAT_SIZE}×{REPEAT_SIZE} GEMMs identical")
    differ = int((first != second).sum())
    return Check(
        passed=False,
        detail=f"bitwise repeatability: two {REPEAT_SIZE}×{REPEAT_SIZE} GEMMs differ in {differ} of "
        f"{first.numel()} elements",
    )


async def collective(devices: list[torch.device], corrupt: bool, timeout: timedelta) -> Check:
    """Every rank adds rank+1 in one all-reduce and must read the sum: one NCCL rank per GPU where the
    node has two or more, else two gloo ranks on its device (threads of this process, one store)."""
    nccl = len(devices) >= 2 and devices[0].type == "cuda"
    placed = devices if nccl else [devices[0]] * 2
    backend = "nccl" if nccl else "gloo"
    store = dist.PrefixStore(f"selftest-{uuid.uuid4().hex}", dist.HashStore())
    results = await asyncio.gather(
        *(asyncio.to_thread(_all_reduce_rank, store, rank, placed, nccl, timeout) for rank in range(len(placed))),
        return_exceptions=True,
    )
    failures = [f"rank {rank}: {r}" for rank, r in enumerate(results) if isinstance(r, BaseException)]
    if failures:
        return Check(passed=False, detail=f"collective: {backend} all-reduce failed ({'; '.join(failures)})")
    tensors = [r for r in results if isinstance(r, torch.Tensor)]
    if corrupt:
        tensors[0][0] += 1.0
    ranks = len(placed)
    expected = ranks * (ranks + 1) / 2
    wrong = [(rank, t[t != expected]) for rank, t in enumerate(tensors) if not bool((t == expected).all())]
    if wrong:
        said = ", ".join(
            f"rank {rank}: {len(bad)} of {COLLECTIVE_SIZE} wrong (read {bad[0].item():g})" for rank, bad in wrong
        )
        terms = " + ".join(str(rank + 1) for rank in range(ranks))
        return Check(
            passed=False, detail=f"collective: all-reduce of {terms} should read {expected:g} everywhere; {said}"
        )
    return Check(
        passed=True, detail=f"collective: all-reduce over {ranks} {backend} ranks read {expected:g} everywhere"
    )


def _all_reduce_rank(
    store: dist.Store, rank: int, devices: list[torch.device], nccl: bool, timeout: timedelta
) -> torch.Tensor:
    # The constructors the ranks' own init_process_group uses, so the same device resolution is tested.
    device = devices[rank]
    group: dist.ProcessGroupNCCL | dist.ProcessGroupGloo
    if nccl:  # a CUDA build's
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, len(devices), options)
    else:
        group = dist.ProcessGroupGloo(store, rank, len(devices), timeout)
    try:
        tensor = torch.full((COLLECTIVE_SIZE,), float(rank + 1), device=device)
        group.allreduce([tensor]).wait(timeout)  # type: ignore[union-attr]  # torch's stubs omit a backend's collectives
        return tensor.cpu()
    finally:
        if nccl:
            group.shutdown()  # its communicator and its watchdog thread
