"""The storage half of a checkpoint write, on a thread of its own: the newest checkpoint onto storage,
retried through outages, while training goes on.

A checkpoint reaches the flusher once it is in host memory (this node's tier and its replica's), so
storage that is away (unreachable, full) costs no step: the write is retried with capped, jittered
backoff, and at once when a newer checkpoint arrives. At most two wait for storage: the one being
written and the newest. A newer one takes the place of the one waiting, and of the one being written
unless this rank has already counted its shard towards that one's commit (the others may have too:
only that checkpoint can use it now). A superseded checkpoint never commits; the newer one does.
"""

from __future__ import annotations

import contextvars
import random
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import structlog

log = structlog.get_logger()

RETRY_FIRST_S = 0.5
RETRY_MOST_S = 30.0  # a storage system on its way back is not hammered by every rank at once


class Job(Protocol):
    @property
    def name(self) -> str: ...  # the checkpoint's directory name

    @property
    def counted(self) -> bool: ...  # this rank's shard counts towards its commit: never superseded


J = TypeVar("J", bound=Job)


class Flusher(Generic[J]):
    def __init__(self, land: Callable[[J], None], on_outage: Callable[[J, float, OSError], None]) -> None:
        """`land(job)` writes `job` to storage from where its last attempt stopped, raising OSError
        while storage fails; `on_outage(job, since, error)` is told once per outage, at its first failure."""
        self.land = land
        self.on_outage = on_outage
        self._changed = threading.Condition()
        self._current: J | None = None  # being written
        self._next: J | None = None  # the newest, waiting
        self._submitted = 0  # how many jobs arrived: a retry waits for a newer one or its backoff
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._since: float | None = None  # when this outage began (seconds since the epoch)
        self._jitter = random.Random()  # its own: the run's RNG state is checkpointed and must not move

    def submit(self, job: J) -> None:
        with self._changed:
            if self._next is not None:
                log.info("checkpoint superseded before its storage write", checkpoint=self._next.name, by=job.name)
            self._next = job
            self._submitted += 1
            self._changed.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=contextvars.copy_context().run, args=(self._run,), name="stayalive-storage", daemon=True
                )
                self._thread.start()

    def in_flight(self) -> list[str]:
        """The checkpoints still to reach storage: host memory must keep them."""
        with self._changed:
            return [job.name for job in (self._current, self._next) if job is not None]

    def drain(self) -> None:
        """Until every checkpoint submitted is on storage (or superseded), however long that takes."""
        with self._changed:
            self._changed.wait_for(lambda: self._thread is None)
        self.check()

    def check(self) -> None:
        """Raise what went wrong other than storage (a lost rendezvous store, say) on the caller's thread."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        failed = False
        while (job := self._take(failed)) is not None:
            seen = self._submitted
            try:
                self.land(job)
            except OSError as exc:
                failed = True
                self._failed(job, exc, seen)
                continue
            except BaseException as exc:  # not storage: surfaces on the training thread at the next save
                log.error("checkpoint write failed", checkpoint=job.name, error=str(exc))
                self._error = exc
            if self._since is not None:
                log.info("checkpoint storage back", checkpoint=job.name, after_s=round(time.time() - self._since, 1))
                self._since = None
            failed = False
            with self._changed:
                self._current = None

    def _take(self, failed: bool) -> J | None:
        """The job to attempt: the current one, or the newest when there is none or it may be superseded
        (it failed, and this rank has not counted it in). None: nothing is left; the thread ends."""
        with self._changed:
            current, newer = self._current, self._next
            if current is not None and newer is not None and failed and not current.counted:
                log.info("checkpoint superseded during an outage", checkpoint=current.name, by=newer.name)
                current = None
            if current is None:
                self._current, self._next = newer, None
            if self._current is None:
                self._thread = None
                self._changed.notify_all()
            return self._current

    def _failed(self, job: J, error: OSError, seen: int) -> None:
        now = time.time()
        if self._since is None:
            self._since = now
            self.on_outage(job, now, error)
        # Waiting as long as the outage has lasted doubles the time between tries, as exponential
        # backoff does, however many tries newer checkpoints brought; the jitter keeps ranks apart.
        delay = min(RETRY_MOST_S, max(RETRY_FIRST_S, now - self._since)) * self._jitter.uniform(0.5, 1.0)
        log.warning("checkpoint storage unavailable: kept in host memory", checkpoint=job.name, error=str(error))
        with self._changed:  # a newer checkpoint is tried at once: it has news for storage
            self._changed.wait_for(lambda: self._submitted != seen, timeout=delay)
