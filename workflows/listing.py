"""What the Temporal web UI shows of a run: its current details (the health table, with what the last
change of state said) and the search attributes runs are listed and filtered by (RunState, Step,
Goodput). RunWorkflow hands `show` and `progressed` to its RunBook, which calls them as the run changes.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import SearchAttributeKey, SearchAttributeUpdate

with workflow.unsafe.imports_passed_through():
    from stayalive.core.book.health import health_table
    from stayalive.core.decisions.goodput import ledger
    from stayalive.core.run.status import RunStatus

# Step and Goodput are for listing and filtering runs: refreshed with every state change, and between
# changes at a checkpoint at most this often (each refresh is a history event; `health` is live).
LISTING_REFRESH = timedelta(minutes=5)
RUN_STATE = SearchAttributeKey.for_keyword("RunState")
STEP = SearchAttributeKey.for_int("Step")
GOODPUT = SearchAttributeKey.for_float("Goodput")


class Listing:
    def __init__(self) -> None:
        self.note = ""  # what the last change of state said, kept in the details until the next
        self.listed_at: datetime | None = None  # when Step and Goodput were last upserted

    def show(self, status: RunStatus, note: str) -> None:
        """A change of state: the run's details, and what runs are listed by. (At once: a command the
        workflow defers to a later point would land in a different workflow task on replay when a
        local activity's result arrives with other events.)"""
        self.note = note
        workflow.set_current_details(health_table(status, note))
        self._list(status, RUN_STATE.value_set(status.state.value))

    def progressed(self, status: RunStatus) -> None:
        """New numbers between state changes: the details at once (they cost no history), Step and
        Goodput at most every LISTING_REFRESH (each upsert is an event)."""
        workflow.set_current_details(health_table(status, self.note))
        if self.listed_at is None or workflow.now() - self.listed_at >= LISTING_REFRESH:
            self._list(status)

    def _list(self, status: RunStatus, *updates: SearchAttributeUpdate) -> None:
        """Upsert Step and Goodput, and any `updates`."""
        self.listed_at = workflow.now()
        goodput = ledger(status, workflow.now()).goodput
        workflow.upsert_search_attributes([*updates, STEP.value_set(status.progress.step), GOODPUT.value_set(goodput)])
