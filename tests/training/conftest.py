from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def group() -> Iterator[dist.ProcessGroup]:
    """A real one-rank gloo group, the default one, for this test only."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.group.WORLD is not None
    yield dist.group.WORLD
    dist.destroy_process_group()
