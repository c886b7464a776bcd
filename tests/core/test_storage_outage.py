"""What a run records of a storage outage (core/book/runbook.py, core/book/health.py): one detection however many
generations it spans, one page, and the run's health says storage is away until a checkpoint lands."""

from __future__ import annotations

from stayalive.core.book.findings import Finished
from stayalive.core.book.health import Health
from stayalive.core.book.runbook import RunBook
from stayalive.core.decisions.paging import storage_outage
from stayalive.core.messages.events import StorageOutage
from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.status import Outage
from tests.core.runs import at, status

OUTAGE = Outage(since=at(seconds=100).timestamp(), error="[Errno 28] No space left on device", step=20)


def event(phase: str, seconds: float, outage: Outage = OUTAGE, **fields: object) -> StorageOutage:
    return StorageOutage.model_validate(
        {"phase": phase, "outage": outage, "at": at(seconds=seconds).timestamp(), "progress": {}} | fields
    )


def test_an_outage_is_one_detection_paged_once_and_closed_by_the_checkpoint_that_landed() -> None:
    book = RunBook(status())
    assert book.storage(event("began", 100)) is None
    assert Health.of(book.status, at(seconds=101), None).storage_unavailable_since == at(seconds=100)
    book.status.generation += 1  # a restart during the outage: its new ranks fail too
    assert book.storage(event("began", 105, OUTAGE.model_copy(update={"since": at(seconds=105).timestamp()}))) is None

    paging = storage_outage(40.0, 10.0, OUTAGE.error)
    paged = OUTAGE.model_copy(update={"paged": True})
    assert book.storage(event("lasting", 140, paged, paging=paging)) == paging
    assert book.storage(event("lasting", 141, paged, paging=paging)) is None, "a restarted monitor: no second page"
    assert book.status.storage_outage == paged, "the next monitor starts from it"

    assert book.storage(event("over", 160, paged, landed_step=120)) is None
    assert book.storage(event("over", 161, paged, landed_step=130)) is None
    [detection] = book.status.detections
    assert (detection.kind, detection.step, detection.at) == ("storage_outage", 20, at(seconds=100))
    assert detection.paging == paging
    assert detection.actions[1:] == ["paged after 40s", "storage back after 60s: the checkpoint of step 120 landed"]
    assert book.status.storage_outage is None
    assert Health.of(book.status, at(seconds=170), None).storage_unavailable_since is None


def test_a_run_that_completes_has_its_storage_back_though_its_last_commit_was_not_read() -> None:
    """The last ranks may exit before the monitor reads the commit that ended the outage; the final
    checkpoint, valid, is on storage all the same."""
    book = RunBook(status(state=RunState.RUNNING))
    book.storage(event("began", 100))
    book.apply(Finished(1000, at(seconds=130)))
    assert book.status.storage_outage is None
    assert book.status.detections[0].actions[-1] == "storage back after 30s: the checkpoint of step 1000 landed"
