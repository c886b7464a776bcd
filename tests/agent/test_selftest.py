"""The node self-test runs its three checks for real (torch on CPU, two gloo ranks in-process) and
names the check that a simulated hardware fault breaks."""

from __future__ import annotations

import pytest

from stayalive.agent.selftest import CHECKS, SelfTest
from stayalive.core.fleet.model import SelfTestResult


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
