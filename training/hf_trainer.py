"""stayalive for a Hugging Face `transformers.Trainer`: one callback, thin over `stayalive.Run`.

    from stayalive.training.hf_trainer import StayaliveCallback

    trainer = Trainer(model=model, args=TrainingArguments(..., max_steps=...), train_dataset=dataset)
    trainer.add_callback(StayaliveCallback(trainer))
    trainer.train()

The callback creates the `Run` when training begins (the Trainer has wrapped the model in DDP and
made its optimizer and LR scheduler), so a resumed rank loads them and its RNG from the checkpoint
the workflow picked. It brackets every optimizer step with `begin_step`/`end_step` (a stop becomes
`control.should_training_stop`) and calls `finish` when training ends.

A resumed run goes on from its step as the Trainer's own `resume_from_checkpoint` does: the data
position follows from the step (the epoch's order is seeded by epoch, and the step's batches are the
next ones in it), `global_step` is the resumed step, and the RNG is restored where the Trainer would
restore it. The Trainer's loop counts epochs from 0 when it was not given a checkpoint of its own, so
the callback has it take the epochs already trained without reading a batch, and pass the batches
already trained in the resumed epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import structlog
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from stayalive.training.rng import rng_state, set_rng_state
from stayalive.training.run import Run, Stateful

if TYPE_CHECKING:
    from transformers import Trainer

log = structlog.get_logger()
_TRAINER_LOG = logging.getLogger("transformers.trainer")  # the Trainer's own


class StayaliveCallback(TrainerCallback):
    """Supervises `Trainer.train` through `stayalive.Run`; `run` is there once training has begun."""

    def __init__(
        self, trainer: Trainer, *, exact_resume: bool = True, state: dict[str, Stateful] | None = None
    ) -> None:
        """`trainer`: the Trainer this callback is added to (its DDP model is made when training begins).
        `exact_resume`: DDP gradients summed one tensor per all-reduce, so a resumed run ends bitwise
        equal to an uninterrupted one (see `Run`). `state`: more objects to save, the same on every rank."""
        self.trainer = trainer
        self.exact_resume = exact_resume
        self.extra = dict(state or {})
        self.run: Run | None = None
        self._epoch = -1  # the Trainer loop's epoch, counted from 0 in every train() call
        self._resume: _Resume | None = None
        self._loss_before = 0.0

    # -- training ------------------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = self.trainer
        loader = kwargs["train_dataloader"]
        batches = len(loader)  # per epoch, per rank
        accumulation = args.gradient_accumulation_steps
        per_epoch = max(-(-batches // accumulation), 1)  # optimizer steps in an epoch, as the Trainer counts them
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
        saved: dict[str, Stateful] = {"lr_scheduler": trainer.lr_scheduler} if trainer.lr_scheduler is not None else {}
        self._epoch = -1
        self.run = run = Run(
            trainer.model_wrapped,
            optimizer,
            state=saved | self.extra,
            target_step=state.max_steps,
            exact_resume=self.exact_resume,
        )
        if run.config is None:
            return
        if batches % accumulation:
            # Resumed mid-epoch, the Trainer's loop would not know the epoch's last, shorter accumulation.
            raise ValueError(
                f"under stayalive, gradient_accumulation_steps ({accumulation}) must divide the {batches} batches"
            )
        if state.max_steps != run.target_step:
            log.warning("max_steps is the run spec's target_step", max_steps=state.max_steps, target=run.target_step)
            state.max_steps = run.target_step
        if run.step == 0:
            return
        epochs, steps = divmod(run.step, per_epoch)
        skip = 0 if args.ignore_data_skip else steps * accumulation
        self._resume = _Resume(epochs, skip, batches, rng_state())
        state.global_step = run.step
        state.epoch = epochs + skip / batches
        # What the Trainer's own resume sets before its loop: the loss it logs is averaged from here.
        trainer._globalstep_last_logged = run.step
        trainer.get_batch_samples = self._resume.batch_samples(self, trainer.get_batch_samples)  # type: ignore[method-assign]
        log.info("resuming the Trainer's loop", step=run.step, epoch=epochs, batches_skipped=skip)

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._epoch += 1
        resume = self._resume
        if resume is not None and self._epoch < resume.epochs:
            _TRAINER_LOG.setLevel(logging.ERROR)  # its "not a single sample in your epoch_iterator"
        if resume is not None and self._epoch == resume.epochs and resume.skip == 0:
            # The resumed step starts this epoch: the streams are the checkpoint's before its loader
            # begins, as in an uninterrupted run (and as the Trainer's own resume has them).
            self._resumed(resume)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        assert self.run is not None
        if (resume := self._resume) is not None and not resume.done:
            # Mid-epoch: the batches passed over drew from the streams, which go back to the
            # checkpoint's now, after this step's batches are read (where the Trainer's resume does).
            self._resumed(resume)
        self.run.begin_step()
        self._loss_before = self._loss_so_far()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        assert self.run is not None
        if (resume := self._resume) is not None and self._epoch == resume.epochs:
            state.epoch += resume.skip / resume.batches  # the loop counts this epoch from the first batch it read
        self.run.record(self._loss_so_far() - self._loss_before)
        if not self.run.end_step():
            control.should_training_stop = True

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if (resume := self._resume) is None:
            return
        if self._epoch < resume.epochs:
            # An epoch trained before the checkpoint, passed over: the loop found no batch in it, which
            # it takes for the end of the data; nothing is logged, evaluated or saved for it either.
            control.should_training_stop = False
            control.should_log = control.should_evaluate = control.should_save = False
            _TRAINER_LOG.setLevel(resume.log_level)
        else:
            self._resume = None

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.run is not None:
            self.run.finish()

    # -- helpers -------------------------------------------------------------------------------------

    def _resumed(self, resume: _Resume) -> None:
        """The loop has reached the resumed step: the checkpoint's streams, and the Trainer's own
        `get_batch_samples` from here."""
        set_rng_state(resume.rng)
        resume.done = True
        del self.trainer.get_batch_samples

    def _loss_so_far(self) -> float:
        """The loss the Trainer has summed since it last logged (this rank's): a step's is the difference."""
        total = getattr(self.trainer, "_tr_loss", None)
        return float(total.item()) if isinstance(total, torch.Tensor) else 0.0


class _Resume:
    """Where a resumed run goes on: `epochs` trained before it, and `skip` of the next epoch's
    `batches` trained too; `rng`, the streams the checkpoint left."""

    def __init__(self, epochs: int, skip: int, batches: int, rng: dict[str, Any]) -> None:
        self.epochs, self.skip, self.batches, self.rng = epochs, skip, batches, rng
        self.done = False  # the loop has reached the resumed step
        self.log_level = _TRAINER_LOG.level

    def batch_samples(self, callback: StayaliveCallback, read: Any) -> Any:
        """The Trainer's `get_batch_samples` until the loop reaches the resumed step: no batch in an
        epoch already trained (nor read: its iterator never starts), and the batches the resumed
        epoch had trained read and dropped."""

        def batch_samples(epoch_iterator: Iterator[Any], num_batches: int, device: torch.device) -> Any:
            if callback._epoch < self.epochs:
                return [], None
            for _ in range(self.skip):
                next(epoch_iterator, None)
            return read(epoch_iterator, num_batches, device)

        return batch_samples
