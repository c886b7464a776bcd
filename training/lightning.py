"""stayalive for a PyTorch Lightning `Trainer`: one callback, thin over `stayalive.Run`.

    from stayalive.training.lightning import StayaliveCallback

    sampler = StatefulDistributedSampler(dataset, seed=0)             # torchdata: resumable order and position
    loader = StatefulDataLoader(dataset, batch_size=..., sampler=sampler)
    trainer = L.Trainer(strategy="ddp", max_steps=..., callbacks=[StayaliveCallback()])
    trainer.fit(module, loader)

The callback creates the `Run` when fit begins (the strategy has wrapped the model in DDP and the
optimizer exists), so a resumed rank loads model, optimizer, LR schedulers, RNG and data position
from the checkpoint the workflow picked. It brackets every optimizer step with `begin_step`/`end_step`
(a stop becomes `trainer.should_stop`) and calls `finish` when training ends.

Lightning's own loop state is what resumes it, as Lightning's `ckpt_path` does: the fit loop's
counters (global_step, epoch, batch index) are saved with the model, the same on every rank, and
each rank's data loader positions (`StatefulDataLoader.state_dict`, which Lightning collects) with
that rank's RNG. A loader without `state_dict` restarts its epoch on resume (Lightning warns).
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import lightning.pytorch as pl
import structlog
import torch
from torch.utils.data import SequentialSampler

from stayalive.training.rng import rng_state, set_rng_state
from stayalive.training.run import Run, Stateful

log = structlog.get_logger()

_LOADERS = "combined_loader"  # where Lightning's fit loop keeps its loaders' states (FitLoop.on_save_checkpoint)


class _LoopState:
    """The fit loop's state, split as `Run` saves it: the counters (every rank's are the same, saved
    once with the model) and this rank's data loader positions (saved per rank). Loaded back, the
    halves are joined and handed to the fit loop, which resumes from them as from a Lightning
    checkpoint saved at the end of a training batch."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.counters: dict[str, Any] | None = None
        self.loaders: list[dict[str, Any]] = []
        self.shared = _Half(self, "counters")
        self.per_rank = _Half(self, "loaders")

    def split(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        state = self.trainer.fit_loop.state_dict()
        own = dict(state.get("state_dict", {}))
        loaders = own.pop(_LOADERS, [])
        return state | {"state_dict": own}, loaders

    @property
    def mid_epoch(self) -> bool:
        """Saved before its epoch's last batch (only meaningful once loaded)."""
        return not (self.counters or {}).get("epoch_loop.batch_progress", {}).get("is_last_batch", False)

    def apply(self) -> None:
        assert self.counters is not None
        own = dict(self.counters.get("state_dict", {}))
        # Saved after an epoch's last batch, a loader's state is its spent iterator: loaded, Lightning
        # would go through one empty epoch (and the next epoch's order) instead of the next epoch's data.
        # An uninterrupted run starts that epoch with a fresh iterator, and so does a resumed one.
        if self.loaders and self.mid_epoch:
            own[_LOADERS] = self.loaders
        self.trainer.fit_loop.load_state_dict(self.counters | {"state_dict": own})


class _Half:
    """One half of the fit loop's state, as the `Stateful` that `Run` saves and loads."""

    def __init__(self, loop: _LoopState, half: str) -> None:
        self.loop, self.half = loop, half

    def state_dict(self) -> dict[str, Any]:
        counters, loaders = self.loop.split()
        return counters if self.half == "counters" else {"loaders": loaders}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        if self.half == "counters":
            self.loop.counters = state_dict
        else:
            self.loop.loaders = list(state_dict["loaders"])


class StayaliveCallback(pl.Callback):
    """Supervises `Trainer.fit` through `stayalive.Run`; `run` is there once fit has begun."""

    def __init__(self, *, exact_resume: bool = True, state: dict[str, Stateful] | None = None) -> None:
        """`exact_resume`: DDP gradients summed one tensor per all-reduce, so a resumed run ends bitwise
        equal to an uninterrupted one (see `Run`). `state`: more objects to save, the same on every rank."""
        self.exact_resume = exact_resume
        self.extra = dict(state or {})
        self.run: Run | None = None
        self._loop: _LoopState | None = None
        self._in_step = False
        self._restored_rng: dict[str, Any] | None = None  # set on resume mid-epoch, until training starts

    # -- fit ----------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) > 1:
            raise ValueError("stayalive's Lightning callback supports one optimizer")
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        schedulers = {f"lr_scheduler{i}": config.scheduler for i, config in enumerate(trainer.lr_scheduler_configs)}
        precision = trainer.precision_plugin
        saved: dict[str, Stateful] = dict(schedulers)
        if precision.state_dict():  # a gradient scaler's scale and counters
            saved["precision"] = precision
        self._loop = loop = _LoopState(trainer)
        target = trainer.max_steps if trainer.max_steps >= 0 else sys.maxsize  # outside stayalive only
        model = trainer.strategy.model
        assert model is not None, "fit has begun: the strategy has set up the model"
        self.run = run = Run(
            model,
            optimizer,
            dataloader=loop.per_rank,
            state={"loop": loop.shared, **saved, **self.extra},
            target_step=target,
            exact_resume=self.exact_resume,
        )
        if run.config is not None:
            if trainer.max_steps != run.target_step:
                log.warning(
                    "max_steps is the run spec's target_step", max_steps=trainer.max_steps, target=run.target_step
                )
            trainer.fit_loop.epoch_loop.max_steps = run.target_step
        if loop.counters is not None:  # resumed
            loop.apply()
            self._restored_rng = rng_state() if loop.mid_epoch else None
            log.info("resuming Lightning's loop", step=run.step, global_step=trainer.global_step)
            if trainer.global_step != run.step:
                raise RuntimeError(f"global_step {trainer.global_step} resumed at stayalive's step {run.step}")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None and self.run.config is not None and signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
            # Lightning has just taken SIGTERM to stop at the next batch (broadcasting it to the other
            # ranks from the handler). The node agent's SIGTERM means now: a rank blocked in a collective
            # with a dead peer would only go at the SIGKILL that follows seconds later, delaying the restart.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self._restored_rng is not None:
            # Resumed mid-epoch, the loader's restored iterator has just been made, one more than an
            # uninterrupted run made, and making one draws a seed from torch's generator: the streams
            # go back to the checkpoint's before the first batch is read. (Between epochs the
            # uninterrupted run makes the next epoch's iterator too: nothing to undo.)
            set_rng_state(self._restored_rng)
            self._restored_rng = None
        for loader in _loaders(trainer.train_dataloader):
            sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None) or getattr(
                loader, "sampler", None
            )
            if not hasattr(loader, "state_dict") or not (hasattr(sampler, "state_dict") or not _shuffles(sampler)):
                # Lightning wraps a shuffling sampler that keeps no state (StatefulDataLoader's own
                # shuffle=True too) in a DistributedSampler that draws the epoch's order from the RNG.
                log.warning(
                    "a resume mid-epoch will not read this loader's data where it stopped: use torchdata's "
                    "StatefulDataLoader with sampler=StatefulDistributedSampler(dataset, shuffle=..., seed=...)",
                    loader=type(loader).__name__,
                    sampler=type(sampler).__name__,
                )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.run is not None
        if not self._in_step:  # the first batch of an optimizer step (more with gradient accumulation)
            self.run.begin_step()
            self._in_step = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self.run is not None
        if trainer.global_step <= self.run.step:
            return  # accumulating: the optimizer has not stepped yet
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.run.record(loss if isinstance(loss, torch.Tensor | float) else None)
        self._in_step = False
        if not self.run.end_step():
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None:
            self.run.finish()


def _loaders(iterables: Any) -> list[Any]:
    """The loaders in what `trainer.train_dataloader` gives: one, or a list, tuple or dict of them."""
    if isinstance(iterables, dict):
        return [loader for value in iterables.values() for loader in _loaders(value)]
    if isinstance(iterables, list | tuple):
        return [loader for value in iterables for loader in _loaders(value)]
    return [iterables] if iterables is not None else []


def _shuffles(sampler: Any) -> bool:
    return sampler is not None and not isinstance(sampler, SequentialSampler) and getattr(sampler, "shuffle", True)
