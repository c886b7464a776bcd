"""One generation as the run monitor sees it, folded from its node agents' records: what the workflow
must hear of (its first step, a straggler, a slowdown, healthy windows, a skipped update, a storage
outage) and what ends it (a failed rank, a silent node, a hang, a failed SDC check, every rank done
or holding).

Pure: records, step frames and the time come in; events come out. activities/monitor.py feeds it
from the hubs and signals what it returns. Every report costs O(1) amortized at any width: steps
arrive as one frame per node (core.monitor.progress.StepIngest) and a node is checked for silence once a tick.
"""

from __future__ import annotations

import statistics

import numpy as np

from stayalive.core.decisions.goodput import straggler_wait
from stayalive.core.decisions.paging import storage_outage
from stayalive.core.judgement.detectors import WINDOW_STEPS, AbsoluteSlowdown, HangWatchdog, RelativeStraggler
from stayalive.core.judgement.diagnosis import GpuHealth, Verdict, diagnose
from stayalive.core.judgement.gpu_faults import hard_faults
from stayalive.core.messages.events import (
    AnomalyFound,
    FirstStep,
    GpuFailed,
    Hang,
    HealthyWindows,
    MonitorEvent,
    MonitorInput,
    NodeLost,
    ProgressRefresh,
    RankFailed,
    RanksFinished,
    SdcDetected,
    SlowdownFound,
    SlownessTally,
    StorageOutage,
    StragglerFound,
)
from stayalive.core.monitor.progress import CompletedStep, StepIngest
from stayalive.core.protocol.telemetry import (
    Anomaly,
    CheckpointCommitted,
    Finished,
    GpuReport,
    Held,
    RankExited,
    RankMessage,
    RankStarted,
    Resumed,
    SdcCheck,
    StorageUnavailable,
)
from stayalive.core.run.launch import node_of
from stayalive.core.run.status import Outage, Progress
from stayalive.core.run.timeline import PagingClass

# A rank that died of a lost peer waits this long past the silence timeout for the rank or node that
# actually failed, whose own exit or silence names the culprit.
WITNESS_GRACE_S = 5.0


