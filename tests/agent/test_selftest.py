"""The node self-test runs its three checks for real (torch on CPU, two gloo ranks in-process) and
names the check that a simulated hardware fault breaks."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from agent.selftest import CHECKS, SelfTestActivities, SelfTestInput
from core.fleet import SelfTestResult


async def self_test(broken: set[str], node: str = "n1") -> tuple[SelfTestResult, list[object]]:
    environment = ActivityEnvironment()
    heartbeats: list[object] = []
    environment.on_heartbeat = lambda *details: heartbeats.extend(details)
    activities = SelfTestActivities("n1", lambda: broken)
    return await environment.run(activities.self_test, SelfTestInput(node=node)), heartbeats


async def test_healthy_hardware_passes_every_check() -> None:
    result, heartbeats = await self_test(set())
    assert result.passed, result.detail
    assert result.checks == dict.fromkeys(CHECKS, True)
    assert "known-answer GEMM: all 65536 elements exact" in result.detail
    assert "read 3 everywhere" in result.detail
    assert {"node": "n1", "check": "gemm"} in heartbeats


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


async def test_a_test_for_another_node_is_refused() -> None:
    with pytest.raises(ApplicationError, match="self-test for n2 reached the agent of n1"):
        await self_test(set(), node="n2")


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

    activities = SelfTestActivities("n1", broken, vacate=vacate)
    result = await ActivityEnvironment().run(activities.self_test, SelfTestInput(node="n1"))
    assert result.passed, result.detail
    assert order == ["vacate", "checks"]
