"""The data order: keyed by global sample position, the same whatever the world size."""

from __future__ import annotations

import pytest

from stayalive.training.corpus import Corpus, SampleStream, generate_text


@pytest.fixture(scope="module")
def stream() -> SampleStream:
    return SampleStream(Corpus(generate_text(sentences=500)), block_size=16, global_batch=12, seed=3)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 12])
def test_a_step_reads_its_global_batch_exactly_once_at_any_width(stream: SampleStream, world_size: int) -> None:
    for step in (1, 2, 77):
        per_rank = [stream.positions(step, rank, world_size) for rank in range(world_size)]
        flat = sorted(p for positions in per_rank for p in positions)
        assert flat == list(range((step - 1) * 12, step * 12))


def test_batches_are_a_pure_function_of_position(stream: SampleStream) -> None:
    x1, y1 = stream.batch([5, 900, 31])
    x2, y2 = stream.batch([5, 900, 31])
    assert x1.equal(x2) and y1.equal(y2)
    assert x1[:, 1:].equal(y1[:, :-1]), "targets are the inputs shifted by one token"
    assert not stream.batch([6])[0].equal(stream.batch([5])[0])
