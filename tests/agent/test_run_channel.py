"""A node agent files its ranks' step batches step by step: each step of the node goes out as one
NodeSteps with every rank's figures, in step order (agent/channel.py)."""

from __future__ import annotations

import asyncio

from stayalive.agent.channel import RunChannel
from stayalive.core.protocol.telemetry import NodeSteps, RankSteps, rank_message


def batch(rank: int, steps: list[int]) -> RankSteps:
    return RankSteps(
        rank=rank,
        generation=3,
        step=steps,
        compute_s=[0.01 * rank + s for s in steps],
        step_s=[0.02 + s for s in steps],
        loss=[float(s) if s != 2 else None for s in steps],
        samples=[[10 * s + rank] for s in steps],
        at=[100.0 + s for s in steps],
    )


def test_a_ranks_batch_is_filed_as_its_steps() -> None:
    async def filed() -> list[NodeSteps]:
        channel = RunChannel(run_id="r", node="n0")
        channel.begin(3, [4, 5])
        for rank in (4, 5):  # as the hub reads them: JSON lines
            channel.append(rank_message.validate_json(batch(rank, [1, 2, 3]).model_dump_json()))
        assert channel.last_step == {4: 3, 5: 3}
        return [r.message for r in channel.after(0) if isinstance(r.message, NodeSteps)]

    steps = asyncio.run(filed())
    assert [s.step for s in steps] == [1, 2, 3]
    first = steps[0]
    assert first.first_rank == 4 and first.samples == [[14], [15]]
    assert first.compute_s == [0.04 + 1, 0.05 + 1]
    assert steps[1].loss == [None, None] and steps[2].loss == [3.0, 3.0]
