"""The run monitor: one long-running activity per generation that reads every node's telemetry, with
two loops.

The watch loop folds the records into core.monitor.watch.GenerationWatch, which runs the detectors and tells
how the generation ends. It heartbeats a live summary (step, loss, steps/s, step-time p50/max,
slowest rank) and signals the workflow a typed event only when the workflow has something to decide:
the first step, a straggler, a slowdown of the whole run, a skipped update, healthy windows for the
fleet's baseline, every rank finished. What ends the generation — a failed rank, a silent node, a
hang, a failed SDC check, every rank holding — it completes with: one completion, not a signal and
then a cancel. The keeper loop (activities/checkpoints.py) judges each checkpoint the ranks commit.

Its place in each node's stream is kept by the node (readers `watch/g<n>` and `keep/g<n>`): a
monitor retried on another supervisor worker, or started by the next workflow segment, resumes
after what the last one acknowledged, and the workflow carries no cursor for any node.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram
from temporalio import activity

from stayalive.activities.checkpoints import Handover, keep_checkpoints
from stayalive.activities.fleet import FleetActivities
from stayalive.activities.reporting import Heartbeat, signal_run
from stayalive.activities.telemetry import NodeStreams
from stayalive.core.messages.events import (
    MONITOR_REPORT,
    AllHeld,
    MonitorEvent,
    MonitorInput,
    MonitorReport,
    RanksFinished,
    ends_generation,
)
from stayalive.core.monitor.watch import GenerationWatch
from stayalive.core.protocol.telemetry import Subscribe
from stayalive.core.run.status import Outage

HEARTBEAT_SECONDS = 1.0
TICK_SECONDS = 0.2  # how often silences, witnesses and the watchdog are looked at with nothing arriving
VERDICT_WITHIN = 300.0  # the held or final step's checkpoint is on storage; its verdict is a validation away
# An ending read while a node's backlog is still coming (a monitor that took over) waits this long at
# most for the steps before it: a hub sends its backlog before its first Beat, a second after it opens.
CATCH_UP_SECONDS = 3.0


def resumed_knowledge(beat: Heartbeat, input: MonitorInput) -> MonitorInput:
    """What an earlier attempt had already reported (the last heartbeat's), so that it is not reported
    again; the workflow also ignores a report it already has."""
    known = beat.resumed
    if "known_stragglers" not in known:
        return input
    return input.model_copy(
        update={
            "known_stragglers": [int(r) for r in known["known_stragglers"]],
            "slowdown_known": bool(known["slowdown_known"]),
            "await_first_step": bool(known["await_first_step"]),
            "storage_outage": Outage.model_validate(outage) if (outage := known.get("storage_outage")) else None,
            "restored_from": known.get("restored_from"),
        }
    )


class MonitorActivities:
    def __init__(self, fleet: FleetActivities, secret: bytes, judging_lag: Histogram) -> None:
        self.fleet = fleet  # where each node agent's hub listens
        self.secret = secret  # the fleet's: what the hubs take for a run's records
        self.judging_lag = judging_lag  # the supervisor's /metrics: how far behind its monitors judge

    @activity.defn
    async def monitor_run(self, input: MonitorInput) -> MonitorReport:
        """Watch the generation until something ends it (completing with that), signalling on the way
        what the detectors find and each checkpoint's verdict."""
        hubs = await self.fleet.hubs(input.nodes)
        beat, handover = Heartbeat(), Handover()
        lag = self.judging_lag.labels(activity.info().workflow_id)
        watching = asyncio.create_task(watch(input, hubs, self.secret, beat, handover, lag))
        keeping = asyncio.create_task(
            keep_checkpoints(input, input.keeper, hubs, self.secret, beat, handover)
            if input.keeper
            else asyncio.Event().wait()
        )
        try:
            await asyncio.wait([watching, keeping], return_when=asyncio.FIRST_COMPLETED)
            if keeping.done():
                keeping.result()  # the keeper only returns when the run is gone (or raises)
            return await watching
        finally:  # a cancel lands here too: the workflow waits for this attempt to end (calls.monitor)
            for task in (watching, keeping):
                task.cancel()
            await asyncio.gather(watching, keeping, return_exceptions=True)


async def watch(
    input: MonitorInput,
    hubs: dict[str, str],
    secret: bytes,
    beat: Heartbeat,
    handover: Handover,
    judging_lag: Histogram,
) -> MonitorReport:
    """Fold every record and step frame into the generation's watch; signal its findings; return what
    ended it, once every node's backlog is in (the steps completed before it are judged and their
    findings signalled: a monitor taking over reads one node's crash before another's steps).
    Records are acknowledged to their nodes with each heartbeat, never past an ending. `judging_lag`
    observes how long after its newest report each step was judged."""
    now = time.monotonic()
    ending: MonitorEvent | None = None
    catch_up_until = 0.0
    seen = GenerationWatch(resumed_knowledge(beat, input), now, time.time())
    subscribe = Subscribe(
        run_id=input.run_id,
        reader=f"watch/g{input.generation}",
        generation=input.generation,
        packed_ranks=input.ranks_per_node if input.hooks else None,
        only=None if input.hooks else ["started", "exited"],  # a plain script says nothing itself
    )
    next_beat = next_tick = 0.0
    async with NodeStreams(subscribe, hubs, secret, on_frame=seen.ingest.add) as streams:
        seen.heard = streams.heard  # anything a node sends counts as hearing from it
        while True:
            first = await streams.next(timeout=TICK_SECONDS)
            records = [first, *streams.drain()] if first is not None else []
            places = dict(streams.read)  # everything read so far is in `records` or in the step ingest
            now = time.monotonic()
            found = [seen.record(r.node, r.message, now) for r in records]
            # Steps every rank completed came before any failure in the same batch (a monitor taking
            # over reads a backlog): the generation's first step is reported before what ended it.
            events: list[MonitorEvent | None] = [*seen.steps(now), *found]
            wall = time.time()
            for done_at in seen.judged_at:
                judging_lag.observe(wall - done_at)
            if now >= next_tick:
                events.append(seen.tick(now, time.time()))
                next_tick = now + TICK_SECONDS
            if (held := seen.all_held()) is not None:
                judged = await handover.held(held, VERDICT_WITHIN)
                ended = AllHeld(step=held, judged=judged, progress=seen.summary())
                return MonitorReport(generation=input.generation, event=ended)
            for event in events:
                if ends_generation(event):
                    if ending is None:
                        ending, catch_up_until = event, now + CATCH_UP_SECONDS
                    continue
                if isinstance(event, RanksFinished) and ending is None:
                    return MonitorReport(generation=input.generation, event=await _with_verdict(event, input, handover))
                if event is not None:
                    if not await signal_run(MONITOR_REPORT, MonitorReport(generation=input.generation, event=event)):
                        await _until_cancelled(beat)
                    seen.reported(event, now)
            if ending is not None and (not streams.behind() or now >= catch_up_until):
                return MonitorReport(generation=input.generation, event=ending)
            if now >= next_beat:
                beat(progress=seen.summary().model_dump(), **seen.knowledge())
                streams.keepalive()
                # A witness's record, or an ending's, must be read again by a monitor that replaces this one.
                if seen.witness is None and ending is None:
                    streams.ack(places)
                next_beat = now + HEARTBEAT_SECONDS


async def _with_verdict(finished: RanksFinished, input: MonitorInput, handover: Handover) -> RanksFinished:
    """Every rank has finished: nothing is left to watch but the keeper's verdict on the final
    checkpoint, where the workflow asked for one (KeeperInput.final_step). The monitor ends with it
    instead of waiting to be cancelled (a cancel reaches an activity only with its next heartbeat)."""
    keeper, step = input.keeper, finished.last_step
    if keeper is None or step is None or step != keeper.final_step:
        return finished
    return finished.model_copy(update={"judged": await handover.held(step, VERDICT_WITHIN)})


async def _until_cancelled(beat: Heartbeat) -> None:
    """The workflow run is gone (continued as new, or over): heartbeat until the cancel arrives."""
    while True:
        beat()
        await asyncio.sleep(HEARTBEAT_SECONDS)
