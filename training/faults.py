"""Fault injection inside a rank: the failures of the run spec's fault plan, made real."""

from __future__ import annotations

import os

import structlog

from core.faults import Crash, Fault

log = structlog.get_logger()


class FaultInjector:
    def __init__(self, faults: list[Fault], rank: int, generation: int) -> None:
        self.faults = [f for f in faults if f.fires_in(generation) and f.rank == rank]

    def before_collective(self, step: int) -> None:
        """Called after backward, before the gradient all-reduce: where a dying GPU leaves its peers waiting."""
        for fault in self.faults:
            if isinstance(fault, Crash) and fault.at_step == step:
                log.warning("injected crash", step=step, exit_code=fault.exit_code)
                os._exit(fault.exit_code)
