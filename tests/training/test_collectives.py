"""A rank's collective counts, as its node agent reads them: from the file, without the rank's help."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stayalive.core.judgement.hangs import CollectiveProgress, Site
from stayalive.training import collectives


@pytest.fixture
def progress_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(collectives, "_words", None)  # the process-wide map: this test's own
    path = tmp_path / "g0" / "rank-0.progress"
    collectives.track(path)
    return path


def read(path: Path) -> CollectiveProgress | None:
    return CollectiveProgress.decode(path.read_bytes())


@pytest.mark.usefixtures("group")
def test_each_collective_is_counted_into_the_file(progress_file: Path) -> None:
    collectives.begin(2)
    assert read(progress_file) == CollectiveProgress(generation=2, step=0, entered=0, completed=0, site=0)
    collectives.all_reduce(torch.ones(1), Site.RESTORE)
    collectives.at_step(5)
    collectives.all_reduce(torch.ones(3), Site.GRADIENTS)
    assert read(progress_file) == CollectiveProgress(generation=2, step=5, entered=2, completed=2, site=Site.GRADIENTS)
    collectives.begin(3)  # a new generation's group numbers its collectives from the first again
    assert read(progress_file) == CollectiveProgress(generation=3, step=0, entered=0, completed=0, site=0)


@pytest.mark.usefixtures("group")
def test_untracked_collectives_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "_words", None)  # a rank launched without STAYALIVE_PROGRESS_FILE
    tensor = torch.ones(2)
    collectives.all_reduce(tensor, Site.GRADIENTS, op=dist.ReduceOp.MAX)
    assert tensor.tolist() == [1.0, 1.0]
