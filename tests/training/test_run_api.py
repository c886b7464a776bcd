"""The public training API's checkpoints, with real ranks under torchrun (gloo) and no server: a resume
is bitwise exact, an FSDP2 state reshards to another world size, and what must not load never does."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stayalive.training import validate
from stayalive.training.checkpoint import DCP_METADATA, CheckpointError, parse_checkpoint_dirname, read_dcp_manifest
from stayalive.training.dcp_load import load_dcp_metadata
from stayalive.workers.devstack import free_port
from tests.helpers import ROOT

LOOP = "tests/training/api_loop.py"
RUN_ID = "api/0123abcd"
# DDP; FSDP2; and no wrapper, the loop all-reducing through run.all_reduce_gradients
WRAPPINGS: dict[str, tuple[str, ...]] = {"ddp": (), "fsdp2": ("--fsdp",), "manual": ("--manual",)}


def launch(
    tmp_path: Path,
    name: str,
    ranks: int,
    *flags: str,
    generation: int = 0,
    resume: Path | None = None,
    plain: bool = False,
) -> dict[str, torch.Tensor]:
    """The loop of tests/training/api_loop.py to step 20, checkpointing every 5 steps under `tmp_path`;
    `plain`: under torchrun alone, where `Run` only counts steps."""
    out = tmp_path / f"{name}.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAYALIVE_")}
    if plain:
        flags = (*flags, "--steps", "20")
    else:
        env |= {
            "STAYALIVE_RUN_ID": RUN_ID,
            "STAYALIVE_GENERATION": str(generation),
            "STAYALIVE_TARGET_STEP": "20",
            "STAYALIVE_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
            "STAYALIVE_CHECKPOINT_EVERY_STEPS": "5",
            "STAYALIVE_RESUME_FROM": str(resume or ""),
        }
    # A port of its own: torchrun's default (29500) is shared with the other test worker's torchrun.
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port"]
    argv += [str(free_port()), LOOP, "--out", str(out)]
    done = subprocess.run([*argv, *flags], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, "\n".join(line for line in done.stderr.splitlines() if "Warning" not in line)[-6000:]
    return torch.load(out, weights_only=True)


def checkpoint(tmp_path: Path, step: int, generation: int = 0) -> Path:
    return tmp_path / "checkpoints" / f"step-{step:08d}-g{generation}"


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """One uninterrupted 2-rank run per model wrapping, to step 20: its directory and final weights."""
    runs = {}
    for name, flags in WRAPPINGS.items():
        directory = tmp_path_factory.mktemp(name)
        runs[name] = directory, launch(directory, "uninterrupted", 2, *flags)
    return runs


@pytest.mark.parametrize("wrapping", list(WRAPPINGS))
def test_a_resumed_loop_ends_bitwise_equal_to_an_uninterrupted_one(
    uninterrupted: dict[str, tuple[Path, dict[str, torch.Tensor]]], wrapping: str
) -> None:
    directory, weights = uninterrupted[wrapping]
    # A checkpoint still waiting for storage when a newer one arrives never commits (training/flusher.py):
    # on a loaded host that may be any one of those the run saved every 5 steps, but the last.
    committed = next((c for step in (10, 5, 15) if (c := checkpoint(directory, step)).is_dir()), None)
    assert committed is not None, f"no checkpoint before the last committed: {sorted(directory.glob('*/*'))}"
    manifest = read_dcp_manifest(committed)
    assert (manifest.step, manifest.world_size) == (parse_checkpoint_dirname(committed.name)[0], 2)
    assert validate.test_load(committed).ok
    resumed = launch(directory, f"resumed-{wrapping}", 2, *WRAPPINGS[wrapping], generation=1, resume=committed)
    assert_equal(resumed, weights)


@pytest.mark.parametrize("sums", ["exact", "bucket"])
def test_ddp_gradient_buckets_through_the_api_end_where_plain_ddp_does(tmp_path: Path, sums: str) -> None:
    """Many buckets, each all-reduced through the API's comm hook (the vote riding the first, every one
    waited for at the last): the weights end bitwise where DDP's own all-reduce under plain torchrun
    puts them (two ranks: a sum of two is the same in any order)."""
    flags = ("--bucket-cap-mb", "0.0005", *(("--bucket-sums",) if sums == "bucket" else ()))  # a bucket a tensor
    assert_equal(launch(tmp_path, "supervised", 2, *flags), launch(tmp_path, "plain", 2, *flags, plain=True))


def test_an_fsdp2_state_resumes_resharded_at_another_world_size(
    uninterrupted: dict[str, tuple[Path, dict[str, torch.Tensor]]],
) -> None:
    directory, _ = uninterrupted["fsdp2"]
    saved = read_dcp_manifest(checkpoint(directory, 10))
    assert saved.world_size == 2 and all(r.files for r in saved.ranks), "every rank wrote its shard"
    launch(directory, "narrow", 1, "--fsdp", generation=2, resume=checkpoint(directory, 10))
    # The narrow run's first checkpoint (step 15) holds the wide run's step 10 state trained 5 steps
    # further: its model keys and shapes are the wide run's, whole.
    resharded = read_dcp_manifest(checkpoint(directory, 15, generation=2))
    assert resharded.world_size == 1
    assert {k: v for k, v in resharded.tensors.items() if k.startswith("model.")} == {
        k: v for k, v in saved.tensors.items() if k.startswith("model.")
    }
    assert validate.test_load(checkpoint(directory, 20, generation=2)).ok


def test_a_damaged_file_or_a_pickle_that_runs_code_is_refused(
    uninterrupted: dict[str, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    directory, _ = uninterrupted["ddp"]
    damaged = shutil.copytree(checkpoint(directory, 5), tmp_path / "step-00000005-g0")
    with open(damaged / "__1_0.distcp", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    verdict = validate.test_load(damaged)
    assert not verdict.ok and "__1_0.distcp does not match its SHA-256" in verdict.problems[0]

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    with pytest.raises(CheckpointError, match=r"names (posix|os)\.system"):
        load_dcp_metadata(pickle.dumps(Evil()))
    # A real one loads: the copy's, untouched (the resume test's run in `directory` may prune its checkpoints).
    assert load_dcp_metadata((damaged / DCP_METADATA).read_bytes()).state_dict_metadata
