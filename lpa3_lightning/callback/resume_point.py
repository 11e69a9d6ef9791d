"""Resuming from a checkpoint written on an epoch's last training batch: into that epoch's end.

``ModelCheckpoint(every_n_train_steps=N)`` saves in ``on_train_batch_end``. On an epoch's last
batch that is before the epoch's end: its validation, every ``on_train_epoch_end`` (the
callback's threshold, the module's, other callbacks') and the next epoch's
``on_train_epoch_start``. Lightning (2.6) resumes such a checkpoint as if the epoch had
ended: it runs none of them, continues the restored training loader (a stateful loader is at
the end of its pass: the next epoch is empty) and never calls the next epoch's start hooks.

:func:`resume_into_epoch_end` rewrites the checkpoint's loop progress, before Lightning
restores it, into the state of a checkpoint written after that batch completed, with the
epoch-end validation not yet run: Lightning then runs the validation (when it is due), the
epoch's end and the next epoch from its start, as the uninterrupted run did. It needs the
training loaders to be stateful (their position is in the checkpoint, torchdata's
``StatefulDataLoader``: :func:`lpa3_lightning.data.train_loader`): the restored loaders are at
the end of their pass, so the rewritten epoch takes no further batch. A checkpoint without the
loaders' state, or whose loader had already ended its pass, is left as it is
(:func:`last_batch_checkpoint` tells it).

One counter remains: Lightning counts the logging step of the finished batch after its
validation, which it skips when validation is not due; :meth:`ResumePoint.epoch_end` sets it.
Not rerun, as after any checkpoint written in ``on_train_batch_end`` (Lightning's behaviour):
the module's own ``on_train_batch_end`` of the checkpoint's batch, and, when no validation is
due, a ``ReduceLROnPlateau`` stepped every step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

__all__ = ["ResumeBookkeeping", "ResumePoint", "drop_pending_position", "is_lpa3_state", "last_batch_checkpoint",
           "refuse_a_split_memory_outside_lightning", "refuse_an_unrestored_loader_position", "resume_into_epoch_end",
           "warn_of_other_lpa3_states"]


@dataclass
class ResumePoint:
    """What a rewritten checkpoint still needs at the end of its epoch.

    Attributes:
        epoch: the epoch the checkpoint was written in.
        batches_that_stepped: the logging step count once that epoch's last batch has finished.
    """

    epoch: int
    batches_that_stepped: int

    def epoch_end(self, trainer: Any) -> None:
        """At the rewritten epoch's end: the logging step count of the uninterrupted run (Lightning
        adds the finished batch's step after a validation only), and no restored sampler position
        left pending for the next epoch."""
        loop = trainer.fit_loop.epoch_loop
        loop._batches_that_stepped = max(loop._batches_that_stepped, self.batches_that_stepped)
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        for loader in getattr(combined, "flattened", None) or []:
            drop_pending_position(loader)


def drop_pending_position(loader: Any) -> None:
    """Forget a restored position a loader's samplers hold for their next iterator.

    torchdata's ``StatefulDistributedSampler`` (and ``_StatefulRandomSamplerIterator``) apply a
    loaded position at their next ``__iter__``; the rewritten epoch draws no batch, so that next
    iterator would be the next epoch's, which would then start at the end of its pass and train
    nothing. (The package's ``EpochSampler`` already ties a restored position to its own iterator.)
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
        if getattr(sampler, "next_yielded", None) is not None:
            sampler.next_yielded = None


def _fit_progress(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    loops = checkpoint.get("loops")
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    needed = ("epoch_progress", "epoch_loop.batch_progress", "epoch_loop.val_loop.batch_progress")
    return fit if isinstance(fit, dict) and all(key in fit for key in needed) else None


def last_batch_checkpoint(checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` was written in ``on_train_batch_end`` of an epoch's last batch."""
    fit = _fit_progress(checkpoint)
    if fit is None:
        return False
    epochs, batches = fit["epoch_progress"]["total"], fit["epoch_loop.batch_progress"]
    total = batches["total"]
    mid_epoch = epochs["started"] == epochs["ready"] and epochs["processed"] == epochs["started"] - 1
    in_batch_end = total["ready"] == total["started"] == total["processed"] == total["completed"] + 1
    return bool(mid_epoch and in_batch_end and batches.get("is_last_batch"))


def resume_into_epoch_end(checkpoint: dict[str, Any]) -> ResumePoint | None:
    """Rewrite a last-batch checkpoint (in place) so that Lightning resumes into the epoch's end.

    Returns:
        The :class:`ResumePoint` for the epoch's end, or None when ``checkpoint`` is not a
        last-batch checkpoint or holds no state of its training loaders (nothing is changed).
    """
    if not last_batch_checkpoint(checkpoint):
        return None
    fit = checkpoint["loops"]["fit_loop"]
    loaders = fit.get("state_dict", {}).get("combined_loader")
    # a loader without state, or whose pass had ended (torchdata then starts the next one at once),
    # would give the finished epoch a new pass's batches
    if not loaders or any(isinstance(state, dict) and state.get("_iterator_finished") for state in loaders):
        return None
    batches = fit["epoch_loop.batch_progress"]
    # the batch completed: Lightning's state after on_train_batch_end ("restarted on last")
    for tracker in ("total", "current"):
        batches[tracker]["completed"] = batches[tracker]["processed"]
    # the epoch-end validation started and ran no batch ("restarted mid-evaluation"): Lightning
    # runs it whole when it is due, and skips it otherwise
    validation = fit["epoch_loop.val_loop.batch_progress"]
    done = validation["total"]["completed"]
    validation["total"].update(ready=done + 1, started=done + 1, processed=done, completed=done)
    validation["current"].update(ready=0, started=0, processed=0, completed=0)
    validation["is_last_batch"] = False
    stepped = int(fit.get("epoch_loop.state_dict", {}).get("_batches_that_stepped", 0))
    return ResumePoint(epoch=int(fit["epoch_progress"]["current"]["completed"]), batches_that_stepped=stepped + 1)


class ResumeBookkeeping:
    """The callback's part of a resumed fit: a checkpoint of an epoch's last batch (before the epoch's end)
    resumes into that end; with a loader that keeps no state Lightning skips it, and the callback ends its own
    part (the selection threshold) at the fit's start, saying what was skipped."""

    def __init__(self) -> None:
        self.point: ResumePoint | None = None  # Lightning runs the epoch's end (a rewritten checkpoint)
        self.unended_epoch: int | None = None  # Lightning skips it (a loader without state)

    def checkpoint_loaded(self, checkpoint: dict[str, Any]) -> None:
        self.point = resume_into_epoch_end(checkpoint)
        if self.point is not None:
            rank_zero_info(f"LPA3Callback: the checkpoint was written on epoch {self.point.epoch}'s last batch, before "
                           "the epoch's end: the fit resumes into that end (its validation and on_train_epoch_end), "
                           "which Lightning would skip.")
        elif last_batch_checkpoint(checkpoint):
            self.unended_epoch = int(checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"])
            rank_zero_warn(
                f"The checkpoint was written on epoch {self.unended_epoch}'s last batch, before the epoch's end, and "
                "the training loader keeps no state (or had ended its pass): Lightning resumes as if the epoch had "
                "ended, without its validation, its on_train_epoch_end hooks and the next epoch's on_train_epoch_start "
                "(a resume there would begin a new pass inside the finished epoch). LPA3Callback ends its own part "
                "(the selection threshold). Fix: a training loader that keeps its position "
                "(lpa3_lightning.data.train_loader, or torchdata's StatefulDataLoader): the resume then runs the "
                "epoch's end; or resume from a checkpoint written at an epoch's end."
            )

    def train_start(self, runners: list[tuple[Any, Any]]) -> None:
        """The pass ended on the checkpoint's batch and Lightning resumes past its end: its threshold now."""
        if self.unended_epoch is not None:
            for runner, _ in runners:
                runner.memory().refresh_threshold()
            self.unended_epoch = None

    def epoch_end(self, trainer: Any) -> None:
        if self.point is not None:
            self.point.epoch_end(trainer)
            self.point = None

    @staticmethod
    def pass_over(trainer: Any) -> bool:
        """Whether the ending epoch went through its training batches (not stopped mid-epoch by ``max_steps`` or
        ``trainer.should_stop``; ``limit_train_batches`` counts)."""
        batches = trainer.fit_loop.epoch_loop.batch_progress
        return bool(batches.is_last_batch) or batches.current.ready >= trainer.num_training_batches

    def clear(self) -> None:
        self.point = self.unended_epoch = None


def refuse_an_unrestored_loader_position(trainer: Any) -> None:
    """Refuse a resumed fit whose training loader's saved position Lightning left unloaded: something set the
    loader up before the checkpoint's loops were restored (``configure_optimizers`` reading
    ``trainer.estimated_stepping_batches``, Lightning issue #20550), and the resumed epoch would train another
    pass's batches, silently.

    Raises:
        RuntimeError: naming the cause and the fix.
    """
    loop = trainer.fit_loop
    if loop.restarting and getattr(loop, "_combined_loader_states_to_load", None):  # (read only)
        raise RuntimeError(
            "The checkpoint holds the training loader's position, but Lightning did not restore it: the training "
            "loader was set up before the checkpoint was loaded, typically by `trainer.estimated_stepping_batches` "
            "read in `configure_optimizers` (Lightning issue #20550), so the resumed epoch would train other batches "
            "than the uninterrupted run. Fix: read the run's length when the schedule first steps, not in "
            "configure_optimizers (e.g. a LambdaLR whose function reads trainer.estimated_stepping_batches at its "
            "first call with k > 0, as FixMatchClassifier does), or resume from a checkpoint written at an epoch's "
            "end."
        )


def is_lpa3_state(state: Any) -> bool:
    """Whether a callback state in a checkpoint is an LPA3Callback's (of any class or settings)."""
    return isinstance(state, dict) and "networks" in state and "seed" in state and "version" in state


def warn_of_other_lpa3_states(checkpoint: dict[str, Any], state_key: str) -> None:
    """Warn when a checkpoint holds LP-A3 state only under other callbacks' keys (the resumed callback then
    starts with a fresh memory)."""
    states = checkpoint.get("callbacks", {})
    others = [key for key, state in states.items() if key != state_key and is_lpa3_state(state)]
    if others and state_key not in states:
        rank_zero_warn(
            f"The checkpoint holds LP-A3 state under {others}, not under this callback's {state_key!r} (its class, "
            "ratio, sigma, steps or layers differ): this callback starts with a fresh TCS memory. Fix: resume with "
            "the callback class and settings the checkpoint was written with to continue its memory."
        )


def refuse_a_split_memory_outside_lightning(memories: list[Any]) -> None:
    """A memory split over the processes is assembled by its ``state_dict``, a collective: refuse a call that
    Lightning's checkpointing (which calls it on every rank) did not make.

    Raises:
        RuntimeError: naming the fix.
    """
    split = [memory for memory in memories if getattr(memory, "num_shards", 1) > 1]
    if split and not _called_by_lightning():
        raise RuntimeError(
            f"LPA3Callback's TCS memory is split over {split[0].num_shards} processes (selection.memory_layout), so "
            "its state_dict() assembles it from every process: a collective, which a call on one process alone would "
            "leave waiting. Fix: let Lightning write it (trainer.save_checkpoint(path), on every rank; ModelCheckpoint "
            "does so), or use selection.memory_layout='replicated'."
        )


def _called_by_lightning() -> bool:
    """Whether the callback's ``state_dict`` was called by Lightning's checkpointing, past the frames of this
    check and of the ``state_dict`` of the class and its subclasses."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name == "state_dict":
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "_call_callbacks_state_dict" \
        and frame.f_globals.get("__name__", "").startswith(("lightning.pytorch", "pytorch_lightning"))
