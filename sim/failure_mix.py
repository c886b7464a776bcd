"""The failure mix the simulator draws from, as measured: what interrupted Llama 3 405B's pre-training
(Table 5 of "The Llama 3 Herd of Models", Meta 2024: 419 unexpected interruptions over 54 days on
16,384 H100 GPUs, plus 47 planned ones), which kind of interruption stayalive would see for each
component (MAPPING), and a run's draws from it: when each interruption comes, what kind, on which node.

The counts are data/llama3-405b-interruptions.csv; the run's size and length, and the planned count,
are the constants below, as the file's header comment states them.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np

LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_PLANNED_INTERRUPTIONS = 47  # automated maintenance: firmware upgrades, configuration or dataset updates
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_GPUS_PER_HOST = 8
LLAMA3_HOSTS = LLAMA3_GPUS // LLAMA3_GPUS_PER_HOST
LLAMA3_CSV = Path(__file__).resolve().parents[1] / "data" / "llama3-405b-interruptions.csv"
PLANNED_COMPONENT = "Planned maintenance"  # not a row of the CSV: the paper gives only the count

UnexpectedKind = Literal[
    "crash", "node_lost", "hang", "straggler", "slowdown", "sdc_transient", "sdc_deterministic", "checkpoint_damaged"
]
Kind = UnexpectedKind | Literal["drain"]
UNEXPECTED_KINDS: tuple[UnexpectedKind, ...] = get_args(UnexpectedKind)


@dataclass(frozen=True)
class ComponentMapping:
    """What one component's failures look like to stayalive: each kind's share of its count, and why."""

    component: str
    shares: tuple[tuple[Kind, float], ...]
    reason: str


def _all(kind: Kind) -> tuple[tuple[Kind, float], ...]:
    return ((kind, 1.0),)


MAPPING: tuple[ComponentMapping, ...] = (
    ComponentMapping(
        "Faulty GPU",
        (("crash", 0.9), ("straggler", 0.1)),
        "an Xid error or a GPU off the bus kills its rank; a few degrade instead (clocks capped, PCIe downtrained)",
    ),
    ComponentMapping(
        "GPU HBM3 memory", _all("crash"), "an uncorrectable ECC error loses the CUDA context, and the rank"
    ),
    ComponentMapping("Software bug", _all("crash"), "an exception or a segfault exits the rank's process"),
    ComponentMapping(
        "Network switch or cable", _all("hang"), "a collective waits forever on a peer it can no longer reach"
    ),
    ComponentMapping("Host maintenance", _all("node_lost"), "unplanned: the host is taken out from under its ranks"),
    ComponentMapping("GPU SRAM memory", _all("crash"), "an uncorrectable on-chip ECC error is an Xid: the rank dies"),
    ComponentMapping("GPU system processor", _all("crash"), "the GSP stops answering the driver, which fails the rank"),
    ComponentMapping("NIC", _all("hang"), "the host's ranks stop sending; every process lives on inside a collective"),
    ComponentMapping(
        "NCCL watchdog timeouts",
        _all("hang"),
        "a collective stops with every process alive; the watchdog aborts only after its timeout, long after",
    ),
    ComponentMapping(
        "Silent data corruption",
        (("sdc_transient", 0.5), ("sdc_deterministic", 0.5)),
        "the table does not say whether a recompute reproduces it; half each until measured",
    ),
    ComponentMapping(
        "GPU thermal interface and sensor",
        (("slowdown", 0.5), ("crash", 0.5)),
        "a bad thermal path throttles clocks (the synchronous job slows as one) or trips the thermal shutdown",
    ),
    ComponentMapping(
        "SSD",
        (("node_lost", 2 / 3), ("checkpoint_damaged", 1 / 3)),
        "a dead drive takes its host's filesystem down; one in three a checkpoint shard it wrote reads back wrong",
    ),
    ComponentMapping("Power supply", _all("node_lost"), "the host loses power"),
    ComponentMapping("Server chassis", _all("node_lost"), "the host goes down with its chassis"),
    ComponentMapping(
        "IO expansion board", _all("node_lost"), "the GPUs and NICs behind the board vanish from the host"
    ),
    ComponentMapping("Dependency", _all("crash"), "a service the job needs fails, and the rank that called it exits"),
    ComponentMapping("CPU", _all("node_lost"), "a machine-check exception panics the host's kernel"),
    ComponentMapping("System memory", _all("node_lost"), "an uncorrectable DRAM error panics the host's kernel"),
    ComponentMapping(
        PLANNED_COMPONENT, _all("drain"), "automated maintenance is planned: the workflow drains the host first"
    ),
)


@dataclass(frozen=True)
class Source:
    """One component's share of one kind: how many of the Llama 3 run's interruptions it made (a
    fraction where the component splits over kinds)."""

    component: str
    kind: Kind
    count: float


@dataclass(frozen=True)
class FailureMix:
    """Every source's expected count over the Llama 3 run (LLAMA3_DAYS on LLAMA3_GPUS)."""

    sources: tuple[Source, ...]

    def expected(self, kind: Kind) -> float:
        """The kind's expected count over the Llama 3 run."""
        return sum(s.count for s in self.sources if s.kind == kind)

    def rate_per_gpu_hour(self, kind: UnexpectedKind | None = None) -> float:
        """Unexpected interruptions per GPU-hour: of `kind`, or of every kind."""
        kinds = UNEXPECTED_KINDS if kind is None else (kind,)
        return sum(self.expected(k) for k in kinds) / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)

    def mtbf_hours(self, gpus: int) -> float:
        """Mean time between unexpected interruptions of one synchronous job on `gpus` GPUs: it stops
        when any of them fails, so its rate is every GPU's rate added up."""
        return 1 / (self.rate_per_gpu_hour() * gpus)


