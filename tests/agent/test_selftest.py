"""The node self-test runs its three checks for real (torch on CPU, two gloo ranks in-process) and
names the check that a simulated hardware fault breaks; where GPU telemetry is read, NVML is a fourth.
On a GPU host every check runs on each GPU, with a memory pattern test and an NCCL all-reduce across
the GPUs: those tests run wherever CUDA is, and are skipped here saying so."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from stayalive.agent.gpu import SimulatedTelemetry
from stayalive.agent.memory_test import memory_pattern
from stayalive.agent.selftest import CHECKS, GPU_CHECKS, NVML_CHECK, SelfTest, collective, nvml_health
from stayalive.core.fleet.model import SelfTestResult
from stayalive.core.judgement.diagnosis import GpuHealth
from stayalive.core.run.faults import NvlinkDegraded, RowRemapFailure, TelemetryFault, XidError


async def self_test(broken: set[str]) -> tuple[SelfTestResult, list[str]]:
    started: list[str] = []
    return await SelfTest("n1", lambda: broken).run(started.append), started


async def test_healthy_hardware_passes_every_check() -> None:
    result, started = await self_test(set())
    assert result.passed, result.detail
    assert result.checks == dict.fromkeys(CHECKS, True)
    assert "known-answer GEMM: all 65536 elements exact" in result.detail
    assert "read 3 everywhere" in result.detail
    assert started == list(CHECKS)


@pytest.mark.parametrize(
    ("fault", "detail"),
    [
        ("gemm", "known-answer GEMM: 1 of 65536 elements wrong (max error 1.0)"),
        ("repeatability", "bitwise repeatability: two 512×512 GEMMs differ in 1 of 262144 elements"),
        ("collective", "collective: all-reduce of 1 + 2 should read 3 everywhere; rank 0: 1 of 4096 wrong (read 4)"),
    ],
)
async def test_a_broken_unit_fails_its_own_check_only(fault: str, detail: str) -> None:
    result, _ = await self_test({fault})
    assert not result.passed
    assert result.checks == {name: name != fault for name in CHECKS}
    assert detail in result.detail


async def test_the_node_is_vacated_before_its_checks_run() -> None:
    """A quarantined node's leftover ranks (a crash's neighbours, a hung rank) go first: the checks must
    not share the device with them."""
    order: list[str] = []

    async def vacate() -> int:
        order.append("vacate")
        return 2

    def broken() -> set[str]:
        order.append("checks")
        return set()

    result = await SelfTest("n1", broken, vacate=vacate).run()
    assert result.passed, result.detail
    assert order == ["vacate", "checks"]


@pytest.mark.parametrize(
    ("fault", "said"),
    [
        (None, "NVML: 8 GPUs, none lost, no memory, Xid or link failure"),
        (RowRemapFailure(node="n1", gpu=2), "n1 GPU 2: a failing memory row could not be remapped"),
        (XidError(node="n1", gpu=5, xid=95), "n1 GPU 5: Xid 95: uncontained ECC error"),
        (NvlinkDegraded(node="n1", gpu=0), "n1 GPU 0: NVLink 16/18 links up"),
    ],
)
async def test_what_the_gpus_say_of_themselves_is_a_check(fault: TelemetryFault | None, said: str) -> None:
    """Where the agent reads GPU telemetry, NVML is a fourth check: a GPU that still shows a failure
    keeps its node out, whatever the GEMMs say."""
    telemetry = SimulatedTelemetry("n1", "r1", faults=lambda: [fault] if fault else [])
    result = await SelfTest("n1", gpus=telemetry.read).run()
    assert result.checks == dict.fromkeys(CHECKS, True) | {NVML_CHECK: fault is None}
    assert result.passed == (fault is None) and said in result.detail


def test_pages_waiting_for_a_reboot_fail_it() -> None:
    reading = GpuHealth(node="n1", rack="r1", gpu=1, retired_pages_pending=True)
    check = nvml_health([reading])
    assert not check.passed and "n1 GPU 1: retired pages wait for a reboot" in check.detail


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_flipped_memory_bit_is_found_by_the_pattern_test(corrupt: bool) -> None:
    """The pattern test itself, over 8 MiB of host memory: one bit that reads back flipped is one wrong
    word of the 2^20 it wrote five times."""
    check = memory_pattern(torch.device("cpu"), 16 << 20, corrupt)
    assert check.passed == (not corrupt)
    assert check.tested_bytes == 8 << 20
    said = "1 of 1048576 words read back wrong" if corrupt else "every word read back as written"
    assert said in check.detail and "5 patterns over 8.0 MiB of cpu" in check.detail


def test_on_a_host_without_gpus_the_checks_run_on_its_cpu() -> None:
    assert [d.type for d in SelfTest("n1").devices] == (["cuda"] if torch.cuda.is_available() else ["cpu"])


no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


@no_cuda
@pytest.mark.parametrize("fault", [None, "gemm", "memory", "collective"])
async def test_every_gpu_runs_every_check(fault: str | None) -> None:
    """On a GPU host: the GEMMs and the memory pattern on each GPU (the broken unit on the last one),
    and the collective across the GPUs; a broken unit fails its own check only."""
    test = SelfTest("n1", lambda: {fault} if fault else set(), memory_share=0.05)
    result = await test.run()
    assert test.checks == GPU_CHECKS
    assert result.checks == {name: name != fault for name in GPU_CHECKS}, result.detail
    if fault in ("gemm", "memory"):
        assert f"{test.devices[-1]}: " in result.detail


@no_cuda
@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="one GPU: no NCCL all-reduce between GPUs")
async def test_the_collective_is_an_nccl_all_reduce_across_the_gpus() -> None:
    devices = [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
    check = await collective(devices, corrupt=False, timeout=timedelta(seconds=60))
    expected = len(devices) * (len(devices) + 1) // 2
    assert check.passed and f"over {len(devices)} nccl ranks read {expected} everywhere" in check.detail
