"""FixMatchEMA: parameters averaged, BatchNorm buffers copied from the live model (FixMatch's reference)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lpa3_lightning import FixMatchEMA
from tests.callback.test_lpa3_callback import TinyClassifier, _loader


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


def test_a_test_after_fit_on_a_checkpoint_tests_the_average_as_a_fresh_process_does(tmp_path):
    """``trainer.test(ckpt_path=...)`` after the fit (``lpa3 fit --test_after_fit``) ran on the checkpoint's raw
    weights (Lightning's WeightAveraging loads ``current_model_state`` into the module whenever its average
    exists), while ``lpa3 test`` on the same file in a new process ran on its ``state_dict``, the average: both
    test the average now, the weights the docs name."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    tested: list[dict[str, torch.Tensor]] = []

    class Weights(pl.Callback):
        def on_test_start(self, trainer, pl_module):
            tested.append({k: v.clone() for k, v in pl_module.state_dict().items()})

    class Tested(TinyClassifier):
        def test_step(self, batch, batch_idx):
            return None

    pl.seed_everything(0)
    module = Tested()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[FixMatchEMA(decay=0.5), checkpoint, Weights()])
    trainer.fit(module, _loader())
    trainer.test(module, _loader(shuffle=False), ckpt_path=checkpoint.best_model_path)
    saved = torch.load(checkpoint.best_model_path, weights_only=False)
    fresh = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, callbacks=[FixMatchEMA(decay=0.5), Weights()])
    fresh.test(Tested(), _loader(shuffle=False), ckpt_path=checkpoint.best_model_path)
    average, raw = saved["state_dict"], saved["current_model_state"]
    assert any(not torch.equal(average[k], raw[k]) for k in average)  # (the average is not the raw weights)
    for weights in tested:
        for name, value in average.items():
            assert torch.equal(weights[name], value), name
