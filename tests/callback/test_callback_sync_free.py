"""LPA3Callback(sync_free=True): one host read per LP-A3 step, and the default path's results.

On a GPU every host read of a device value is a synchronisation; these tests count them on the
CPU (where they happen at the same places) with an independent counter that patches torch.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lpa3_lightning import LPA3Callback
from lpa3_lightning.core.host_reads import HostReadCounter
from tests.callback.test_callback import TinyClassifier, _loader


class CountOneStep(Callback):
    """Counts host reads from the first callback hook of one step to the last (register the
    ``opener`` first and ``self`` last, so the window spans every other callback's hooks and
    ``training_step``)."""

    def __init__(self, epoch: int = 1, batch_idx: int = 1) -> None:
        self.epoch, self.batch_idx = epoch, batch_idx
        self.counter = HostReadCounter()
        outer = self

        class Opener(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if (trainer.current_epoch, batch_idx) == (outer.epoch, outer.batch_idx):
                    outer.counter.__enter__()

        self.opener = Opener()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch_idx):
            self.counter.__exit__()


def _fit(callbacks: list[Callback], max_epochs: int = 2, module: TinyClassifier | None = None,
         loader=None) -> tuple[TinyClassifier, pl.Trainer]:
    pl.seed_everything(0)
    module = module or TinyClassifier()
    trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, loader or _loader())
    return module, trainer


def _reads(sync_free: bool | str | None) -> HostReadCounter:
    count = CountOneStep()
    middle = [] if sync_free is None else [LPA3Callback(ratio=0.5, steps=3, seed=0, input_range=(-3.0, 3.0),
                                                        runtime={"sync_free": sync_free})]
    module, _ = _fit([count.opener, *middle, count])
    if sync_free is not None:
        assert module.seen_augmented[4] > 1  # the counted step did solve and train on x'
    return count.counter


def test_an_lp_a3_step_makes_at_most_one_host_read_more_than_the_plain_step():
    plain, default, sync_free = _reads(None), _reads(False), _reads(True)
    print(f"host reads in one step: plain {plain.total}, LP-A3 default path {default.total}, "
          f"LP-A3 sync-free {sync_free.total}")
    assert default.total - plain.total > 20  # the counter does see the default path's reads
    assert sync_free.total - plain.total <= 1, dict(sync_free.sites)
    package_sites = {site: n for site, n in sync_free.sites.items() if site != "(outside)"}
    assert sum(package_sites.values()) == 1, package_sites


def test_sync_free_training_equals_the_default_path():
    """Same seed, same data: the model, the TCS memory and the threshold after three epochs."""
    runs = {}
    for sync_free in (False, True):
        callback = LPA3Callback(ratio=0.5, steps=3, seed=0, input_range=(-3.0, 3.0), runtime={"sync_free": sync_free})
        module, trainer = _fit([callback], max_epochs=3)
        runs[sync_free] = (module, callback, trainer)
    (m0, c0, t0), (m1, c1, t1) = runs[False], runs[True]
    assert m0.seen_augmented == m1.seen_augmented and sum(m1.seen_augmented) > 0
    for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters()):
        torch.testing.assert_close(p1, p0, msg=name)
    torch.testing.assert_close(c1.runner().tcs.scores, c0.runner().tcs.scores)
    torch.testing.assert_close(c1.runner().tcs.memory, c0.runner().tcs.memory)
    assert torch.equal(c1.runner().tcs.seen, c0.runner().tcs.seen)
    torch.testing.assert_close(c1.runner().tcs.threshold, c0.runner().tcs.threshold)
    assert float(t0.callback_metrics["lpa3/projected_epoch"]) > 0  # the bisections had work to do
    for key in ("lpa3/label_preserved_epoch", "lpa3/projected_epoch", "lpa3/perceptual_distance_epoch"):
        torch.testing.assert_close(t1.callback_metrics[key], t0.callback_metrics[key], msg=key)
    assert "lpa3/solver_seconds_epoch" in t0.callback_metrics
    assert "lpa3/solver_seconds_epoch" not in t1.callback_metrics  # not timed: that would synchronise


def test_auto_keeps_the_default_path_on_the_cpu():
    """sync_free='auto' on the CPU reads the host as the default path does (the sync-free path: once)."""
    plain, auto = _reads(None), _reads("auto")
    assert auto.total - plain.total > 20
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
    _, trainer = _fit([callback], max_epochs=1)
    assert "lpa3/solver_seconds_epoch" in trainer.callback_metrics  # timed: the default path


def test_out_of_range_recorded_indices_get_a_named_error():
    class RecordsWrongIndices(TinyClassifier):
        def lpa3_record_predictions(self, indices, logits, targets=None, network=None):
            super().lpa3_record_predictions(indices + 100, logits, targets, network)

    callback = LPA3Callback(ratio=0.5, steps=1, seed=0, runtime={"sync_free": True})
    with pytest.raises(ValueError, match="recorded with `lpa3_record_predictions` were outside the training set"):
        _fit([callback], max_epochs=1, module=RecordsWrongIndices())
    assert not bool(callback.runner().tcs.seen.any())  # none of them was applied to the memory


@pytest.mark.parametrize("regenerate", [1, 3])
def test_a_bad_input_range_is_refused_on_the_sync_free_path(tmp_path, regenerate):
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0, input_range=(1.0, -1.0),
                            cache={"regenerate_every_n_epochs": regenerate, "dir": str(tmp_path)},
                            runtime={"sync_free": True})
    with pytest.raises(ValueError, match="low <= high"):
        _fit([callback], max_epochs=1)


def test_sync_free_is_validated():
    with pytest.raises(ValueError, match="sync_free"):
        LPA3Callback(runtime={"sync_free": "yes"})


def test_cuda_graphs_on_the_cpu_trains_as_the_sync_free_path():
    """cuda_graphs=True on the CPU solves the padded rows eagerly: the padding (bucket of 8 rows)
    and the graph buffers must leave training as the unpadded sync-free path leaves it."""
    runs = {}
    for graphs in (False, True):
        count = CountOneStep()
        callback = LPA3Callback(ratio=0.5, steps=3, seed=0, input_range=(-3.0, 3.0),
                                runtime={"sync_free": True, "cuda_graphs": graphs},
                                logging={"every_n_steps": 1})  # every step in the epoch means compared below
        module, trainer = _fit([count.opener, callback, count], max_epochs=3)
        runs[graphs] = (module, callback, trainer, count.counter)
    (m0, c0, t0, _), (m1, c1, t1, reads) = runs[False], runs[True]
    assert c0.runner().solver_graphs is None and c1.runner().solver_graphs is not None
    assert len(c1.runner().solver_graphs._entries) == 0  # released at the end of the fit
    assert m0.seen_augmented == m1.seen_augmented and sum(m1.seen_augmented) > 0
    assert any(n % 8 for n in m1.seen_augmented if n)  # some steps did solve padded rows
    # float32 forwards of 8 rows and of n rows round differently (~1e-7); after three epochs the
    # weights differ by up to ~1e-3 of their size (measured: 1.2e-4 at most); a padding that
    # changed the solve moved x' by 0.2, far beyond this
    for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters()):
        torch.testing.assert_close(p1, p0, rtol=1e-3, atol=3e-4, msg=name)
    for key in ("lpa3/label_preserved_epoch", "lpa3/projected_epoch", "lpa3/perceptual_distance_epoch"):
        torch.testing.assert_close(t1.callback_metrics[key], t0.callback_metrics[key], rtol=1e-3, atol=0, msg=key)
    package_sites = {site: n for site, n in reads.sites.items() if site != "(outside)"}
    assert sum(package_sites.values()) == 1, package_sites  # the graph path adds no host read


def test_cuda_graphs_is_validated():
    with pytest.raises(ValueError, match="`runtime.cuda_graphs` must be True or False"):
        LPA3Callback(runtime={"cuda_graphs": "yes"})
    with pytest.raises(ValueError, match="`runtime.cuda_graphs=True` needs the sync-free path.*Fix"):
        LPA3Callback(runtime={"cuda_graphs": True, "sync_free": False})
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0, runtime={"cuda_graphs": True})  # sync_free="auto": off on the CPU
    with pytest.raises(ValueError, match="`runtime.cuda_graphs=True` needs the sync-free path.*CPU.*Fix"):
        _fit([callback], max_epochs=1)
