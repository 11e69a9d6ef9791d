"""A fit resumed from any of its checkpoints runs the hooks the uninterrupted fit ran after that
checkpoint, in the same order and at the same epoch, step and logging step: also from a
checkpoint written on an epoch's last batch (``ModelCheckpoint(every_n_train_steps=...)``),
before that epoch's validation and end, which Lightning resumes as if the epoch had ended
(lpa3_lightning/callback/resume_point.py). The bitwise end of such runs: tests/test_resume.py
and the chaos run (tests/test_chaos_resume.py)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lpa3_lightning import LPA3Callback
from lpa3_lightning.data import train_loader
from tests.callback.test_lpa3_callback import TinyClassifier
from tests.helpers import GlobalRandomState, indexed_images

N, BATCH, EPOCHS = 12, 4, 3  # 3 batches an epoch


class Traced(TinyClassifier):
    """With a validation loop and an epoch scheduler, whose steps the trace shows."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val/loss", torch.nn.functional.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)]


class Trace(Callback):
    """The hooks of a fit with (epoch, global step, logging step) and what they saw; its state
    says how much of the trace a checkpoint had seen."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.resumed_at = 0
        self.start_threshold: float | None = None  # the TCS threshold when the fit's training starts

    def _event(self, trainer: pl.Trainer, hook: str, *seen: Any) -> None:
        stepped = trainer.fit_loop.epoch_loop._batches_that_stepped
        self.events.append((hook, trainer.current_epoch, trainer.global_step, stepped, *seen))

    def on_train_start(self, trainer, pl_module):
        self.start_threshold = float(_lpa3(trainer).runner().tcs.threshold)

    def on_train_epoch_start(self, trainer, pl_module):
        self._event(trainer, "epoch_start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._event(trainer, "batch", batch_idx, batch[2].tolist())

    def on_validation_start(self, trainer, pl_module):
        self._event(trainer, "validation")

    def on_train_epoch_end(self, trainer, pl_module):
        self._event(trainer, "epoch_end", trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0],
                    float(_lpa3(trainer).runner().tcs.threshold))

    def on_train_end(self, trainer, pl_module):
        # the solver settings the callback's state names (the feature layers its fit resolved)
        self.final_settings = _lpa3(trainer).runner().solver_settings()

    def state_dict(self) -> dict[str, Any]:
        return {"at": len(self.events)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.resumed_at = state_dict["at"]


def _lpa3(trainer: pl.Trainer) -> LPA3Callback:
    return next(c for c in trainer.callbacks if isinstance(c, LPA3Callback))


def _torchdata_loader() -> Any:
    """torchdata's own stateful loader and sampler (what a DDP user may pick instead of the package's)."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    data = indexed_images(N)
    return StatefulDataLoader(data, batch_size=BATCH,
                              sampler=StatefulDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))


def _fit(root: Path, check_val_every_n_epoch: int, ckpt: Path | None = None, plain: bool = False,
         torchdata: bool = False) -> Trace:
    pl.seed_everything(0)
    trace = Trace()
    trainer = pl.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, check_val_every_n_epoch=check_val_every_n_epoch,
        callbacks=[LPA3Callback(ratio=0.5, steps=1, seed=0, input_range=None), trace, GlobalRandomState(),
                   ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)])
    loader = DataLoader(indexed_images(N), batch_size=BATCH, shuffle=False) if plain else \
        _torchdata_loader() if torchdata else train_loader(indexed_images(N), BATCH, seed=0)
    trainer.fit(Traced(), loader, DataLoader(indexed_images(8, seed=1), batch_size=BATCH), ckpt_path=ckpt)
    return trace


@pytest.mark.parametrize("check_val_every_n_epoch", [1, 2])
def test_a_resume_from_any_checkpoint_runs_the_hooks_of_the_uninterrupted_fit(tmp_path, check_val_every_n_epoch):
    """Every step's checkpoint, the epochs' last batches included; validation due at every
    epoch's end, or at every second one (the epoch-end's logging step is then counted without it)."""
    full = _fit(tmp_path / "full", check_val_every_n_epoch)
    checkpoints = sorted((tmp_path / "full" / "ckpt").glob("step=*.ckpt"), key=lambda p: int(p.stem[5:]))
    assert len(checkpoints) == EPOCHS * N // BATCH
    for ckpt in checkpoints:
        resumed = _fit(tmp_path / ckpt.stem, check_val_every_n_epoch, ckpt)
        assert resumed.events == full.events[resumed.resumed_at:], ckpt.name
        # (from the last batch's checkpoint nothing is solved after the resume: the checkpoint's layers)
        assert resumed.final_settings == full.final_settings, ckpt.name


def test_torchdatas_own_sampler_resumed_into_an_epochs_end_gives_the_next_epoch_its_batches(tmp_path):
    """torchdata's StatefulDistributedSampler keeps a restored position pending until its next
    iterator: the rewritten epoch draws no batch, so without a reset the next epoch would start at
    the end of its pass and train nothing."""
    full = _fit(tmp_path / "full", 1, torchdata=True)
    for step in (3, 6):  # the last batches of epochs 0 and 1
        resumed = _fit(tmp_path / f"resumed{step}", 1, tmp_path / "full" / "ckpt" / f"step={step}.ckpt", torchdata=True)
        assert resumed.events == full.events[resumed.resumed_at:], step


