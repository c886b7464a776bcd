"""Escalation S2 on the training side: a rebalanced step reads the same samples and, with each
sample's loss divided by the global batch, sums to the same gradient as an even split."""

from __future__ import annotations

import pytest
import torch

from stayalive.core.judgement.escalation import rebalance
from stayalive.training.corpus import Corpus, SampleStream, generate_text
from stayalive.training.gpt import GPT, PRESETS, GPTConfig

GLOBAL_BATCH = 32
WORLD_SIZE = 4


@pytest.fixture(scope="module")
def stream() -> SampleStream:
    return SampleStream(Corpus(generate_text(sentences=500)), PRESETS["tiny"]["block_size"], GLOBAL_BATCH, seed=3)


def summed_gradient(stream: SampleStream, step: int, split: list[int] | None) -> torch.Tensor:
    """What the all-reduce (SUM) of every rank's gradient gives, each rank computed in turn."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=stream.corpus.vocab_size, **PRESETS["tiny"])).double()
    total = None
    for rank in range(WORLD_SIZE):
        model.zero_grad(set_to_none=True)
        inputs, targets = stream.batch(stream.positions(step, rank, WORLD_SIZE, split))
        (model(inputs, targets).sum() / GLOBAL_BATCH).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        total = grads if total is None else total + grads
    assert total is not None
    return total


@pytest.mark.parametrize("speeds", [[1.0, 1.0, 1 / 1.5, 1.0], [1.0, 0.5, 1.0, 0.25], [3.0, 1.0, 1.0, 1.0]])
def test_a_rebalanced_step_reads_the_same_samples(stream: SampleStream, speeds: list[float]) -> None:
    split = rebalance(speeds, GLOBAL_BATCH)
    for step in (1, 9):
        shares = [stream.positions(step, rank, WORLD_SIZE, split) for rank in range(WORLD_SIZE)]
        assert [len(s) for s in shares] == split
        assert sorted(p for s in shares for p in s) == list(range((step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH))


def test_the_rebalanced_gradient_equals_the_even_one(stream: SampleStream) -> None:
    split = rebalance([1.0, 1.0, 1 / 1.5, 1.0], GLOBAL_BATCH)
    assert split == [9, 9, 6, 8], "the 1.5× slower rank gets two thirds of a fast rank's share"
    even, rebalanced = summed_gradient(stream, 5, None), summed_gradient(stream, 5, split)
    # Float64, so only the summation order differs: the two agree to rounding.
    assert torch.allclose(rebalanced, even, rtol=1e-10, atol=1e-13)
    assert not torch.equal(rebalanced, summed_gradient(stream, 6, None)), "a different step differs"
