"""The x' cache in a fit: its folder checked when the fit starts, and its memory bound shared by
the module's networks (under DDP each process holds the whole cache: tests/test_ddp.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lpa3_lightning import LPA3Callback
from tests.callback.test_lpa3_callback import TinyClassifier
from tests.callback.test_fit_checks import ReadmeCoTraining
from tests.helpers import indexed_images


def _trainer(tmp_path, callback, epochs: int = 2) -> pl.Trainer:
    return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path)


def test_an_unusable_cache_folder_stops_the_fit_at_its_start_by_name(tmp_path):
    """Not after the warm-up, at the first x' written, as a raw NotADirectoryError."""
    (tmp_path / "a_file").write_text("not a folder")
    module = TinyClassifier()
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0, warmup_epochs=1, input_range=None,
                            cache={"regenerate_every_n_epochs": 2, "max_bytes": 0,
                                   "dir": str(tmp_path / "a_file" / "cache")})
    with pytest.raises(ValueError, match=r"`cache\.dir`.*a_file.*not a folder.*Fix"):
        _trainer(tmp_path, callback).fit(module, DataLoader(indexed_images(32), batch_size=16))
    assert module.seen_augmented == []  # no training step ran


def test_the_networks_of_a_module_share_max_bytes(tmp_path):
    """Two networks, 48 samples of 1x28x28 float32: 150,528 bytes of x' each. With max_bytes=200,000
    one store would fit in memory, both do not: each network gets half, so both go to files (they
    held 301,056 bytes in memory together)."""
    pl.seed_everything(0)
    callback = HeldBytes(ratio=0.5, steps=1, seed=0, input_range=None,
                         cache={"regenerate_every_n_epochs": 2, "max_bytes": 200_000, "dir": str(tmp_path / "c")})
    trainer = _trainer(tmp_path, callback, epochs=1)
    trainer.fit(ReadmeCoTraining(), DataLoader(indexed_images(48), batch_size=16, shuffle=True))
    assert [nbytes for nbytes, _ in callback.held] == [150_528, 150_528]  # both stores written
    in_memory = sum(nbytes for nbytes, in_file in callback.held if not in_file)
    assert in_memory <= 200_000, in_memory


class HeldBytes(LPA3Callback):
    """Each network's store at the epoch's end (a file store is closed with the fit): (bytes, in a file)."""

    held: list = []

    def on_train_epoch_end(self, trainer, pl_module):
        super().on_train_epoch_end(trainer, pl_module)
        self.held = [(runner.store.nbytes, runner.store.file is not None) for runner in self.networks.values()]