def test_a_loader_without_state_resumed_from_a_last_batch_checkpoint_ends_the_lpa3_epoch_and_warns(tmp_path):
    """A plain DataLoader: Lightning starts the next epoch (it cannot end the finished one: its loader
    would begin a new pass inside it), so the callback refreshes the threshold of the finished pass
    itself (the next epoch selects by it, not by the first pass's rule) and names what Lightning
    skipped and the fix."""
    full = _fit(tmp_path / "full", 1, plain=True)
    thresholds = [event[-1] for event in full.events if event[0] == "epoch_end"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(tmp_path / "resumed", 1, tmp_path / "full" / "ckpt" / "step=3.ckpt", plain=True)
    assert any("last batch" in str(w.message) and "train_loader" in str(w.message) for w in caught)
    assert resumed.start_threshold == thresholds[0]  # epoch 0's, as epoch 1 of the uninterrupted fit used
    assert [event[1] for event in resumed.events if event[0] == "epoch_end"] == [1, 2]


class ReadsTheRunsLength(TinyClassifier):
    """A schedule sized by ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` (OneCycleLR's
    usual recipe), which sets the training loader up before a checkpoint's loops are restored."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        total = int(self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total),
            "interval": "step"}}


def test_a_loader_position_lightning_did_not_restore_is_a_named_error(tmp_path):
    """Lightning (issue #20550) never loads the training loader's saved position when configure_optimizers read
    trainer.estimated_stepping_batches: the resumed epoch would train other batches. The callback refuses to go
    on, naming the cause and the fix; with the length read later the same resume runs."""

    def fit(module, ckpt_path=None):
        pl.seed_everything(0)
        loader = train_loader(indexed_images(N), BATCH, seed=0)
        trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=EPOCHS, accelerator="cpu", devices=1,
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[LPA3Callback(ratio=0.5, steps=1, seed=0),
                                        ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1,
                                                        save_top_k=-1, filename="{step}"),
                                        ModelCheckpoint(dirpath=tmp_path / "epochs", save_on_train_epoch_end=True,
                                                        save_top_k=-1, filename="{epoch}")])
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer

    fit(ReadsTheRunsLength())
    with pytest.raises(RuntimeError, match=r"estimated_stepping_batches.*Lightning issue #20550.*Fix:"):
        fit(ReadsTheRunsLength(), ckpt_path=tmp_path / "ckpt" / "step=4.ckpt")
    fit(TinyClassifier(), ckpt_path=tmp_path / "ckpt" / "step=4.ckpt")  # (no early read: it resumes)
    # an epoch's end holds a finished pass: nothing to lose, the fit goes on
    assert fit(ReadsTheRunsLength(), ckpt_path=tmp_path / "epochs" / "epoch=0.ckpt").global_step == 3 * EPOCHS


def test_a_finished_run_launched_again_keeps_the_callbacks_whole_state(tmp_path):
    """fit(ckpt_path=last.ckpt) of a finished run returns at once (Lightning runs no on_train_start): a checkpoint
    written then holds the LP-A3 state of last.ckpt, all of it, and one more epoch from either file is the same."""

    def fit(max_epochs, ckpt_path=None, save=None):
        pl.seed_everything(0)
        callback = LPA3Callback(ratio=0.5, steps=1, seed=0, cache={"regenerate_every_n_epochs": 2,
                                                                    "in_checkpoint": True})
        trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=max_epochs, accelerator="cpu", devices=1,
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             # (no GlobalRandomState: a relaunch that returns at once saves the generator's
                             # state of the moment; both continuations start from seed_everything's)
                             callbacks=[callback, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
        module = TinyClassifier()
        trainer.fit(module, train_loader(indexed_images(N), BATCH, seed=0), ckpt_path=ckpt_path)
        if save is not None:
            trainer.save_checkpoint(save)
        return {k: v.clone() for k, v in module.state_dict().items()}

    fit(EPOCHS)
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    fit(EPOCHS, ckpt_path=tmp_path / "ckpt" / "last.ckpt", save=tmp_path / "again.ckpt")  # returns at once
    again = torch.load(tmp_path / "again.ckpt", weights_only=False)
    (key,) = [k for k in last["callbacks"] if k.startswith("LPA3Callback")]
    before, after = last["callbacks"][key]["networks"][""], again["callbacks"][key]["networks"][""]
    assert set(after) == set(before) and after["settings"] == before["settings"] is not None
    assert after["augment_start"] == before["augment_start"] is not None
    assert torch.equal(after["cache"]["storage"], before["cache"]["storage"])
    for name, value in before["tcs"].items():
        assert torch.equal(value, after["tcs"][name]) if isinstance(value, torch.Tensor) else value == after["tcs"][name]
    one_more = fit(EPOCHS + 1, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    from_again = fit(EPOCHS + 1, ckpt_path=tmp_path / "again.ckpt")
    for name, value in one_more.items():
        assert torch.equal(value, from_again[name]), name
