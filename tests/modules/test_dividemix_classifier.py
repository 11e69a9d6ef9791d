"""The ready DivideMix module: fits with one callback for two networks, x' checked independently, resume."""

from __future__ import annotations

import copy
import warnings
from dataclasses import fields
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lpa3_lightning import DivideMixClassifier, LPA3Callback
from lpa3_lightning.data import train_loader
from lpa3_lightning.mixins import DivideMixSettings
from tests.helpers import GlobalRandomState, independent_logp_drop, indexed_images, lpa3_state
from tests.methods.test_pes import NUM_CLASSES, NoisyTwoViews

N = 48


class Recording(DivideMixClassifier):
    """Records, before each step, each network's x' and what an independent check of them needs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict[str, Any]] = []
        self.parts: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x1, x2, _, idx = batch
        for name in self.lpa3_networks():
            augmented = self._lpa3_slot("augmented", name)
            if augmented is not None and len(augmented):
                own, other = self.dividemix_model(name), self.dividemix_model(self.dividemix_other(name))
                self.records.append({"network": name, "model": copy.deepcopy(own),
                                     "x": augmented.verified.reference_inputs.clone(), "x_adv": augmented.inputs.clone(),
                                     "y": augmented.targets.clone(),
                                     "guess": _independent_guess(own, other, x1, x2, idx, augmented,
                                                                 self.dividemix_clean_probability(
                                                                     self.dividemix_other(name)))})
        loss = super().training_step(batch, batch_idx)
        self.parts.append({k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("train/")})
        return loss


def _independent_guess(own, other, x1, x2, idx, augmented, w_other) -> torch.Tensor:
    """The co-guessed label of each x' row, recomputed from copies of both networks: the mean of
    both networks' softmax over both views (own network on the unlabeled rows' batch statistics,
    the other in eval mode), sharpened (argmax unchanged), argmax."""
    unlabeled = w_other.to(idx.device)[idx] <= 0.5
    u = torch.cat([x1[unlabeled], x2[unlabeled]])
    n = int(unlabeled.sum())
    with torch.no_grad():
        p_own = copy.deepcopy(own).train()(u).softmax(1)
        p_other = copy.deepcopy(other).eval()(u).softmax(1)
    mean = (p_own[:n] + p_own[n:] + p_other[:n] + p_other[n:]) / 4
    return mean.argmax(1)[augmented.mask]


def _module(cls=DivideMixClassifier, **kwargs: Any) -> DivideMixClassifier:
    """The module on the synthetic set; a keyword that names a DivideMixSettings field goes there."""
    torch.manual_seed(0)
    names = {f.name for f in fields(DivideMixSettings)}
    settings = {"warmup_epochs": 1, "lambda_u": 5.0, "rampup_epochs": 1.0,
                **{k: v for k, v in kwargs.items() if k in names}}
    arguments = {k: v for k, v in kwargs.items() if k not in names}
    return cls(**{"num_classes": NUM_CLASSES, "num_samples": N, "dividemix": DivideMixSettings(**settings),
                  **arguments})


def _trainer(epochs: int, callbacks: list, tmp_path, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=callbacks, num_sanity_val_steps=0, **kwargs)


def _data() -> DataLoader:
    return DataLoader(NoisyTwoViews(N), batch_size=16, shuffle=True)


def test_one_callback_serves_both_networks_and_each_x_prime_keeps_its_guessed_label_as_trained(tmp_path):
    pl.seed_everything(0)
    module = _module(Recording)
    callback = LPA3Callback(ratio=0.9, sigma=0.02, steps=2, warmup_epochs=1, seed=0)
    trainer = _trainer(3, [callback], tmp_path)
    trainer.fit(module, _data())
    assert list(callback.networks) == ["net1", "net2"]
    memories = [c.tcs for c in callback.networks.values()]
    assert all(bool(m.seen.all()) for m in memories)  # every sample recorded by each network
    assert not torch.equal(memories[0].memory, memories[1].memory)  # two memories, not one shared
    by_network = {name: [r for r in module.records if r["network"] == name] for name in ("net1", "net2")}
    assert all(by_network.values()), {k: len(v) for k, v in by_network.items()}
    for r in module.records:  # the constraint in the forward that trains the unmixed x', per network
        assert torch.equal(r["y"], r["guess"]), r["network"]  # the preserved label is the co-guess's argmax
        drop = independent_logp_drop(r["model"], r["x"], r["x_adv"], r["guess"], twin_bn=True)
        assert bool((drop <= 0.02 + 1e-5).all()), (r["network"], drop.max())
    semi = [p for p in module.parts if p.get("train/net1/unlabeled_weight", 0.0) > 0]
    assert any(p["train/net1/loss_lpa3"] > 0 for p in semi) and any(p["train/net2/loss_lpa3"] > 0 for p in semi)
    for name in ("net1", "net2"):  # per-network logs
        assert float(trainer.callback_metrics[f"lpa3/{name}/label_preserved_epoch"]) == pytest.approx(1.0)
        assert f"lpa3/{name}/threshold" in trainer.callback_metrics


@pytest.mark.parametrize("stratified_split", [False, True])
def test_resume_continues_both_memories_and_the_split_as_an_uninterrupted_run(tmp_path, stratified_split):
    """With ``stratified_split`` the checkpoint also carries the first split's count (that loading
    it restores the count is checked in the mixin's tests, where a later GMM's count differs)."""

    def fit(epochs: int, ckpt_path=None, checkpoint_dir=None):
        pl.seed_everything(0)
        module = _module(stratified_split=stratified_split)
        callback = LPA3Callback(ratio=0.5, steps=1, warmup_epochs=1, seed=0)
        # mixup draws from torch's global generator, which the run keeps itself (the callback never does)
        callbacks: list = [callback, GlobalRandomState()]
        if checkpoint_dir is not None:
            callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1,
                                                          every_n_epochs=1))
        trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks,
                             num_sanity_val_steps=0, enable_checkpointing=checkpoint_dir is not None)
        # a loader whose order is a function of the epoch (a plain shuffled loader draws its order
        # from the global generator)
        trainer.fit(module, train_loader(NoisyTwoViews(N), batch_size=16, seed=0),
                    ckpt_path=ckpt_path)
        return module, callback

    whole, whole_cb = fit(3, checkpoint_dir=tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / "epoch=1-step=6.ckpt", weights_only=False)
    assert all(lpa3_state(saved, name)["tcs"] is not None for name in ("net1", "net2"))
    resumed, resumed_cb = fit(3, ckpt_path=tmp_path / "ckpt" / "epoch=1-step=6.ckpt")  # epoch 2 after a resume
    for name in ("net1", "net2"):
        a, b = whole_cb.networks[name].tcs.state_dict(), resumed_cb.networks[name].tcs.state_dict()
        for key in ("memory", "scores", "seen", "threshold"):
            assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5, equal_nan=True), (name, key)
        assert torch.equal(whole.dividemix_clean_probability(name), resumed.dividemix_clean_probability(name))
    if stratified_split:
        assert set(whole._dm_state()["stratified_count"]) == {"net1", "net2"}  # a count was fixed for each
        assert resumed._dm_state()["stratified_count"] == whole._dm_state()["stratified_count"]
        assert saved["dividemix_split"]["stratified_count"] == whole._dm_state()["stratified_count"]
    for key, value in whole.state_dict().items():
        assert torch.allclose(value.float(), resumed.state_dict()[key].float(), atol=1e-5), key


def test_a_single_network_checkpoint_is_refused_with_the_fix(tmp_path):
    callback = LPA3Callback()
    module = _module()
    trainer = _trainer(1, [callback], tmp_path)
    callback.setup(trainer, module, "fit")
    single = LPA3Callback()
    with pytest.raises(ValueError, match="state for one network"):
        callback.load_state_dict(single.state_dict())


def test_without_the_callback_it_is_plain_dividemix_predicting_with_both_networks(tmp_path):
    pl.seed_everything(0)
    module = _module()
    trainer = _trainer(2, [], tmp_path)
    val = DataLoader(indexed_images(12), batch_size=12)
    trainer.fit(module, _data(), val)
    x_val, y_val, _ = next(iter(val))  # the logged accuracy against the final weights' own (both networks)
    module.eval()
    with torch.no_grad():
        accuracy = float(((module.net1(x_val) + module.net2(x_val)).argmax(1) == y_val).float().mean())
    assert float(trainer.callback_metrics["val/acc"]) == pytest.approx(accuracy)
    assert float(trainer.callback_metrics["train/net1/loss_lpa3"]) == 0.0
    x = indexed_images(4)[0][0][None]
    module.eval()
    assert torch.allclose(module(x), module.net1(x) + module.net2(x))


def test_split_losses_on_augmented_views_are_warned_about_once(tmp_path):
    """A plain training loader has no evaluation view: the split then sees augmented images."""
    with pytest.warns(UserWarning, match="train_eval_dataset") as caught:
        _trainer(3, [], tmp_path, limit_train_batches=1).fit(_module(), _data())  # two semi epochs
    assert sum("train_eval_dataset" in str(w.message) for w in caught) == 1


def test_a_callback_without_a_warmup_solves_nothing_in_dividemixs_warmup(tmp_path, monkeypatch):
    """No x' is trained in DivideMix's warm-up, so the callback (warmup_epochs=0) solves none there
    (the module's lpa3_consumes_augmented) and needs no warning; it solves from the semi phase on."""
    solve = __import__("lpa3_lightning.callback.hard_positives", fromlist=["solve"]).solve
    solved_in: list[int] = []
    module = _module()

    def counted(*args, **kwargs):
        solved_in.append(module.current_epoch)
        return solve(*args, **kwargs)

    monkeypatch.setattr("lpa3_lightning.callback.hard_positives.solve", counted)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*warmup_epochs.*")
        _trainer(2, [LPA3Callback(ratio=1.0, steps=1, warmup_epochs=0)], tmp_path, limit_train_batches=2).fit(
            module, _data())
    assert solved_in and min(solved_in) == 1  # epoch 0 is DivideMix's warm-up (warmup_epochs=1)


@pytest.mark.parametrize("kwargs, match", [
    ({"dividemix": {"threshold": 1.0}}, "`dividemix.threshold`"),
    ({"dividemix": {"lambda_u": -1}}, "`dividemix.lambda_u`"),
    ({"dividemix": {"loss_history": 0}}, "`dividemix.loss_history`"),
    ({"dividemix": {"warmup_epochs": -1}}, "`dividemix.warmup_epochs`"),
    ({"dividemix": {"prior_weight": -1.0}}, "`dividemix.prior_weight`"),
    ({"num_classes": 2, "dividemix": {"class_prior": [0.3, 0.3]}}, "`dividemix.class_prior` must hold"),
    ({"num_classes": 2, "dividemix": {"class_prior": [0.2, 0.3, 0.5]}},
     "`dividemix.class_prior` holds 3 class frequencies for num_classes=2"),
    ({"dividemix": {"seed": -1}}, "`dividemix.seed`"), ({"dividemix": {"seed": 1.5}}, "`dividemix.seed`"),
    ({"lr": 0.0}, "`lr`"), ({"num_samples": 1}, "`num_samples`")])
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DivideMixClassifier(**kwargs)


def test_the_settings_argument_takes_the_dataclass_or_its_fields_and_refuses_a_typo():
    module = DivideMixClassifier(num_samples=N, dividemix={"warmup_epochs": 3, "class_prior": [0.1] * 10})
    assert module.lpa3_settings == DivideMixSettings(warmup_epochs=3, class_prior=(0.1,) * 10)
    assert module.hparams["dividemix"]["warmup_epochs"] == 3  # the effective fields, a plain mapping
    assert DivideMixClassifier().lpa3_settings == DivideMixSettings()  # None: the defaults
    with pytest.raises(TypeError, match=r"`dividemix` has no setting `lamda_u`: did you mean `lambda_u`"):
        DivideMixClassifier(dividemix={"lamda_u": 1.0})


def test_a_zero_weight_for_x_prime_is_refused_when_the_callback_attacks(tmp_path):
    trainer = _trainer(1, [LPA3Callback(steps=1, warmup_epochs=1)], tmp_path, limit_train_batches=1)
    with pytest.raises(ValueError, match=r"\(dividemix.lambda_u=0 and dividemix.lpa3_weight=None\)"):
        trainer.fit(_module(lambda_u=0.0), _data())
    trainer = _trainer(1, [LPA3Callback(steps=1, warmup_epochs=1)], tmp_path, limit_train_batches=1)
    with pytest.raises(ValueError, match=r"\(dividemix.lpa3_weight=0\)"):  # the reason given is the one that applies
        trainer.fit(_module(lpa3_weight=0.0), _data())


def test_the_callback_solves_nothing_in_the_warm_up(monkeypatch, tmp_path):
    """DivideMix trains x' after its warm-up only: no solve before, whatever the callback's own warm-up."""
    solve = __import__("lpa3_lightning.callback.hard_positives", fromlist=["solve"]).solve
    epochs: list[int] = []
    module = _module(warmup_epochs=1)

    def counted(*args, **kwargs):
        epochs.append(module.trainer.current_epoch)
        return solve(*args, **kwargs)

    monkeypatch.setattr("lpa3_lightning.callback.hard_positives.solve", counted)
    _trainer(2, [LPA3Callback(ratio=1.0, steps=1, seed=0, warmup_epochs=0)], tmp_path).fit(module, _data())
    assert epochs and set(epochs) == {1}


def test_the_off_switch_fits_dividemix_without_touching_its_networks(tmp_path):
    """augment='off' builds no network view: on_fit_start must not ask a two-network module for lpa3_model()."""
    module = _module()
    _trainer(1, [LPA3Callback(augment="off")], tmp_path, limit_train_batches=1).fit(module, _data())
    assert module.trainer.global_step > 0
