"""The node self-test runs its three checks for real (torch on CPU, two gloo ranks in-process) and
names the check that a simulated hardware fault breaks; where GPU telemetry is read, NVML is a fourth."""

from __future__ import annotations

import pytest

from stayalive.agent.gpu import SimulatedTelemetry
from stayalive.agent.selftest import CHECKS, NVML_CHECK, SelfTest, nvml_health
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
