"""What the console says about LP-A3 during a fit: the phase when it changes, the x' and the solver's share
of the step on the progress bar, and a summary of what LP-A3 did and cost at the end."""

from __future__ import annotations

import logging
import re

import lightning.pytorch as pl

from lpa3_lightning import LPA3Callback
from tests.callback.test_callback import TinyClassifier, _loader


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
