"""stayalive's Hugging Face Trainer callback (training/hf_trainer.py) under the real workflow: a
Trainer script (tests/training/hf_loop.py) loses a rank and resumes at its step and data position."""

from __future__ import annotations

from pathlib import Path

from temporalio.client import Client

from tests.e2e.framework_runs import a_killed_rank_resumes_exactly


async def test_a_killed_rank_resumes_the_trainer_at_its_step_and_data_position_bitwise(
    client: Client, tmp_path: Path
) -> None:
    await a_killed_rank_resumes_exactly(client, "tests/training/hf_loop.py", tmp_path)
