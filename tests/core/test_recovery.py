"""A rank's failure as a timeline entry (core/decisions/recovery.py): the step it names is the last one it had
completed, also when it failed before reporting one of its generation."""

from __future__ import annotations

import pytest

from stayalive.core.decisions.recovery import interruption_from
from stayalive.core.messages.events import RankFailed
from stayalive.core.run.status import Progress
from stayalive.core.run.timeline import Cause, Interruption
from tests.core.runs import T0, at, interruption, spec, status


def failed(last_step: int | None, generation: int) -> RankFailed:
    return RankFailed(
        node="n2",
        generation=generation,
        rank=3,
        exit_code=137,
        last_step=last_step,
        at=T0.timestamp(),
        progress=Progress(),
    )


def resumed(step: int | None) -> list[Interruption]:
    before = interruption(at(minutes=1), Cause.CRASH, node="n1", step=37, generation=0)
    before.resumed_from = step
    return [before]


@pytest.mark.parametrize(
    ("last_step", "generation", "earlier", "hooks", "step"),
    [
        (52, 1, resumed(30), True, 52),  # it reported: its own last step
        (None, 1, resumed(30), True, 30),  # died in the first step after resuming from 30
        (None, 0, [], True, 0),  # died in the run's first step
        (None, 1, resumed(None), True, None),  # where the generation resumed is not known
        (None, 1, resumed(30), False, None),  # a plain script reports no steps: not known
    ],
)
def test_the_step_a_failed_rank_had_completed(
    last_step: int | None, generation: int, earlier: list[Interruption], hooks: bool, step: int | None
) -> None:
    run = status(spec=spec().model_copy(update={"hooks": hooks}), generation=generation, interruptions=earlier)
    entry = interruption_from(failed(last_step, generation), run, T0)
    assert (entry.cause, entry.rank, entry.step) == (Cause.CRASH, 3, step)
