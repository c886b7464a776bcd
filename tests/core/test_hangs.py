"""A hang's culprit from evidence: each rank's collective counts first, then its stack."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from stayalive.core.judgement.hangs import PROGRESS_BYTES, CollectiveProgress, Site, find_culprit
from tests.core.test_detectors import IN_ALL_REDUCE, IN_FORWARD, dump, healthy_ranks

N = 241  # the collective the healthy ranks are in

Progress = dict[int, CollectiveProgress]


def counts(
    entered: int, completed: int, generation: int = 0, step: int = 60, site: int = Site.GRADIENTS
) -> CollectiveProgress:
    return CollectiveProgress(generation=generation, step=step, entered=entered, completed=completed, site=site)


def waiting(n: int = 16) -> Progress:
    """Every rank inside collective #N, none done with it."""
    return {r: counts(N, N - 1) for r in range(n)}


SAME = healthy_ranks(16)  # every rank's stack in the same all-reduce


@pytest.mark.parametrize(
    ("stacks", "progress", "culprit", "suspects", "says"),
    [
        pytest.param(
            SAME,
            waiting() | {3: counts(N - 1, N - 1)},
            3,
            [3],
            "rank 3 never entered collective #241 (the gradient all-reduce of step 60), which the other 15 entered; "
            "every rank's main-thread stack is the same",
            id="same stacks: the counts name the rank that never entered",
        ),
        pytest.param(
            SAME,
            waiting() | {3: counts(N - 1, N - 1), 9: counts(N - 2, N - 2)},
            None,
            [3, 9],
            "ranks 3, 9 never entered collective #241",
            id="several behind: suspects, no culprit",
        ),
        pytest.param(
            SAME,
            waiting(),
            None,
            [],
            "every rank waits in collective #241 (the gradient all-reduce of step 60); no rank differs",
            id="every rank inside the same collective: nobody blamed",
        ),
        pytest.param(
            SAME | {5: ""},
            waiting(),
            5,
            [5],
            "every rank entered collective #241 (the gradient all-reduce of step 60) and none completed it; "
            "rank 5's stack differs",
            id="all inside, one rank wrote no stack (stopped, wedged below Python): the stacks name it",
        ),
        pytest.param(
            {r: dump(IN_FORWARD) if r % 2 else t for r, t in SAME.items()},
            waiting(),
            None,
            [],
            "the counters tell no rank apart; no single rank's stack stands out",
            id="all inside, stacks split in half: nobody blamed",
        ),
        pytest.param(
            SAME | {3: dump(IN_FORWARD)},
            waiting() | {3: counts(N - 1, N - 1), 5: counts(N - 1, N - 1)} | {7: counts(N, N - 1)},
            None,
            [3, 5],
            "no single culprit; rank 3's stack differs from the other 15",
            id="the counts outrank the stacks",
        ),
        pytest.param(
            SAME | {7: dump(IN_FORWARD)},
            {r: counts(N, N - 1) for r in range(15)},
            7,
            [7],
            "rank 7's stack differs from the other 15",
            id="a rank without counts (a script without the hooks): the stacks decide",
        ),
        pytest.param(
            SAME,
            {r: counts(N, N - 1) for r in range(15)},
            None,
            [],
            "every rank's main-thread stack is the same",
            id="no counts everywhere and the same stacks: nobody blamed",
        ),
        pytest.param(
            SAME | {7: dump(IN_FORWARD)},
            {r: counts(N, N) for r in range(16)},
            7,
            [7],
            "no rank waits in a collective (each completed all 241 it entered); rank 7's stack differs",
            id="nobody inside a collective: the stacks decide",
        ),
        pytest.param(
            SAME,
            {r: counts(0, 0, step=0, site=0) for r in range(16)},
            None,
            [],
            "no rank waits in a collective (none entered one in this generation)",
            id="nothing entered yet",
        ),
        pytest.param(
            {0: SAME[0], 1: SAME[1]},
            {0: counts(N, N - 1), 1: counts(N - 1, N - 1)},
            1,
            [1],
            "rank 1 never entered",
            id="two ranks: the stacks cannot tell them apart, the counts can",
        ),
        pytest.param({}, {}, None, [], "no rank dumped its stacks", id="nothing dumped"),
    ],
)
def test_find_culprit(
    stacks: dict[int, str], progress: Progress, culprit: int | None, suspects: list[int], says: str
) -> None:
    found = find_culprit(stacks, progress, generation=0)
    assert (found.culprit, found.suspects) == (culprit, suspects)
    assert says in found.summary


@pytest.mark.parametrize(
    ("change", "site_named"),
    [
        (lambda p: p, "the gradient all-reduce of step 60"),
        (
            lambda p: p.model_copy(update={"site": Site.RESTORE, "step": 0}),
            "the checkpoint restore, before the generation's first step",
        ),
        (lambda p: p.model_copy(update={"site": 99}), "site 99 of step 60"),
    ],
)
def test_the_collective_is_named_by_where_it_was_issued(
    change: Callable[[CollectiveProgress], CollectiveProgress], site_named: str
) -> None:
    found = find_culprit(SAME, {r: change(counts(N, N - 1)) for r in range(16)}, generation=0)
    assert f"collective #241 ({site_named})" in found.summary


def test_a_rank_still_in_the_last_generation_has_entered_nothing_of_this_one() -> None:
    progress = {r: counts(12, 11, generation=2) for r in range(4)} | {2: counts(900, 900, generation=1)}
    found = find_culprit({r: dump(IN_ALL_REDUCE) for r in range(4)}, progress, generation=2)
    assert (found.culprit, found.suspects) == (2, [2])


def test_the_progress_file_decodes() -> None:
    written = counts(N, N - 1, generation=3, step=60)
    fields = [written.generation, written.step, written.entered, written.completed, written.site]
    data = b"".join(v.to_bytes(8, "little", signed=True) for v in fields)
    assert len(data) == PROGRESS_BYTES
    assert CollectiveProgress.decode(data) == written
    assert CollectiveProgress.decode(data[:-1]) is None  # not yet written
