"""The measured failure mix (sim/failure_mix.py): the table maps every component of the Llama 3 CSV,
the rates and MTBFs are the paper's, and a run's draws come at those rates, in that mix, in order."""

from __future__ import annotations

import csv
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from stayalive.sim.failure_mix import (
    LLAMA3_CSV,
    LLAMA3_UNEXPECTED_INTERRUPTIONS,
    MAPPING,
    PLANNED_COMPONENT,
    UNEXPECTED_KINDS,
    ComponentMapping,
    Draw,
    FailureMix,
    Kind,
    arrivals,
    draw,
    load_mix,
)

SEEDS = range(200)


@pytest.fixture(scope="module")
def mix() -> FailureMix:
    return load_mix()


def csv_counts() -> dict[str, int]:
    with LLAMA3_CSV.open(newline="") as file:
        return {row["component"]: int(row["count"]) for row in csv.DictReader(r for r in file if not r.startswith("#"))}


def unexpected(drawn: list[Draw]) -> int:
    return sum(d.kind != "drain" for d in drawn)


def test_the_counts_in_the_file_sum_to_the_papers_419() -> None:
    assert sum(csv_counts().values()) == LLAMA3_UNEXPECTED_INTERRUPTIONS == 419


def test_every_component_is_mapped_and_the_planned_ones_drain() -> None:
    components = [m.component for m in MAPPING]
    assert len(components) == len(set(components))
    assert set(components) == set(csv_counts()) | {PLANNED_COMPONENT}
    assert next(m for m in MAPPING if m.component == PLANNED_COMPONENT).shares == (("drain", 1.0),)


@pytest.mark.parametrize("mapping", MAPPING, ids=lambda m: m.component)
def test_each_components_shares_sum_to_one_and_say_why(mapping: ComponentMapping) -> None:
    assert math.isclose(math.fsum(share for _, share in mapping.shares), 1.0)
    assert all(share > 0 for _, share in mapping.shares)
    assert len({kind for kind, _ in mapping.shares}) == len(mapping.shares)
    assert mapping.reason


def test_every_kind_comes_from_some_component(mix: FailureMix) -> None:
    kinds: tuple[Kind, ...] = (*UNEXPECTED_KINDS, "drain")
    assert {s.kind for s in mix.sources} == set(kinds)
    assert math.isclose(sum(mix.expected(k) for k in UNEXPECTED_KINDS), 419)
    assert mix.expected("drain") == 47


def test_a_csv_with_a_component_the_table_does_not_map_is_refused(tmp_path: Path) -> None:
    edited = tmp_path / "edited.csv"
    edited.write_text(LLAMA3_CSV.read_text().replace("Faulty GPU,", "Cosmic ray,"))
    with pytest.raises(ValueError, match="Cosmic ray"):
        load_mix(edited)


def test_rates_and_mtbf_are_the_papers(mix: FailureMix) -> None:
    assert math.isclose(mix.rate_per_gpu_hour(), 419 / (54 * 24 * 16_384))
    assert math.isclose(sum(mix.rate_per_gpu_hour(k) for k in UNEXPECTED_KINDS), mix.rate_per_gpu_hour())
    assert math.isclose(mix.rate_per_gpu_hour("hang"), (35 + 7 + 7) / (54 * 24 * 16_384))
    assert math.isclose(mix.mtbf_hours(16_384), 3.093, rel_tol=1e-3)
    assert math.isclose(mix.mtbf_hours(1_024), 49.5, rel_tol=1e-3)


def test_a_month_at_16384_gpus_has_the_papers_counts(mix: FailureMix) -> None:
    runs = [draw(mix, gpus=16_384, days=30, seed=seed, nodes=2_048) for seed in SEEDS]
    expected = 30 * 24 / mix.mtbf_hours(16_384)  # ≈ 233
    assert math.isclose(sum(map(unexpected, runs)) / len(runs), expected, rel_tol=0.03)
    assert abs(unexpected(runs[0]) - expected) < 4 * math.sqrt(expected)
    planned = sum(len(run) - unexpected(run) for run in runs) / len(runs)
    assert math.isclose(planned, 47 * 30 / 54, rel_tol=0.05)  # ≈ 26

    kinds = Counter(d.kind for run in runs for d in run if d.kind != "drain")
    for kind in UNEXPECTED_KINDS:
        assert kinds[kind] / kinds.total() == pytest.approx(mix.expected(kind) / 419, abs=0.01), kind


def test_a_month_at_1024_gpus_has_a_sixteenth_of_them(mix: FailureMix) -> None:
    seeds = range(2_000)  # ≈ 14.5 each: enough runs that 3% is five standard errors
    mean = sum(unexpected(draw(mix, gpus=1_024, days=30, seed=seed, nodes=128)) for seed in seeds) / len(seeds)
    assert math.isclose(mean, 30 * 24 / 49.5, rel_tol=0.03)


def test_draws_are_in_time_order_on_the_runs_nodes_and_the_same_for_a_seed(mix: FailureMix) -> None:
    drawn = draw(mix, gpus=1_024, days=90, seed=7, nodes=128)
    assert drawn == sorted(drawn, key=lambda d: d.at_s)
    assert all(0 <= d.at_s < 90 * 24 * 3600 for d in drawn)
    assert all(0 <= d.node < 128 for d in drawn)
    assert len({d.node for d in drawn}) > 1
    assert drawn == draw(mix, gpus=1_024, days=90, seed=7, nodes=128)
    assert drawn != draw(mix, gpus=1_024, days=90, seed=8, nodes=128)


def test_a_process_that_outruns_its_batch_draws_on_where_it_left_off() -> None:
    one_process = np.array([3_600.0])
    process, at_s = arrivals(np.random.default_rng(3), one_process, horizon_s=100 * 3_600, batch=1)
    _, unbatched = arrivals(np.random.default_rng(3), one_process, horizon_s=100 * 3_600)
    assert 60 < len(at_s) < 140
    assert set(process) == {0}
    np.testing.assert_allclose(at_s, unbatched)
