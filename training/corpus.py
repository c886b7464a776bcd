"""A tiny generated corpus and a data order keyed by global sample index.

Step `s` (1-based) consumes global sample positions `[(s-1)·B, s·B)` of one infinite stream, and
rank `r` of `W` takes every W-th of them (strided, so a resize changes who reads a sample, never
which samples a step reads). Position → text window is a pure function, so the data position of
a checkpoint is just its step, and a resumed run reads exactly what an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import random

import torch

_SUBJECTS = ["the model", "a rank", "the node", "every gpu", "the run", "a spare", "the fleet", "one shard"]
_VERBS = ["writes", "reads", "checks", "drains", "resumes", "reduces", "replays", "loads", "saves"]
_OBJECTS = ["a checkpoint", "the gradient", "its shard", "the manifest", "a batch", "the step", "the loss"]
_TAILS = ["before the collective", "after the barrier", "at step one", "without a pause", "twice", "in order"]


def generate_text(seed: int = 0, sentences: int = 20_000) -> str:
    """Grammatical nonsense with enough structure that the loss visibly falls within a few hundred steps."""
    rng = random.Random(seed)
    parts = [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
        for _ in range(sentences)
    ]
    return " ".join(parts) + "\n"


class Corpus:
    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        # A character's token is its place among the sorted code points: one search in torch, where a
        # Python loop over the text took 70 ms of every rank's start.
        points = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
        self.tokens = torch.searchsorted(torch.tensor([ord(ch) for ch in self.chars], dtype=torch.int32), points)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)


class SampleStream:
    def __init__(self, corpus: Corpus, block_size: int, global_batch: int, seed: int = 0) -> None:
        self.corpus = corpus
        self.block_size = block_size
        self.global_batch = global_batch
        self.seed = seed
        self.windows = len(corpus.tokens) - block_size - 1

    def positions(self, step: int, rank: int, world_size: int, split: list[int] | None = None) -> list[int]:
        """`rank`'s share of step `step`: every `world_size`-th position, or, with a `split` (samples
        per rank, summing to the global batch: a rebalanced step), a contiguous run of its size. The
        step's positions are the same either way, so the data order never depends on the split."""
        first = (step - 1) * self.global_batch
        if split is None:
            return list(range(first + rank, first + self.global_batch, world_size))
        start = first + sum(split[:rank])
        return list(range(start, start + split[rank]))

    def offset(self, position: int) -> int:
        digest = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.windows

    def batch(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        starts = [self.offset(p) for p in positions]
        x = torch.stack([self.corpus.tokens[s : s + self.block_size] for s in starts])
        y = torch.stack([self.corpus.tokens[s + 1 : s + 1 + self.block_size] for s in starts])
        return x, y
