"""The callback's logs and console (lpa3_lightning.callback.logging): per step only what exists in the step,
per epoch over all steps (NanIgnoringMean: MeanMetric(nan_strategy="ignore")'s value without its host read),
the barely-moved warning, and what the console says (the phase when it changes, the x' and the solver's share
of the step on the progress bar, a summary of what LP-A3 did and cost at the end)."""

from __future__ import annotations

import csv
import logging
import math
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torchmetrics import MeanMetric

from lpa3_lightning import LPA3Callback
from lpa3_lightning.callback.hard_positives import HardPositives
from lpa3_lightning.callback.logging import EpochLog, NanIgnoringMean
from lpa3_lightning.core.solver import AttackStats
from lpa3_lightning.methods.base import AugmentedBatch
from tests.callback.test_lpa3_callback import TinyClassifier, _loader, _trainer
from tests.helpers import HostReadCounter

PER_X_PRIME = ("lpa3/label_preserved_step", "lpa3/projected_step", "lpa3/perceptual_distance_step")


def _rows(trainer: pl.Trainer) -> list[dict[str, str]]:
    with open(f"{trainer.logger.log_dir}/metrics.csv") as handle:
        return list(csv.DictReader(handle))


def test_a_step_without_x_prime_logs_no_quantity_of_an_x_prime(tmp_path):
    pl.seed_everything(0)
    # a small share: some batches select nothing (or a lone row, which waits), others several
    callback = LPA3Callback(ratio=0.1, steps=1, seed=0)
    trainer = _trainer(tmp_path, [callback], max_epochs=4)
    trainer.fit(TinyClassifier(), _loader(48, 8))
    rows = [r for r in _rows(trainer) if r.get("lpa3/selected_fraction_step")]
    empty = [r for r in rows if float(r["lpa3/selected_fraction_step"]) == 0.0]
    full = [r for r in rows if float(r["lpa3/selected_fraction_step"]) > 0.0]
    assert empty and full  # the run has both kinds of step
    for row in empty:
        for key in PER_X_PRIME:
            assert row[key] == "" or math.isnan(float(row[key])), (row["step"], key, row[key])
    for row in full:
        assert row["lpa3/perceptual_distance_step"] not in ("", "nan")


class _Logs:
    """A module's ``log`` and ``device``, for the epoch log alone."""

    device = torch.device("cpu")

    def log(self, *args, **kwargs) -> None:
        pass


def _solved(distances: list[float], projected: list[bool]) -> HardPositives:
    n = len(distances)
    stats = AttackStats(perceptual_distance=torch.tensor(distances), logp_drop=torch.zeros(n),
                        preserved=torch.ones(n, dtype=torch.bool), projected=torch.tensor(projected),
                        l2=torch.zeros(n))
    return HardPositives(AugmentedBatch(inputs=torch.zeros(n, 1), targets=torch.zeros(n, dtype=torch.long),
                                        indices=torch.arange(n), mask=torch.ones(n, dtype=torch.bool)), stats=stats)


def test_x_prime_that_barely_move_warn_once_an_epoch_with_the_cause():
    """More than half of an epoch's solved x' within 1e-3 of x in feature space (or NaN: x' given
    back as x): one warning that epoch, naming the share, the bisection's part and sigma."""
    log = EpochLog("lpa3/", LPA3Callback().resolve(pl.Trainer(logger=False, accelerator="cpu")))
    log.to(torch.device("cpu"))
    for epoch in range(2):
        log.count_moves(_solved([1e-5, 2e-4, float("nan"), 0.5], [True, True, False, False]))
        log.count_moves(_solved([1e-6, 0.3], [True, False]))
        with pytest.warns(UserWarning, match=r"67% of this epoch's 6 x' barely moved.*75% of those were pulled back.*"
                                             r"sigma=0.02.*'batch'"):
            log.epoch_end(_Logs(), 0, None, 0.02, "batch")
    log.count_moves(_solved([1e-5, 0.5, 0.4], [True, False, False]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log.epoch_end(_Logs(), 0, None, 0.02, "batch")  # a third that barely moved: no warning


def test_x_prime_that_move_do_not_warn(tmp_path, recwarn):
    pl.seed_everything(0)
    callback = LPA3Callback(ratio=1.0, sigma=0.02, steps=2, seed=0)
    _trainer(tmp_path, [callback], max_epochs=1).fit(TinyClassifier(), _loader())
    assert not [w for w in recwarn if "barely moved" in str(w.message)]


def test_a_fit_stopped_mid_epoch_keeps_the_last_passs_threshold_and_logs_no_other(tmp_path):
    """max_steps=4 with 3 batches an epoch: Lightning ends the fit after epoch 1's first batch and
    runs that epoch's on_train_epoch_end. Its pass is not over: the threshold stays epoch 0's (a
    resume continues the pass with it), and no second lpa3/threshold is logged."""
    from torch.utils.data import DataLoader

    from tests.helpers import indexed_images

    class Thresholds(LPA3Callback):
        seen: list = []

        def on_train_epoch_end(self, trainer, pl_module):
            super().on_train_epoch_end(trainer, pl_module)
            self.seen.append(float(self.runner().tcs.threshold))

    pl.seed_everything(0)
    callback = Thresholds(ratio=0.5, steps=1, seed=0, input_range=None)
    callback.seen = []
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, callbacks=[callback],
                         logger=pl.loggers.CSVLogger(tmp_path, name="", version=0), log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyClassifier(), DataLoader(indexed_images(48), batch_size=16))
    assert trainer.global_step == 4 and len(callback.seen) == 2
    assert callback.seen[1] == callback.seen[0]
    with open(tmp_path / "version_0" / "metrics.csv") as f:
        logged = [row["lpa3/threshold"] for row in csv.DictReader(f) if row.get("lpa3/threshold")]
    assert len(logged) == 1, logged


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
    from tests.callback.test_lpa3_callback import TinyClassifier
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


class Counts(LPA3Callback):
    """Counts the x' handed to the module, independently of the callback's own tally."""

    handed = 0

    def on_augmented(self, trainer, pl_module, augmented):
        type(self).handed += len(augmented)


def test_the_console_names_the_phase_shows_the_cost_and_sums_up(tmp_path, caplog):
    pl.seed_everything(0)
    Counts.handed = 0
    callback = Counts(ratio=0.5, sigma=0.02, steps=2, seed=0, warmup_epochs=1)
    bars: list[dict] = []

    class Bar(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            bars.append(dict(trainer.progress_bar_metrics))

    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=3, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, callbacks=[callback, Bar()])
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(TinyClassifier(), _loader())
    text = caplog.text
    assert "LPA3Callback: epoch 0: warm-up, no x' (the TCS memory learns the rows)" in text
    assert "LPA3Callback: epoch 1: LP-A3 starts" in text
    assert text.count("LP-A3 starts:") == 1  # (said once, when the phase changes)
    # the bar: nothing in the warm-up, then the x' of the step and the LP-A3 share of its time
    assert "lpa3_x'" not in bars[0] and "lpa3_x'" in bars[-1] and "lpa3_time" in bars[-1]
    summary = re.search(r"LPA3Callback: 3 epochs, LP-A3 in 2 \(from epoch 1\); ([\d,]+) x' trained .*; "
                        r"LP-A3 took ([\d.]+)% of the training steps' time", text)
    assert summary is not None, text[-2000:]
    assert int(summary.group(1).replace(",", "")) == Counts.handed > 0
    assert 0 < float(summary.group(2)) < 100
