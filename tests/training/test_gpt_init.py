"""The GPT's initialisation is GPT-2's: the first loss is that of a uniform guess, not ~174 (what
PyTorch's unit-variance embedding, tied to the head, gave), and it depends only on the seed."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stayalive.training.corpus import Corpus, SampleStream, generate_text
from stayalive.training.gpt import GPT, INIT_STD, PRESETS, Block, GPTConfig
from stayalive.training.train import parse_args


def trainer_presets() -> list[str]:
    """Every preset `--preset` accepts, so a new one is checked without touching this file."""
    return [name for name in sorted(PRESETS) if parse_args(["--preset", name]).preset == name]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(generate_text(seed=0))


def build(corpus: Corpus, preset: str, seed: int = 0) -> GPT:
    torch.manual_seed(seed)  # as the trainer does: training/train.py
    return GPT(GPTConfig(vocab_size=corpus.vocab_size, **PRESETS[preset]))


@pytest.mark.parametrize("preset", trainer_presets())
def test_the_first_loss_is_a_uniform_guess(corpus: Corpus, preset: str) -> None:
    model = build(corpus, preset)
    stream = SampleStream(corpus, model.cfg.block_size, global_batch=16, seed=0)
    inputs, targets = stream.batch(stream.positions(1, 0, 1))
    with torch.no_grad():
        loss = model(inputs, targets).mean().item()
    uniform = math.log(corpus.vocab_size)
    assert loss < 5.0
    assert abs(loss - uniform) < 1.0, f"step-0 loss {loss:.2f}, a uniform guess {uniform:.2f}"


@pytest.mark.parametrize("preset", trainer_presets())
def test_residual_projections_are_scaled_down_by_depth(corpus: Corpus, preset: str) -> None:
    model = build(corpus, preset)
    residual: list[nn.Module] = []
    other: list[nn.Module] = []
    for block in model.blocks:
        assert isinstance(block, Block)
        residual += [block.attn.proj, block.mlp[2]]
        other += [block.attn.qkv, block.mlp[0]]
    expected = math.sqrt(2 * model.cfg.n_layer)
    for linear in residual + other:
        assert isinstance(linear, nn.Linear)
        assert linear.bias is not None and not linear.bias.any(), "biases start at zero"
    for r, o in zip(residual, other, strict=True):
        assert isinstance(r, nn.Linear) and isinstance(o, nn.Linear)
        ratio = o.weight.std().item() / r.weight.std().item()
        assert ratio == pytest.approx(expected, rel=0.1)
    assert model.wte.weight.std().item() == pytest.approx(INIT_STD, rel=0.1)
    assert model.head.weight is model.wte.weight, "the head stays tied to the embedding"


def test_the_weights_depend_only_on_the_seed(corpus: Corpus) -> None:
    first, again, other = (build(corpus, "tiny", seed).state_dict() for seed in (0, 0, 1))
    assert all(first[name].equal(again[name]) for name in first)
    assert not first["blocks.0.attn.qkv.weight"].equal(other["blocks.0.attn.qkv.weight"])
