"""A checkpoint's tensors are copied while the loop goes on into its next step, and the update waits
for the copy (training/state_checkpointer.py): what is committed is the state at the saved step, and
the wait counts in the save's blocking time. The copy is slowed here, as a busy device's would be, so
that an update or a forward that did not wait would land in the checkpoint."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stayalive.training import staging, state_checkpointer
from stayalive.training.checkpoint import checkpoint_dirname
from stayalive.training.commit import Committer
from stayalive.training.faults import FaultInjector
from stayalive.training.loop_state import LoopState
from stayalive.training.state_checkpointer import StateCheckpointer
from stayalive.training.state_restore import restore_state

RUN = "staging/0000abcd"
COPY_S = 0.3  # how long the slowed copy takes


@pytest.fixture
def slow_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    copy = staging._copied

    def slowly(*args: Any) -> dict[str, Any]:
        time.sleep(COPY_S)
        return copy(*args)

    monkeypatch.setattr(staging, "_copied", slowly)


def loop(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model with batch norm (a forward changes its running statistics) and its AdamW, one step in."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer)
    return model, optimizer


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(32, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for index, moments in optimizer.state_dict()["state"].items():
        flat |= {f"optim/{index}/{k}": torch.as_tensor(v).clone() for k, v in moments.items()}
    return flat


def checkpointer(directory: Path, group: dist.ProcessGroup, overlap: bool) -> StateCheckpointer:
    committer = Committer(directory, RUN, 0, dist.HashStore(), None, FaultInjector([], 0, 0))
    return StateCheckpointer(
        committer,
        rank=0,
        world_size=1,
        group=group,
        config_digest="digest",
        on_commit=lambda manifest, path: None,
        on_outage=lambda step, since, error: None,
        durable=None,
        overlap=overlap,
    )


def restored(directory: Path, group: dist.ProcessGroup, step: int) -> dict[str, torch.Tensor]:
    """The checkpoint of `step` loaded into a differently seeded model and optimizer: their tensors."""
    model, optimizer = loop(seed=1)
    state = LoopState(model, optimizer)
    loaded = restore_state(directory / checkpoint_dirname(step, 0), RUN, 0, 1, None, group, state.loadable(0, False))
    state.load(loaded.state, 0, step, carried=False)
    return tensors(model, optimizer)


@pytest.mark.usefixtures("slow_copy")
def test_the_next_step_goes_on_during_the_copy_and_its_update_waits_for_it(
    tmp_path: Path, group: dist.ProcessGroup
) -> None:
    model, optimizer = loop(seed=0)
    saving = checkpointer(tmp_path, group, overlap=True)
    optimizer.register_step_pre_hook(lambda *_: saving.staged())  # as Run's own pre-hook does
    updates: list[float] = []
    optimizer.register_step_pre_hook(lambda *_: updates.append(time.perf_counter()))  # the update begins
    saved = tensors(model, optimizer)

    started = time.perf_counter()
    at_call = saving.save(1, lambda: LoopState(model, optimizer).state(0))
    assert at_call < COPY_S, "the save returned before its copy"
    train(model, optimizer)  # a forward (batch norm's statistics) and an update, during the copy
    assert updates[0] - started >= COPY_S, "the update began once the copy was done"
    assert saving.blocking_s > at_call, "and its wait counts in the save's blocking time"
    saving.wait()

    now = tensors(model, optimizer)
    assert [name for name in saved if torch.equal(now[name], saved[name])] == [], "the loop went on"
    loaded = restored(tmp_path, group, 1)
    assert [name for name in saved if not torch.equal(loaded[name], saved[name])] == []


@pytest.mark.usefixtures("slow_copy")
def test_without_an_update_to_wait_at_the_save_waits_for_the_copy(tmp_path: Path, group: dist.ProcessGroup) -> None:
    model, optimizer = loop(seed=0)
    saving = checkpointer(tmp_path, group, overlap=False)
    saved = tensors(model, optimizer)
    assert saving.save(1, lambda: LoopState(model, optimizer).state(0)) >= COPY_S
    train(model, optimizer)
    saving.wait()
    loaded = restored(tmp_path, group, 1)
    assert [name for name in saved if not torch.equal(loaded[name], saved[name])] == []


WRITE_S = 0.6  # how long the slowed write of one checkpoint takes


@pytest.fixture
def slow_write(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, float]]:
    """dcp.save slowed as a busy disk would be; each write's (directory, start, end)."""
    writes: list[tuple[str, float, float]] = []
    save = state_checkpointer.dcp.save

    def slowly(state: dict[str, Any], *, storage_writer: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        time.sleep(WRITE_S)
        result = save(state, storage_writer=storage_writer, **kwargs)
        writes.append((Path(storage_writer.path).name, started, time.perf_counter()))
        return result

    monkeypatch.setattr(state_checkpointer.dcp, "save", slowly)
    return writes


def test_a_save_does_not_wait_for_the_last_ones_write_only_for_the_one_before(
    tmp_path: Path, group: dist.ProcessGroup, slow_write: list[tuple[str, float, float]]
) -> None:
    """Two sets of staging buffers, used in turn: the save after a slow write copies into the other set
    at once; the next copies into the first set again, so it waits for the write that read it. Every
    checkpoint holds its own step's state, and the writes land one at a time, in order."""
    model, optimizer = loop(seed=0)
    saving = checkpointer(tmp_path, group, overlap=False)
    saved, blocking = {}, {}
    for step in (1, 2, 3):
        saved[step] = tensors(model, optimizer)
        blocking[step] = saving.save(step, lambda: LoopState(model, optimizer).state(0))
        train(model, optimizer)
    saving.wait()
    assert blocking[2] < WRITE_S / 2, "step 2 copied into the other buffers while step 1's write went on"
    assert blocking[3] >= WRITE_S / 2, "step 3 reuses step 1's buffers: it waited for that write"
    written = [name for name, _, _ in slow_write]  # each into its staging directory
    assert [checkpoint_dirname(step, 0) in name for step, name in zip((1, 2, 3), written, strict=True)] == [True] * 3
    assert all(earlier[2] <= later[1] for earlier, later in itertools.pairwise(slow_write)), "one write at a time"
    for step in (1, 2, 3):
        loaded = restored(tmp_path, group, step)
        assert [name for name in saved[step] if not torch.equal(loaded[name], saved[step][name])] == [], step
