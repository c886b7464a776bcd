"""The warm fork server for real: ranks forked from `python -m stayalive.training.forkserver`.

Each test runs tests/agent/fork_probe.py as the rank; it reports (as JSON in its log) the argv,
environment, cwd and sys.path it saw and whether torch was already warm when it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from stayalive.agent.forkserver import ForkServer, ForkServers
from stayalive.agent.processes import RankProcess, start_rank, stop_ranks
from stayalive.training.forkserver import profile_for
from stayalive.workers.devstack import process_alive
from tests.helpers import ROOT

PROBE = ROOT / "tests" / "agent" / "fork_probe.py"
MODULE = [sys.executable, "-m", "tests.agent.fork_probe"]


@pytest.fixture(scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ForkServer]:
    """One warm server for the tests that neither kill it nor need an environment of their own."""
    server = ForkServer(tmp_path_factory.mktemp("agent"))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)  # where the probe module is importable
        server.start()
        await server.wait_warm()
    yield server
    await server.close()


@pytest.fixture
def server(shared: ForkServer, monkeypatch: pytest.MonkeyPatch) -> ForkServer:
    monkeypatch.chdir(ROOT)  # ranks start in the agent's cwd
    return shared


@pytest.fixture
async def servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[[], Awaitable[ForkServer]]]:
    """Fresh fork servers started in the repository root, warm."""
    monkeypatch.chdir(ROOT)
    made: list[ForkServer] = []

    async def make() -> ForkServer:
        server = ForkServer(tmp_path / "agent")
        server.start()
        made.append(server)
        await server.wait_warm()
        return server

    yield make
    for server in made:
        await server.close()


def report(rank: RankProcess) -> dict[str, Any]:
    """What the probe saw (the first line of its log)."""
    first: dict[str, Any] = json.loads(rank.log_path.read_text().splitlines()[0])
    return first


async def forked(
    server: ForkServer, argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> RankProcess:
    rank = await server.start_rank(0, 0, argv, env or {}, log, cwd)
    assert rank is not None, "the server refused a launch it can run"
    return rank


async def test_a_forked_rank_runs_a_module_entrypoint_as_a_cold_start_would(
    servers: Callable[[], Awaitable[ForkServer]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORK_PROBE_LEFTOVER", "server only")  # in the server's environment...
    server = await servers()
    monkeypatch.delenv("FORK_PROBE_LEFTOVER")  # ...but no longer in the agent's when the rank starts

    log = tmp_path / "g2" / "rank-5.log"
    rank = await server.start_rank(5, 2, [*MODULE, "7", "--flag"], {"RANK": "5"}, log, ROOT)
    assert rank is not None
    assert await rank.waiter == 7
    assert rank.exit_code == 7 and rank.exited_at is not None
    assert (rank.rank, rank.generation) == (5, 2)
    assert server.process is not None and rank.pid != server.process.pid
    seen = report(rank)
    assert seen["pid"] == rank.pid
    assert seen["argv"] == ["7", "--flag"]
    assert seen["name"] == "__main__"
    assert seen["warm"] is True, "torch.distributed was not imported before the entrypoint ran"
    assert seen["rank"] == "5"
    assert seen["leftover"] is None, "the rank saw a variable the agent no longer has"
    assert seen["cwd"] == seen["path0"] == str(ROOT)  # what `python -m` puts first on sys.path
    assert seen["stdin"] == ""  # /dev/null, as for a cold rank
    tail = rank.log_tail()
    assert "probe stderr line" in tail and "probe atexit ran" in tail
    assert os.getpgid(server.process.pid) != seen["pid"], "the rank leads a process group of its own"


async def test_a_forked_rank_runs_a_script_and_an_exception_exits_1_with_its_traceback(
    server: ForkServer, tmp_path: Path
) -> None:
    rank = await forked(server, [sys.executable, str(PROBE), "raise"], tmp_path / "rank-0.log", cwd=tmp_path)
    assert await rank.waiter == 1
    seen = report(rank)
    assert seen["warm"] is True
    assert seen["cwd"] == str(tmp_path)  # the run's workdir, not the agent's
    assert seen["path0"] == str(PROBE.parent)  # what `python script.py` puts first on sys.path
    tail = rank.log_tail()
    assert "RuntimeError: probe raised" in tail and "probe atexit ran" in tail


async def test_a_forked_rank_takes_the_thread_count_torchrun_gives_it(server: ForkServer, tmp_path: Path) -> None:
    """OMP_NUM_THREADS is read when torch starts, which a forked rank does not: the server applies it
    (as torch.set_num_threads), so the agent's one thread per rank holds for forked ranks too (3: not
    the server's own count, every core of a 2-core host)."""
    rank = await forked(server, MODULE, tmp_path / "rank-0.log", env={"OMP_NUM_THREADS": "3"})
    assert await rank.waiter == 0
    assert report(rank)["threads"] == 3, "the server's own count (every core) where the rank's is 3"


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["/bin/true"], {}),  # not python
        ([sys.executable, "-u", "-m", "tests.agent.fork_probe"], {}),  # an interpreter option
        (MODULE, {"MKL_NUM_THREADS": "3"}),  # read when torch is imported: already too late
        (MODULE, {"OMP_NUM_THREADS": "4,2"}),  # OpenMP's nested counts: no one number to apply
        (MODULE, {"CUDA_VISIBLE_DEVICES": "1"}),
    ],
)
async def test_what_the_server_cannot_honour_starts_cold(
    server: ForkServer, tmp_path: Path, argv: list[str], env: dict[str, str]
) -> None:
    assert await server.start_rank(0, 0, argv, env, tmp_path / "rank-0.log", ROOT) is None
    assert server.warm, "the server stays up for the ranks it can run"


