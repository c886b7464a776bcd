"""structlog set-up shared by every stayalive process: one logfmt line per event on stderr.

Every line carries run_id, node, rank and step ("-" where a process has none), so one grep
follows a run across the supervisor, the node agents and the ranks.
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.typing import EventDict, WrappedLogger

KEYS = ("run_id", "node", "rank", "step")


def _every_key(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    for key in KEYS:
        event.setdefault(key, "-")
    return event


def configure_logging(level: int = logging.INFO, **context: object) -> None:
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