class GenerationWatch:
    def __init__(self, input: MonitorInput, now: float, wall: float) -> None:
        """`now` is monotonic (silences, tallies); `wall` is time.time() (the hang watchdog compares
        it with the ranks' report times)."""
        self.input = input
        self.known_stragglers = list(input.known_stragglers)
        self.slowdown_known = input.slowdown_known
        self.await_first_step = input.await_first_step
        self.ingest = StepIngest(input.world_size, input.ranks_per_node, input.generation)
        self.relative = RelativeStraggler(input.world_size, sigma=input.straggler_sigma, k=input.straggler_steps)
        self.absolute = AbsoluteSlowdown(input.baseline)
        # Not awaiting its first step: the generation was past it when this watch began (a monitor
        # taking over, a re-attach after continue-as-new), so no warm-up allowance is due.
        warm = input.hooks and not input.await_first_step
        self.watchdog = HangWatchdog(
            input.step_timeout or "auto", known_step_s=input.known_step_s, warm=warm, startup_s=input.startup_timeout
        )
        self.watchdog.last_progress_at = wall  # the clock runs from the monitor's start
        self.heard = dict.fromkeys(input.nodes, now)  # node → when its agent last said anything
        self.gpus: dict[str, list[GpuHealth]] = {}
        self.window: list[float] = []  # the current window's step times
        self.healthy: list[float] = []  # medians of consecutive healthy windows, for the fleet's baseline
        self.restored_from = input.restored_from
        self.straggler_s = 0.0  # what the stragglers and slowdowns this generation knows of cost so far
        self.next_tally = now + input.tally_s
        self.next_progress = now + input.progress_s
        self.finished: set[int] = set()  # ranks that exited cleanly (or said they finished)
        self.exited: set[int] = set()  # ranks whose process is gone
        self.finished_since: float | None = None  # when the first rank finished: the exit grace runs from it
        self.started: set[int] = set()  # a plain script's ranks whose process is up (it reports no steps)
        self.held: dict[int, int] = {}  # rank → the step it holds at
        self.witness: RankFailed | None = None  # a rank that died of a lost peer, and until when it waits
        self.witness_until = 0.0
        self.first: CompletedStep | None = None  # the generation's first step, once it is done
        self.outage: Outage | None = input.storage_outage  # checkpoint storage away, until a commit
        self.committed_at = 0.0  # the newest commit's time: a failure reported from before it is over
        self.judged_at: list[float] = []  # when each step the last `steps()` judged was done (its newest report)

    # -- what comes in -------------------------------------------------------------------------

    def heard_from(self, node: str, now: float) -> None:
        self.heard[node] = now

    def record(self, node: str, message: RankMessage, now: float) -> MonitorEvent | None:
        """Fold in one record (not a step: those come as frames); the event it makes, if any."""
        if isinstance(message, GpuReport):
            return self._gpus(message)
        elif getattr(message, "generation", self.input.generation) != self.input.generation:
            return None
        elif isinstance(message, RankExited):
            return self._exited(node, message, now)
        elif isinstance(message, RankStarted):
            return self._started(message)
        elif isinstance(message, Resumed):
            self.restored_from = message.source
        elif isinstance(message, Finished):
            self._finished(message.rank, now)
        elif isinstance(message, Held):
            self.held[message.rank] = message.step
        elif isinstance(message, SdcCheck) and not message.passed:
            return SdcDetected(check=message, progress=self.summary())
        elif isinstance(message, Anomaly):
            return AnomalyFound(anomaly=message, progress=self.summary())
        elif isinstance(message, StorageUnavailable | CheckpointCommitted):
            return self._storage(message)
        return None

    def steps(self, now: float) -> list[MonitorEvent]:
        """Fold in the step frames that arrived; the events the completed steps make."""
        events: list[MonitorEvent] = []
        self.judged_at = []
        for done in self.ingest.complete():
            self.judged_at.append(done.at)
            self.watchdog.progress(done.step, done.at, done.step_time)
            if self.await_first_step and self.first is None and done.step > self.input.resume_step:
                self.first = done  # when the generation's first step was done, not when it was read
            if (event := self._judge(done, now)) is not None:
                events.append(event)
        if self.await_first_step and (first := self.first) is not None:
            summary = self.summary()
            events.insert(
                0, FirstStep(step=first.step, at=first.at, restored_from=self.restored_from, progress=summary)
            )
        return events

    def tick(self, now: float, wall: float) -> MonitorEvent | None:
        """Once in a while (every second or so): a silent node, a witness that waited long enough, a
        hang, or all ranks holding."""
        silence = self.input.node_silence
        for node, heard in self.heard.items():
            if now - heard > silence:
                return NodeLost(
                    node=node, detail=f"its agent said nothing for {now - heard:.0f}s", progress=self.summary()
                )
        if self.witness is not None and now >= self.witness_until:
            return self.witness
        if (lasting := self._storage_lasting(wall)) is not None:
            return lasting
        if self.finished_since is not None:
            return self._lingered(now)
        if len(self.held) >= self.input.world_size:
            return None  # every rank holds: no step is due
        if self.input.hooks and self.watchdog.overdue(wall):
            stalled = wall - (self.watchdog.last_progress_at or wall)
            return Hang(
                step=self.ingest.summary().step,
                stalled_s=stalled,
                timeout_s=self.watchdog.timeout,
                at=wall,
                progress=self.summary(),
            )
        return None

    def all_held(self) -> int | None:
        """The step every rank holds at, once every rank does (they agreed on it: one step)."""
        steps = set(self.held.values())
        if len(self.held) < self.input.world_size or len(steps) != 1:
            return None
        return steps.pop()

    # -- what goes out -------------------------------------------------------------------------

    def summary(self) -> Progress:
        return self.ingest.summary().model_copy(update={"straggler_s": self.straggler_s})

    def reported(self, event: MonitorEvent, now: float) -> None:
        """The workflow has it: count the slowness afresh, and know what it now knows."""
        self.straggler_s = 0.0
        self.next_tally = now + self.input.tally_s
        self.next_progress = now + self.input.progress_s  # every report carries the live numbers
        if isinstance(event, FirstStep):
            self.await_first_step = False
        elif isinstance(event, StragglerFound):
            self.known_stragglers.append(event.rank)
        elif isinstance(event, SlowdownFound):
            self.slowdown_known = True

    def knowledge(self) -> dict[str, object]:
        return {
            "known_stragglers": self.known_stragglers,
            "slowdown_known": self.slowdown_known,
            "await_first_step": self.await_first_step,
            "storage_outage": self.outage.model_dump() if self.outage else None,
            "restored_from": self.restored_from,
        }

    # -- checkpoint storage --------------------------------------------------------------------

    def _storage(self, message: StorageUnavailable | CheckpointCommitted) -> StorageOutage | None:
        """The first rank whose write fails opens an outage; the next commit (every shard and the
        manifest landed) closes it: storage serves every rank again."""
        outage = self.outage
        if isinstance(message, StorageUnavailable):
            if outage is not None or message.since < self.committed_at:
                return None
            self.outage = Outage(since=message.since, error=message.error, step=message.step)
            return StorageOutage(phase="began", outage=self.outage, at=message.since, progress=self.summary())
        self.committed_at = max(self.committed_at, message.at)
        if outage is None:
            return None
        self.outage = None
        return StorageOutage(
            phase="over", outage=outage, at=message.at, landed_step=message.step, progress=self.summary()
        )

    def _storage_lasting(self, wall: float) -> StorageOutage | None:
        """An outage past paging's bound, once: the bound counts checkpoint intervals, at the
        generation's interval in steps and its step time so far."""
        outage = self.outage
        if outage is None or outage.paged or self.input.keeper is None:
            return None
        interval_s = self.input.keeper.checkpoint_steps * self.ingest.summary().step_seconds_p50
        paging = storage_outage(wall - outage.since, interval_s, outage.error)
        if paging.paging == PagingClass.INDEPENDENT:
            return None
        self.outage = outage.model_copy(update={"paged": True})
        return StorageOutage(phase="lasting", outage=self.outage, at=wall, paging=paging, progress=self.summary())

    # -- how it ends ---------------------------------------------------------------------------

    def _started(self, started: RankStarted) -> FirstStep | None:
        """A plain script reports no steps: its generation runs once every rank's process is up."""
        if self.input.hooks or not self.await_first_step:
            return None
        self.started.add(started.rank)
        if len(self.started) < self.input.world_size:
            return None
        return FirstStep(step=self.input.resume_step, at=started.at, progress=self.summary())

    def _finished(self, rank: int, now: float) -> None:
        self.finished.add(rank)
        if self.finished_since is None:
            self.finished_since = now

    def _lingered(self, now: float) -> RanksFinished | None:
        """Some rank has finished: once the exit grace is over, whoever is still running lingers."""
        grace = self.input.exit_grace
        if self.finished_since is None or now - self.finished_since < grace:
            return None
        lingering = sorted(set(range(self.input.world_size)) - self.exited)
        return RanksFinished(
            generation=self.input.generation,
            last_step=None,
            progress=self.summary(),
            lingering=lingering,
            grace_s=grace,
        )

    def _gpus(self, report: GpuReport) -> GpuFailed | None:
        """A node's GPU reading: kept for the straggler diagnosis, and judged against the node's last
        one for failures that make nothing slow."""
        faults = hard_faults(self.gpus.get(report.node), report.readings)
        self.gpus[report.node] = report.readings
        if not faults:
            return None
        return GpuFailed(node=report.node, faults=faults, progress=self.summary())

    def _exited(self, node: str, exited: RankExited, now: float) -> MonitorEvent | None:
        self.exited.add(exited.rank)
        # A rank that said it finished did its work, however it leaves: an abort at exit must not
        # restart a finished run (torchrun restarts a rank that exits non-zero, whatever it finished).
        if exited.exit_code == 0 or exited.rank in self.finished:
            self._finished(exited.rank, now)
            if len(self.finished) >= self.input.world_size:
                return RanksFinished(
                    generation=self.input.generation, last_step=exited.last_step, progress=self.summary()
                )
            return None
        failed = RankFailed(
            node=node,
            generation=exited.generation,
            rank=exited.rank,
            exit_code=exited.exit_code,
            last_step=exited.last_step,
            at=exited.at,
            log_tail=exited.log_tail,
            progress=self.summary(),
        )
        if not failed.peer_lost:
            return failed  # the culprit
        if self.witness is None:  # it died of a lost peer: wait for the rank or node that failed
            self.witness, self.witness_until = failed, now + self.input.node_silence + WITNESS_GRACE_S
        return None

    # -- detectors -----------------------------------------------------------------------------

    def _judge(self, done: CompletedStep, now: float) -> MonitorEvent | None:
        step, compute = done.step, done.compute_s
        known_slowdown = self.absolute.baseline_median if self.slowdown_known and self.absolute.armed else None
        self.straggler_s += straggler_wait(compute, done.step_time, self.known_stragglers, known_slowdown)
        for flag in self.relative.observe(step, compute):
            if flag.rank not in self.known_stragglers:
                self.healthy.clear()
                # What the barrier waited for it while the detector gathered its k steps of evidence:
                # rent already paid, which the ladder's first rung may be bought with.
                self.straggler_s += self.relative.k * max(0.0, flag.ratio - 1.0) * float(np.nanmedian(compute))
                node = node_of(self.input.nodes, self.input.ranks_per_node, flag.rank) or "?"
                return StragglerFound(
                    rank=flag.rank,
                    node=node,
                    step=step,
                    ratio=flag.ratio,
                    z=flag.z,
                    verdict=self._verdict(node),
                    rack=self.gpus[node][0].rack if self.gpus.get(node) else None,
                    progress=self.summary(),
                )
        if (slow := self.absolute.observe(step, done.step_s)) is not None and not self.slowdown_known:
            self.healthy.clear()
            verdicts = {n: v for n in sorted(self.gpus) if (v := self._verdict(n)) is not None}
            return SlowdownFound(
                step=step,
                ratio=slow.ratio,
                window_median=slow.window_median,
                baseline_median=slow.baseline_median,
                verdicts=verdicts,
                progress=self.summary(),
            )
        # A tally or a refresh moves its own clock on at once: a batch of steps read together must
        # make one, not one per step (`reported` moves them again once the workflow has it).
        if (self.known_stragglers or self.slowdown_known) and now >= self.next_tally:
            self.next_tally = now + self.input.tally_s
            return SlownessTally(progress=self.summary())
        if (window := self._window(done.step_time)) is not None:
            return window
        if now >= self.next_progress:
            self.next_progress = now + self.input.progress_s
            return ProgressRefresh(progress=self.summary())
        return None

    def _verdict(self, node: str) -> Verdict | None:
        """The diagnosis of one node (docs/architecture.md §11) from its GPUs and its rack's (the other
        nodes of this run)."""
        readings = self.gpus.get(node)
        if not readings:
            return None
        rack = readings[0].rack
        peers = [g for n, gs in self.gpus.items() if n != node for g in gs if g.rack == rack]
        return diagnose(readings, peers)

    def _window(self, step_s: float) -> MonitorEvent | None:
        """Healthy windows (none slow against the baseline, no straggler known) teach the fleet's
        baseline; a slow one starts the count over, so a slowdown never becomes the norm."""
        if np.isnan(step_s):
            return None
        self.window.append(step_s)
        if len(self.window) < WINDOW_STEPS:
            return None
        median = statistics.median(self.window)
        self.window.clear()
        if self.known_stragglers or (self.absolute.armed and median > self.absolute.threshold):
            self.healthy.clear()
            return None
        self.healthy.append(median)
        if len(self.healthy) < self.input.healthy_windows:
            return None
        medians, self.healthy = self.healthy, []
        return HealthyWindows(medians=medians, progress=self.summary())
