"""What reaches a run between its decisions: the run monitor's reports and the keeper's verdicts (by
signal), node agents' partition reports (by signal), and what people ask (by signal and update),
each in the order it arrived.

The workflow's handlers only put things here; the main loop takes them out and decides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from stayalive.core.decisions.fencing import PartitionReport
    from stayalive.core.messages.events import CheckpointJudged, GpuFailed, MonitorEvent, MonitorReport
    from stayalive.core.run.timeline import Classification


@dataclass
class Request:
    """A drain, a pause or a rollback, asked by a person (or, for a drain, by a detector or by NVML)."""

    kind: Literal["drain", "pause", "rollback"]
    node: str = ""
    reason: str = ""
    step: int = 0
    by: str = "operator"
    gpu: GpuFailed | None = None  # the GPU failure a drain cordons: a failure, paged and counted, not planned
    outcome: str | None = None  # set once the main loop has carried it out
    paged: Classification | None = None  # a GPU failure's paging class, once the drain has recorded it


@dataclass
class Inbox:
    reports: list[MonitorReport] = field(default_factory=list)
    verdicts: list[CheckpointJudged] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    partitions: list[PartitionReport] = field(default_factory=list)
    resumed: bool = False  # a person signalled `resume`
    checkpoint_asked: bool = False  # a person signalled `force_checkpoint`: taken once the ranks train

    def news(self, requests: bool = True, checkpoint: bool = True) -> bool:
        """Something to decide on. `requests`, `checkpoint`: whether a person's requests, and an asked
        checkpoint, count (not while the loop cannot take them: it would wake for nothing)."""
        asked = (requests and bool(self.requests)) or (checkpoint and self.checkpoint_asked)
        return bool(self.reports or self.verdicts or self.partitions) or asked

    def pending(self) -> bool:
        """Something a person asked, or a partition, not yet taken: the next segment would not see it."""
        return bool(self.requests or self.partitions) or self.checkpoint_asked

    async def until(self, ready: Callable[[], bool], timeout: timedelta | None = None) -> bool:
        """Until `ready()` (True), or `timeout` passes (False)."""
        try:
            await workflow.wait_condition(ready, timeout=timeout)
        except TimeoutError:
            return False
        return True

    def hand_over(self, completed: MonitorReport) -> None:
        """What a monitor's completion brought besides its event, as if each had been signalled."""
        if completed.first_step is not None:
            self.reports.append(MonitorReport(generation=completed.generation, event=completed.first_step))
        self.verdicts.extend(completed.verdicts)

    def events(self, generation: int) -> list[MonitorEvent]:
        """The monitor's reports on `generation`, oldest first; reports on an older one are stale."""
        reports, self.reports = self.reports, []
        return [r.event for r in reports if r.generation == generation]

    def take_verdicts(self) -> list[CheckpointJudged]:
        verdicts, self.verdicts = self.verdicts, []
        return verdicts

    def take_partitions(self) -> list[PartitionReport]:
        partitions, self.partitions = self.partitions, []
        return partitions
