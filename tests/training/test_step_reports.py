"""A rank's step reports go to its agent a batch at a time, each step's figures as they were, the
losses read in one copy, cut at the same steps on every rank, in smaller batches where steps are
slow; the first step of a generation, the first after a pause and whatever precedes another report
go at once (training/step_reports.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import stayalive
from stayalive.core.monitor.progress import LAG
from stayalive.core.protocol.telemetry import RankSteps, StepReport, rank_message
from stayalive.training import step_reports
from stayalive.training.step_reports import StepReports


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def taken_apart(batches: list[list[StepReport]]) -> Callable[[list[RankSteps]], None]:
    """Each batch sent, as its agent takes it apart (after its JSON line's round trip)."""

    def send(messages: list[RankSteps]) -> None:
        for message in messages:
            line = message.model_dump_json()
            received = rank_message.validate_json(line)
            assert isinstance(received, RankSteps)
            batches.append(received.reports())

    return send


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(step_reports.time, "perf_counter", clock)
    return clock


def test_steps_go_a_batch_at_a_time_in_order_with_their_own_figures(clock: Clock) -> None:
    batches: list[list[StepReport]] = []
    reports = StepReports(rank=3, generation=2, send=taken_apart(batches))
    reports.add(1, 0.010, 0.020, torch.tensor(2.5), [7, 8])
    assert [[r.step for r in b] for b in batches] == [[1]], "a generation's first step goes at once"
    every = step_reports.REPORT_EVERY_STEPS
    for step in range(2, 2 * every + 1):
        clock.now += 0.01
        reports.add(step, 0.011, 0.021, torch.tensor(float(step)), [step])
    # Cut by step number, as every rank cuts them: each step reaches the agent with the other ranks'.
    first, second = list(range(2, every + 1)), list(range(every + 1, 2 * every + 1))
    assert [[r.step for r in b] for b in batches] == [[1], first, second]
    sent = batches[1]
    assert [r.loss for r in sent] == [float(step) for step in first]
    assert [r.samples for r in sent] == [[step] for step in first]
    assert {(r.rank, r.generation) for r in sent} == {(3, 2)}
    assert sent[-1].compute_s == 0.011 and sent[-1].step_s == 0.021
    assert [r.at for r in sent] == sorted(r.at for r in sent)


@pytest.mark.parametrize(
    ("period_s", "batch"),
    [(0.01, 16), (0.03, 16), (0.04, 8), (0.1, 4), (0.2, 2), (0.3, 1), (2.0, 1)],
)
def test_slower_steps_go_in_smaller_batches_cut_where_every_rank_cuts(
    clock: Clock, period_s: float, batch: int
) -> None:
    batches: list[list[StepReport]] = []
    reports = StepReports(rank=0, generation=0, send=taken_apart(batches))
    for step in range(1, 33):
        reports.add(step, 0.01, period_s, float(step), [])
        clock.now += period_s
    assert batch * period_s <= step_reports.REPORT_EVERY_S or batch == 1
    # After the first step, which goes alone, each batch ends at a multiple of its size: the coarser
    # cadence's cuts (a multiple of 16) are every finer one's too.
    assert [[r.step for r in b] for b in batches] == [[1]] + [
        list(range(max(2, end - batch + 1), end + 1)) for end in range(batch, 33, batch) if end > 1
    ]


def test_the_first_step_after_a_pause_goes_at_once(clock: Clock) -> None:
    batches: list[list[StepReport]] = []
    reports = StepReports(rank=0, generation=0, send=taken_apart(batches))
    for step in range(1, 6):
        reports.add(step, 0.01, 0.02, float(step), [])
        clock.now += 0.02
    clock.now += 30.0  # an evaluation between steps, say
    reports.add(6, 0.01, 0.02, 6.0, [])
    assert [[r.step for r in b] for b in batches] == [[1], [2, 3, 4, 5, 6]]


def test_no_rank_holds_back_a_step_its_agent_gives_up_on() -> None:
    assert 2 * step_reports.REPORT_EVERY_STEPS <= LAG


def test_a_flush_sends_what_is_kept_and_a_non_finite_loss_goes_as_none(clock: Clock) -> None:
    batches: list[list[StepReport]] = []
    reports = StepReports(rank=0, generation=0, send=taken_apart(batches))
    reports.add(1, 0.01, 0.02, None, [])
    reports.add(2, 0.01, 0.02, torch.tensor(math.nan), [])
    reports.add(3, 0.01, 0.02, math.inf, [])
    reports.flush()
    reports.flush()  # nothing kept: nothing sent
    assert [[(r.step, r.loss) for r in b] for b in batches] == [[(1, None)], [(2, None), (3, None)]]


def test_a_flush_with_nothing_kept_leaves_the_next_first_step_immediate(clock: Clock) -> None:
    batches: list[list[StepReport]] = []
    reports = StepReports(rank=0, generation=1, send=taken_apart(batches))
    reports.flush()  # as a resumed rank's report before its first step does
    reports.add(11, 0.01, 0.02, 1.0, [])
    assert [[r.step for r in b] for b in batches] == [[11]]


def test_a_batch_whose_columns_disagree_is_refused() -> None:
    with pytest.raises(ValueError, match="unequal length"):
        RankSteps(
            rank=2,
            generation=0,
            step=[1, 2],
            compute_s=[0.1],
            step_s=[0.2, 0.2],
            loss=[1, 1],
            samples=[[], []],
            at=[0, 0],
        )


def test_record_refuses_a_loss_that_is_not_one_number() -> None:
    run = stayalive.Run(torch.nn.Linear(2, 1), target_step=1)
    with pytest.raises(ValueError, match=r"one number.*shape \(4,\)"):
        run.record(torch.ones(4))
    run.record(torch.ones(1, requires_grad=True) * 2)  # one number, still in its graph: kept detached
    assert isinstance(run._loss, torch.Tensor) and not run._loss.requires_grad
