"""stayalive's PyTorch Lightning callback (training/lightning.py) under the real workflow: a Lightning
script (tests/training/lightning_loop.py) loses a rank and resumes at its step and data position."""

from __future__ import annotations

from pathlib import Path

from temporalio.client import Client

from tests.e2e.framework_runs import a_killed_rank_resumes_exactly


async def test_a_killed_rank_resumes_lightning_at_its_step_and_data_position_bitwise(
    client: Client, tmp_path: Path
) -> None:
    await a_killed_rank_resumes_exactly(client, "tests/training/lightning_loop.py", tmp_path)
