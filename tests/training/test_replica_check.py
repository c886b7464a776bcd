"""The replica check's verdict (training/sdc.py): data-parallel ranks hold bitwise the same weights
and all-reduced gradient, so the rank whose fingerprint differs from the others' is the culprit."""

from __future__ import annotations

import pytest
import torch

from stayalive.core.run.spec import SdcSpec
from stayalive.training.sdc import SdcGuard, fingerprint


@pytest.mark.parametrize(
    ("fingerprints", "passed", "culprit", "detail"),
    [
        ([7, 7, 7, 7], True, None, "the 4 replicas' weights and gradients are bitwise equal"),
        ([7, 9, 7, 7], False, 1, "rank 1's weights or gradient differ from the other 3 replicas'"),
        ([7, 7, 7, 5], False, 3, "rank 3's weights or gradient differ from the other 3 replicas'"),
        ([7, 9], False, None, "no majority among the replicas: ranks [1] differ from ranks [0]"),
        ([7, 9, 9, 7], False, None, "no majority among the replicas: ranks [1, 2] differ from ranks [0, 3]"),
        ([7, 9, 5, 7], False, None, "no majority among the replicas: ranks [1, 2] differ from ranks [0, 3]"),
    ],
)
def test_the_odd_replica_out_is_the_culprit(
    fingerprints: list[int], passed: bool, culprit: int | None, detail: str
) -> None:
    guard = SdcGuard(SdcSpec(), rank=0, world_size=len(fingerprints), generation=2, last_verified=40)
    check = guard.replicas(50, fingerprints)
    assert (check.method, check.step, check.last_verified) == ("replicas", 50, 40)
    assert (check.passed, check.culprit, check.detail) == (passed, culprit, detail)


def test_the_replica_check_is_due_with_the_self_checks_and_only_among_replicas() -> None:
    guard = SdcGuard(SdcSpec(self_check_every=10), rank=0, world_size=4, generation=0, last_verified=0)
    assert [s for s in range(1, 41) if guard.replicas_due(s)] == [10, 20, 30, 40]
    assert not SdcGuard(SdcSpec(self_check_every=10), 0, 1, 0, 0).replicas_due(10), "one rank: nothing to compare"
    assert not SdcGuard(SdcSpec(enabled=False), 0, 4, 0, 0).replicas_due(100)


@pytest.mark.parametrize("bit", [0, 11, 22, 31])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_flipped_bit_anywhere_changes_the_fingerprint(bit: int, dtype: torch.dtype) -> None:
    tensors = [torch.randn(33, 7, generator=torch.Generator().manual_seed(1)).to(dtype), torch.randn(5).to(dtype)]
    before = fingerprint(tensors)
    assert fingerprint([t.clone() for t in tensors]) == before, "the same bits, the same fingerprint"
    words = tensors[0].view(-1).view(torch.uint8)
    words[100 + bit // 8] ^= 1 << (bit % 8)
    assert fingerprint(tensors) != before
    swapped = [tensors[1], tensors[0]]
    assert fingerprint(swapped) != fingerprint(tensors), "where a word sits counts, not only its value"
