"""NanIgnoringMean: MeanMetric(nan_strategy="ignore")'s value without its host read."""

from __future__ import annotations

import math

import torch
from torchmetrics import MeanMetric

from lpa3_lightning.callback.epoch_mean import NanIgnoringMean
from lpa3_lightning.core.host_reads import HostReadCounter


def test_equals_torchmetrics_ignore_strategy_with_weights_and_nans() -> None:
    g = torch.Generator().manual_seed(0)
    ours, reference = NanIgnoringMean(), MeanMetric(nan_strategy="ignore")
    for _ in range(5):
        value = torch.randn(7, generator=g)
        value[torch.rand(7, generator=g) < 0.3] = float("nan")
        weight = torch.rand(7, generator=g)
        ours.update(value, weight)
        reference.update(value, weight)
    ours.update(torch.tensor(2.5), 3)  # a scalar with an int weight, as the callback logs
    reference.update(torch.tensor(2.5), 3)
    torch.testing.assert_close(ours.compute(), reference.compute())


def test_update_reads_nothing_on_the_host_and_all_nan_is_nan() -> None:
    mean = NanIgnoringMean()
    with HostReadCounter() as reads:
        mean.update(torch.tensor([float("nan"), float("nan")]), torch.tensor([1.0, 2.0]))
    assert reads.total == 0
    assert math.isnan(float(mean.compute()))


def test_an_epoch_without_any_x_prime_logs_nan_means_without_a_torchmetrics_warning(tmp_path) -> None:
    """An epoch whose module trains no x' (PES's first phase, DivideMix's warm-up: the module's
    lpa3_consumes_augmented) logs its means on every measured step without a value: NaN epoch
    values, and no torchmetrics "compute called before update" (it named no metric)."""
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lpa3_lightning import LPA3Callback
    from tests.callback.test_callback import TinyClassifier
    from tests.helpers import indexed_images

    class Consumes(TinyClassifier):
        def lpa3_consumes_augmented(self, epoch: int) -> bool:
            return epoch >= 1  # the module's own warm-up

    pl.seed_everything(0)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", callbacks=[LPA3Callback(ratio=0.5, steps=1, seed=0)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Consumes(), DataLoader(indexed_images(32), batch_size=16))
    assert not [w for w in caught if "before the ``update``" in str(w.message)]
    assert math.isnan(float(trainer.callback_metrics["lpa3/label_preserved_epoch"]))