async def test_a_forked_rank_starts_at_least_twice_as_fast_as_a_cold_start(server: ForkServer, tmp_path: Path) -> None:
    """From asking for the rank to its first optimizer step done (the probe's timestamp), both ways."""

    asked = time.time()
    cold = await start_rank(0, 0, [*MODULE, "0"], {}, tmp_path / "cold.log")
    assert await cold.waiter == 0
    cold_s = report(cold)["stepped_at"] - asked

    asked = time.time()
    warm = await forked(server, [*MODULE, "0"], tmp_path / "warm.log")
    assert await warm.waiter == 0
    warm_s = report(warm)["stepped_at"] - asked

    assert report(warm)["warm"] is True and report(cold)["warm"] is False
    assert warm_s * 2 <= cold_s, f"forked {warm_s:.3f}s vs cold {cold_s:.3f}s"


async def test_one_server_forks_many_ranks_at_once_and_reports_each_exit(server: ForkServer, tmp_path: Path) -> None:
    ranks = await asyncio.gather(
        *(forked(server, [*MODULE, str(code)], tmp_path / f"r{code}.log") for code in range(6))
    )
    assert [await r.waiter for r in ranks] == list(range(6))
    assert len({r.pid for r in ranks}) == 6
    assert server.warm and server.process is not None and server.process.returncode is None


async def test_stop_ranks_stops_a_forked_rank(server: ForkServer, tmp_path: Path) -> None:
    rank = await forked(server, [sys.executable, "-m", "http.server", "0"], tmp_path / "rank-0.log")
    await stop_ranks([rank], grace=5.0)
    assert rank.exit_code == 128 + 15  # SIGTERM to its process group, as for a cold rank


async def test_a_killed_rank_reports_its_signal(server: ForkServer, tmp_path: Path) -> None:
    rank = await forked(server, [sys.executable, "-m", "http.server", "0"], tmp_path / "rank-0.log")
    os.kill(rank.pid, signal.SIGKILL)
    await asyncio.wait_for(rank.waiter, 30)
    assert rank.exit_code == 128 + 9


async def test_a_killed_server_takes_its_ranks_with_it_and_another_takes_its_place(
    servers: Callable[[], Awaitable[ForkServer]], tmp_path: Path
) -> None:
    server = await servers()
    rank = await forked(server, [sys.executable, "-m", "http.server", "0"], tmp_path / "rank-0.log")
    first = server.process
    assert first is not None
    first.kill()
    await asyncio.wait_for(rank.waiter, 30)
    assert rank.exit_code == 128 + 9
    for _ in range(100):  # the death signal is asynchronous
        if not process_alive(rank.pid):
            break
        await asyncio.sleep(0.05)
    assert not process_alive(rank.pid), "a rank outlived the server it was forked from"
    await server.wait_warm()
    assert server.process is not first
    again = await forked(server, [*MODULE, "3"], tmp_path / "rank-1.log")
    assert await again.waiter == 3


async def test_closing_the_server_stops_it_and_what_it_runs(
    servers: Callable[[], Awaitable[ForkServer]], tmp_path: Path
) -> None:
    server = await servers()
    rank = await forked(server, [sys.executable, "-m", "http.server", "0"], tmp_path / "rank-0.log")
    assert server.process is not None
    pid = server.process.pid
    await server.close()
    assert not process_alive(pid)
    await asyncio.wait_for(rank.waiter, 30)
    assert rank.exit_code == 128 + 9


@pytest.mark.parametrize(
    ("argv", "profile"),
    [
        ([sys.executable, "-m", "stayalive.training.train", "--preset", "tiny"], "trainer"),
        ([sys.executable, "-m", "tests.agent.fork_probe"], "script"),
        ([sys.executable, "examples/tutorial_ddp.py", "--epochs", "2"], "script"),
    ],
)
def test_stayalives_trainer_and_other_scripts_fork_from_servers_of_their_own(argv: list[str], profile: str) -> None:
    assert profile_for(argv) == profile


async def test_a_foreign_script_is_forked_from_a_server_without_torch_dynamo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch._dynamo imported ahead of a DDP script made it hang at exit (training/forkserver.py)."""
    monkeypatch.chdir(ROOT)
    forks = ForkServers(tmp_path / "agent")
    forks.start()
    try:
        rank = await forks.start_rank(0, 0, [*MODULE, "0"], {"RANK": "0"}, tmp_path / "rank-0.log", ROOT)
        assert rank is not None and await rank.waiter == 0
        seen = report(rank)
        assert seen["warm"] is True and seen["dynamo"] is False
        assert sorted(forks.servers) == ["script", "trainer"]
    finally:
        await forks.close()
