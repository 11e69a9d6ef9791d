"""FixMatchEMA: parameters averaged, BatchNorm buffers copied from the live model (FixMatch's reference)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lpa3_lightning import FixMatchEMA
from tests.callback.test_callback import TinyClassifier, _loader


def _fit(ema: FixMatchEMA) -> tuple[TinyClassifier, FixMatchEMA]:
    pl.seed_everything(0)
    module = TinyClassifier()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[ema], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _loader())
    return module, ema


def _buffers_and_parameters(ema: FixMatchEMA, module: TinyClassifier):
    average = ema._average_model.module
    return (list(zip(average.buffers(), module.buffers())), list(zip(average.parameters(), module.parameters())))


def test_buffers_are_copied_and_parameters_averaged():
    ema = FixMatchEMA(decay=0.9)
    # stop before on_train_end, which copies the average into the live model
    ema.on_train_end = lambda trainer, pl_module: None
    live: list[list[torch.Tensor]] = []

    class Record(pl.Callback):  # the initial parameters, and the live ones after each optimizer step
        def on_fit_start(self, trainer, pl_module):
            live.append([p.detach().clone() for p in pl_module.parameters()])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            live.append([p.detach().clone() for p in pl_module.parameters()])

    pl.seed_everything(0)
    module = TinyClassifier()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[Record(), ema], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _loader())
    buffers, params = _buffers_and_parameters(ema, module)
    running = [(a, b) for a, b in buffers if a.is_floating_point()]
    assert running and all(torch.equal(a, b) for a, b in running)  # the live BN statistics
    # the average by hand, as the reference's ModelEMA: from the initial weights, each update is
    # 0.9 * average + 0.1 * live
    assert len(live) == 1 + 3
    for k, (average, _) in enumerate(params):
        expected = live[0][k]
        for step in live[1:]:
            expected = 0.9 * expected + 0.1 * step[k]
        torch.testing.assert_close(average, expected)


def test_lightnings_averaged_buffers_with_copy_buffers_false():
    ema = FixMatchEMA(decay=0.9, copy_buffers=False)
    ema.on_train_end = lambda trainer, pl_module: None
    module, _ = _fit(ema)
    buffers, _ = _buffers_and_parameters(ema, module)
    running = [(a, b) for a, b in buffers if a.is_floating_point()]
    assert any(not torch.equal(a, b) for a, b in running)  # averaged, so behind the live statistics


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="copy_buffers"):
        FixMatchEMA(copy_buffers="yes")
    with pytest.raises(ValueError, match="use_buffers"):
        FixMatchEMA(use_buffers=True)
