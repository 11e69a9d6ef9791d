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

from dataclasses import dataclass
from typing import Any

__all__ = ["ResumePoint", "drop_pending_position", "last_batch_checkpoint", "resume_into_epoch_end"]


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