def load_mix(path: Path | None = None) -> FailureMix:
    """The mix in the CSV at `path` (the Llama 3 table by default), every component as MAPPING says."""
    with (path or LLAMA3_CSV).open(newline="") as file:
        rows = list(csv.DictReader(line for line in file if not line.startswith("#")))
    # The percent column is not read: the paper's 30.1% for "Faulty GPU" is not 148/419.
    counts = {row["component"]: int(row["count"]) for row in rows}
    mapped = {m.component for m in MAPPING} - {PLANNED_COMPONENT}
    if set(counts) != mapped:
        raise ValueError(f"components unmapped: {sorted(set(counts) - mapped)}, absent: {sorted(mapped - set(counts))}")
    if sum(counts.values()) != LLAMA3_UNEXPECTED_INTERRUPTIONS:
        raise ValueError(f"the counts sum to {sum(counts.values())}, not {LLAMA3_UNEXPECTED_INTERRUPTIONS}")
    counts[PLANNED_COMPONENT] = LLAMA3_PLANNED_INTERRUPTIONS
    return FailureMix(
        tuple(Source(m.component, kind, counts[m.component] * share) for m in MAPPING for kind, share in m.shares)
    )


@dataclass(frozen=True)
class Draw:
    """One interruption of a simulated run: `at_s` seconds in, of `kind`, on node index `node`."""

    at_s: float
    kind: Kind
    node: int
    component: str


def per_hour(source: Source, gpus: int, nodes: int) -> float:
    """The source's rate on a job of `gpus` GPUs in `nodes` nodes: the Llama 3 run's, scaled to the job."""
    # A synchronous job stops when any of its GPUs fails, so failures scale with its GPUs. Maintenance is
    # per host, so the 47 planned interruptions of Llama 3's whole cluster scale with the job's nodes; at
    # Llama 3's 8 GPUs a host that is linear in GPUs too.
    share = nodes / LLAMA3_HOSTS if source.kind == "drain" else gpus / LLAMA3_GPUS
    return source.count / (LLAMA3_DAYS * 24) * share


def draw(mix: FailureMix, gpus: int, days: float, seed: int, nodes: int) -> list[Draw]:
    """A run's interruptions over `days` on `gpus` GPUs in `nodes` nodes, in time order: one Poisson
    process per source (their sum per kind is that kind's Poisson process), each on a uniformly random
    node. The same seed draws the same run."""
    rng = np.random.default_rng(seed)
    mean_gap_s = np.array([3600 / per_hour(source, gpus, nodes) for source in mix.sources])
    process, at_s = arrivals(rng, mean_gap_s, days * 24 * 3600)
    on = rng.integers(nodes, size=len(at_s))
    sources = [mix.sources[p] for p in process]
    return [Draw(t, s.kind, n, s.component) for s, t, n in zip(sources, at_s.tolist(), on.tolist(), strict=True)]


def arrivals(
    rng: np.random.Generator, mean_gap_s: np.ndarray, horizon_s: float, batch: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Independent Poisson processes' arrivals before `horizon_s`, one process per entry of
    `mean_gap_s` (its mean time between arrivals): each arrival's process, and its time, in time order.
    Each process adds up exponential gaps, `batch` of them at a time."""
    # By default a batch covers the horizon for the busiest process almost always (its mean count and
    # four standard deviations more), so a run costs a few calls into numpy, not two per interruption.
    busiest = horizon_s / mean_gap_s.min()
    shape = (len(mean_gap_s), batch or int(busiest + 4 * busiest**0.5) + 1)
    at_s = np.cumsum(rng.exponential(mean_gap_s[:, None], size=shape), axis=1)
    while (at_s[:, -1] < horizon_s).any():
        later = np.cumsum(rng.exponential(mean_gap_s[:, None], size=shape), axis=1)
        at_s = np.hstack([at_s, at_s[:, -1:] + later])
    before = at_s < horizon_s
    process, _ = np.nonzero(before)
    order = np.argsort(at_s[before], kind="stable")
    return process[order], at_s[before][order]
