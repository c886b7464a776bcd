"""Warm standbys for real: `python -m training.standby` processes that become ranks.

Each test runs tests/agent/standby_probe.py as the rank; it reports (as JSON in its log) the
argv, environment, cwd and sys.path it saw and whether torch was already warm when it started.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.processes import RankProcess, start_rank, stop_ranks
from agent.standby import StandbyPool
from tests.helpers import ROOT

PROBE = ROOT / "tests" / "agent" / "standby_probe.py"
MODULE = [sys.executable, "-m", "tests.agent.standby_probe"]
NEVER = 3600.0  # refill delay of a pool that must not refill during the test


@pytest.fixture
async def pools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Callable[..., StandbyPool]]:
    """Pools started in the repository root (where the probe module is importable), closed afterwards."""
    monkeypatch.chdir(ROOT)
    made: list[StandbyPool] = []

    def make(size: int, refill_delay: float = NEVER) -> StandbyPool:
        pool = StandbyPool(size, tmp_path / "agent", refill_delay=refill_delay)
        pool.start()
        made.append(pool)
        return pool

    yield make
    for pool in made:
        await pool.close()


def report(rank: RankProcess) -> dict[str, Any]:
    """What the probe saw (the first line of its log)."""
    first: dict[str, Any] = json.loads(rank.log_path.read_text().splitlines()[0])
    return first


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_standby_runs_a_module_entrypoint_as_the_rank(
    pools: Callable[..., StandbyPool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDBY_PROBE_LEFTOVER", "standby only")  # in the standby's environment...
    pool = pools(1)
    await pool.wait_warm()
    standby_pid = pool.standbys[0].process.pid
    monkeypatch.delenv("STANDBY_PROBE_LEFTOVER")  # ...but no longer in the agent's when the rank starts

    log = tmp_path / "g2" / "rank-5.log"
    rank = await pool.take(5, 2, [*MODULE, "7", "--flag"], {"RANK": "5"}, log)
    assert rank is not None
    assert await rank.waiter == 7
    assert rank.exit_code == 7 and rank.exited_at is not None
    assert (rank.rank, rank.generation, rank.pid) == (5, 2, standby_pid)
    seen = report(rank)
    assert seen["argv"] == ["7", "--flag"]
    assert seen["name"] == "__main__"
    assert seen["warm"] is True, "torch._dynamo was not imported before the entrypoint ran"
    assert seen["rank"] == "5"
    assert seen["leftover"] is None, "the rank saw a variable the agent no longer has"
    assert seen["cwd"] == seen["path0"] == str(ROOT)  # what `python -m` puts first on sys.path
    assert seen["stdin"] == ""  # /dev/null, as for a cold rank
    assert "probe stderr line" in rank.log_tail()
    assert pool.standbys == [], "a taken standby is a rank now, not the pool's"


async def test_a_standby_runs_a_script_entrypoint(pools: Callable[..., StandbyPool], tmp_path: Path) -> None:
    pool = pools(1)
    await pool.wait_warm()
    rank = await pool.take(0, 0, [sys.executable, str(PROBE), "0"], {}, tmp_path / "rank-0.log")
    assert rank is not None
    assert await rank.waiter == 0
    seen = report(rank)
    assert seen["warm"] is True
    assert seen["path0"] == str(PROBE.parent)  # what `python script.py` puts first on sys.path


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["/bin/true"], {}),  # not python
        ([sys.executable, "-u", "-m", "tests.agent.standby_probe"], {}),  # an interpreter option
        (MODULE, {"OMP_NUM_THREADS": "3"}),  # read when torch is imported: already too late
        (MODULE, {"CUDA_VISIBLE_DEVICES": "1"}),
    ],
)
async def test_what_a_standby_cannot_honour_starts_cold(
    pools: Callable[..., StandbyPool], tmp_path: Path, argv: list[str], env: dict[str, str]
) -> None:
    pool = pools(1)
    await pool.wait_warm()
    assert await pool.take(0, 0, argv, env, tmp_path / "rank-0.log") is None
    assert pool.warm == 1, "the standby stays in the pool for a rank it can run"


async def test_a_standby_starts_a_rank_at_least_twice_as_fast_as_a_cold_start(
    pools: Callable[..., StandbyPool], tmp_path: Path
) -> None:
    """From asking for the rank to its first optimizer step done (the probe's timestamp), both ways."""
    pool = pools(1)
    await pool.wait_warm()

    asked = time.time()
    cold = await start_rank(0, 0, [*MODULE, "0"], {}, tmp_path / "cold.log")
    assert await cold.waiter == 0
    cold_s = report(cold)["stepped_at"] - asked

    asked = time.time()
    warm = await pool.take(0, 0, [*MODULE, "0"], {}, tmp_path / "warm.log")
    assert warm is not None
    assert await warm.waiter == 0
    warm_s = report(warm)["stepped_at"] - asked

    assert report(warm)["warm"] is True and report(cold)["warm"] is False
    assert warm_s * 2 <= cold_s, f"standby {warm_s:.3f}s vs cold {cold_s:.3f}s"


async def test_the_pool_refills_after_a_take(pools: Callable[..., StandbyPool], tmp_path: Path) -> None:
    pool = pools(2, refill_delay=0.0)
    await pool.wait_warm()
    before = {s.process.pid for s in pool.standbys}
    rank = await pool.take(0, 0, [*MODULE, "0"], {}, tmp_path / "rank-0.log")
    assert rank is not None and rank.pid in before
    await pool.wait_warm()
    after = {s.process.pid for s in pool.standbys}
    assert len(after) == 2
    assert after - before and rank.pid not in after
    await rank.waiter


async def test_stop_ranks_stops_a_rank_running_in_a_standby(pools: Callable[..., StandbyPool], tmp_path: Path) -> None:
    pool = pools(1)
    await pool.wait_warm()
    rank = await pool.take(0, 0, [sys.executable, "-m", "http.server", "0"], {}, tmp_path / "rank-0.log")
    assert rank is not None
    await stop_ranks([rank], grace=5.0)
    assert rank.exit_code == 128 + 15  # SIGTERM to its process group, as for a cold rank


async def test_closing_the_pool_kills_its_standbys(pools: Callable[..., StandbyPool]) -> None:
    pool = pools(2, refill_delay=0.0)
    await pool.wait_warm()
    pids = [s.process.pid for s in pool.standbys]
    await pool.close()
    assert pool.standbys == []
    assert not any(alive(pid) for pid in pids)
