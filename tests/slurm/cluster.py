"""A real Slurm cluster on this one host, for the launcher's tests: munged, slurmctld, and one slurmd
per node, each node a network namespace of its own on one bridge (workers/netns.py's Segment), so
every node has its own address, as on a cluster, and a node agent on it binds that address.

    with SlurmCluster.start(tmp_path, ["c1", "c2", "c3"], index=7) as cluster:
        job = cluster.sbatch(["examples/stayalive.sbatch", "spec.json"], nodes=3, env=...)
        cluster.wait_state(job, "RUNNING")

Debian's slurm-wlm 22.05 (slurmctld, slurmd, munge). Its build has no multiple-slurmd support, but
slurmds in separate network namespaces never meet: each listens on its own node's address.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from stayalive.workers.devstack import end_process
from stayalive.workers.netns import Segment

COMMANDS = ["munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun", "nsenter"]
PORTS = (16817, 16818)  # slurmctld's and every slurmd's (each slurmd in its own namespace)


def missing() -> str | None:
    """Why a Slurm cluster cannot be started here, or None if it can."""
    if os.geteuid() != 0:
        return "a Slurm cluster (slurmd, network namespaces) needs root"
    absent = [command for command in COMMANDS if shutil.which(command) is None]
    if absent:
        return f"{', '.join(absent)} missing: apt-get install slurm-wlm munge util-linux"
    return None


def _config(root: Path, segment: Segment, cpus: int) -> str:
    names = ",".join(segment.hosts)
    return "\n".join(
        [
            "ClusterName=stayalive-test",
            f"SlurmctldHost={os.uname().nodename.split('.')[0]}({segment.host_ip})",
            f"SlurmctldPort={PORTS[0]}",
            f"SlurmdPort={PORTS[1]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge.socket'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}/%n",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd'}-%n.pid",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'slurmd'}-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "KillWait=5",
            "MinJobAge=600",
            *(f"NodeName={host} NodeAddr={segment.ip(host)} CPUs={cpus} State=UNKNOWN" for host in segment.hosts),
            f"PartitionName=batch Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
            "",
        ]
    )


@dataclass
class SlurmCluster:
    root: Path
    segment: Segment
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What Slurm's commands need to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    @classmethod
    def start(cls, root: Path, nodes: list[str], index: int, cpus: int = 2) -> SlurmCluster:
        segment = Segment.create("slm", index, nodes)
        cluster = cls(root, segment)
        try:
            cluster._start(cpus)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self, cpus: int) -> None:
        for folder in ("state", "spool", "munge"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(_config(self.root, self.segment, cpus))
        munge = self.root / "munge"
        argv = ["munged", "--foreground", "--force", f"--socket={self.root / 'munge.socket'}", f"--key-file={key}"]
        argv += [f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}"]
        self._spawn("munged", [*argv, f"--seed-file={munge / 'munged.seed'}"])
        self._wait(lambda: (self.root / "munge.socket").exists(), "munged did not open its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for host in self.segment.hosts:
            self._spawn(
                f"slurmd-{host}", [*self.segment.exec_prefix(host), "slurmd", "-D", "-N", host, "-f", str(self.conf)]
            )
        self._wait(self._nodes_idle, "the nodes did not come up idle")

    def _nodes_idle(self) -> bool:
        states = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split("\n")
        idle = {line.split()[0] for line in states if line.strip().endswith("idle")}
        return idle == set(self.segment.hosts)

    def _wait(self, ready: object, why: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():  # type: ignore[operator]
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}; see {self.root / (name + '.out')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{why} within {timeout:g}s; see the logs in {self.root}")
            time.sleep(0.2)

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.root / f"{name}.out", "ab") as out:
            self.processes[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=os.environ | self.env
            )

    def run(
        self, *argv: str, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=os.environ | self.env | (env or {}))
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
        return done

    def stop(self) -> None:
        for name in reversed(list(self.processes)):  # slurmds first, munged last
            end_process(self.processes[name])
        self.processes.clear()
        self.segment.close()

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
