"""structlog set-up shared by every stayalive process: one logfmt line per event on stderr.

Every line carries run_id, node, rank and step ("-" where a process has none), so one grep
follows a run across the supervisor, the node agents and the ranks. A rank's step is read when a
line is logged, from where its training keeps it (`configure_logging(step=...)`): binding it as
context every step costs a step more than all the lines a healthy rank logs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import structlog
from structlog.typing import EventDict, WrappedLogger

KEYS = ("run_id", "node", "rank", "step")


_step: Callable[[], object] | None = None  # this process's step, where it has one


def _every_key(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    if _step is not None:
        event.setdefault("step", _step())
    for key in KEYS:
        event.setdefault(key, "-")
    return event


def configure_logging(level: int = logging.INFO, step: Callable[[], object] | None = None, **context: object) -> None:
    """`step`: where a line reads the process's step (a rank's; other processes bind it as context)."""
    global _step
    if step is not None:
        _step = step
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _every_key,
            structlog.processors.LogfmtRenderer(key_order=["timestamp", "level", "event", *KEYS]),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(**context)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
