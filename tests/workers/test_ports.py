"""A port in use is reported by the process that cannot bind it, and a second stack takes free ports."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stayalive.workers.devstack import DevStack, StackError, free_or_any
from stayalive.workers.secret import create_secret
from tests.helpers import ROOT


@pytest.fixture
def taken() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_port_in_use_is_passed_over_and_a_free_one_kept(taken: int) -> None:
    assert free_or_any(taken) != taken
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    assert free_or_any(free) == free


def test_supervisor_says_its_metrics_port_is_taken_and_exits(taken: int, tmp_path: Path) -> None:
    secret = create_secret(tmp_path / "secret")
    argv = [
        sys.executable,
        "-m",
        "stayalive.workers.supervisor",
        "--address",
        "127.0.0.1:1",
        "--metrics-port",
        str(taken),
    ]
    argv += ["--secret-file", str(secret)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode != 0
    assert f"cannot serve /metrics on 127.0.0.1:{taken}: Address already in use" in done.stderr, done.stderr
    assert "--metrics-port" in done.stderr


async def test_a_stack_whose_supervisor_cannot_start_says_so_at_once(taken: int, tmp_path: Path) -> None:
    """bench.recovery used to wait 180 s here for a fleet that never formed."""
    stack = DevStack(state_dir=tmp_path, nodes=["n1"], ui_port=None, metrics_port=taken, workdir=ROOT)
    stack.start()
    try:
        with pytest.raises(StackError, match="supervisor exited with status 1") as caught:
            await stack.ready(timeout=60)
        assert "Address already in use" in str(caught.value)
        assert stack.port != taken and stack.metrics_port == taken
    finally:
        stack.stop()
