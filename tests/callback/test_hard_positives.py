"""The callback's ``augment`` switch: the two controls (``"null"``, ``"noise"``) train exactly the rows,
labels and weights LP-A3 would, without the solver; ``"off"`` spends nothing and changes nothing."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import lpa3_lightning.callback.hard_positives as hard_positives
from lpa3_lightning import LPA3Callback
from lpa3_lightning.core.dual_bn import use_twin_bn
from tests.callback.test_lpa3_callback import TinyClassifier, _loader, _trainer
from tests.helpers import snapshot
from tests.methods.test_fixmatch import UserFixMatch, _loaders


class Records(LPA3Callback):
    """Keeps every hand-over (what the module's loss receives) and the clean rows it came from."""

    def on_augmented(self, trainer, pl_module, augmented):
        self.handed.append(copy.copy(augmented))

    handed: list = []


def _first_step(tmp_path, augment: str, **kwargs):
    """One training step of the supervised module from the same weights and batch, with ``augment``."""
    pl.seed_everything(0)
    module = TinyClassifier()
    callback = Records(ratio=0.5, sigma=0.02, steps=2, seed=0, augment=augment, **kwargs)
    callback.handed = []
    clean: list[torch.Tensor] = []

    class KeepsBatch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clean.append(batch[0].clone())

    trainer = _trainer(tmp_path / augment, [KeepsBatch(), callback], max_epochs=1, limit_train_batches=1,
                       enable_checkpointing=False)
    trainer.fit(module, _loader(shuffle=False))
    (augmented,) = callback.handed
    return augmented, clean[0], module, trainer


@pytest.mark.parametrize("augment", ["null", "noise"])
def test_a_control_trains_the_rows_labels_and_weights_lp_a3_would(tmp_path, augment):
    lpa3, x, _, _ = _first_step(tmp_path, "lpa3")
    control, x_again, module, trainer = _first_step(tmp_path, augment, **({"noise_norm": 0.7} if augment == "noise" else {}))
    assert torch.equal(x, x_again)
    for field in ("mask", "targets", "indices"):
        assert torch.equal(getattr(control, field), getattr(lpa3, field)), field
    assert control.skipped == lpa3.skipped and control.verified.bn_mode == lpa3.verified.bn_mode == "twin"
    rows = x[control.mask]
    assert len(rows) >= 2
    assert not torch.allclose(lpa3.inputs, rows)  # the solver moved them
    moved = (control.inputs - rows).flatten(1).norm(dim=1)
    if augment == "null":
        assert torch.equal(control.inputs, rows)
    else:  # (the box of this data module: none, so no clamp)
        torch.testing.assert_close(moved, torch.full_like(moved, 0.7))
    logged = float(trainer.callback_metrics["lpa3/input_distance_step"])
    assert logged == pytest.approx(float(moved.mean()), abs=1e-6)


def test_the_null_controls_term_is_the_cross_entropy_of_the_unchanged_rows_in_the_twins(tmp_path):
    """An independent forward: x' = x through the twins, normalised by those rows' own batch statistics
    (the verified forward's reference-batch normalisation with x' = x), dropout off."""
    pl.seed_everything(0)
    module = TinyClassifier()
    callback = LPA3Callback(ratio=0.5, sigma=0.02, steps=2, seed=0, augment="null")
    seen: dict = {}
    original = module.lpa3_supervised_loss

    def recording(batch):
        augmented = module._lpa3_slot("augmented", None)
        seen["before"] = copy.deepcopy(module.model)
        seen["rows"], seen["targets"] = augmented.inputs.clone(), augmented.targets.clone()
        loss, logits, parts = original(batch)
        seen["loss_aug"] = parts["loss_aug"]
        return loss, logits, parts

    module.lpa3_supervised_loss = recording
    trainer = _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=1, enable_checkpointing=False)
    trainer.fit(module, _loader(shuffle=False))
    net = seen["before"]
    net.train()
    for m in net.modules():
        if isinstance(m, torch.nn.Dropout):
            m.eval()
    with torch.no_grad(), use_twin_bn(net, track_running_stats=False):
        expected = F.cross_entropy(net(seen["rows"]), seen["targets"])
    torch.testing.assert_close(seen["loss_aug"], expected, rtol=1e-5, atol=1e-6)


def test_noise_stays_inside_the_input_box_at_its_norm(tmp_path):
    """The images lie in [-4, 4]; noise of norm 40 leaves the box on many pixels, so the clamp would
    shorten it: each row still ends 40 from its x, inside the box."""
    augmented, x, _, _ = _first_step(tmp_path, "noise", noise_norm=40.0, input_range=(-4.0, 4.0))
    assert float(x.abs().max()) <= 4.0
    assert float(augmented.inputs.min()) >= -4.0 and float(augmented.inputs.max()) <= 4.0
    at_edge = ((augmented.inputs == 4.0) | (augmented.inputs == -4.0)).float().mean()
    assert float(at_edge) > 0.01  # (the box did clip)
    moved = (augmented.inputs - x[augmented.mask]).flatten(1).norm(dim=1)
    torch.testing.assert_close(moved, torch.full_like(moved, 40.0), rtol=1e-4, atol=0)


@pytest.mark.parametrize("augment", ["null", "noise"])
def test_a_control_never_runs_the_solver(tmp_path, monkeypatch, augment):
    def refuse(*args, **kwargs):
        raise AssertionError("the solver ran")

    monkeypatch.setattr(hard_positives, "solve", refuse)
    augmented, _, _, trainer = _first_step(tmp_path, augment, **({"noise_norm": 0.5} if augment == "noise" else {}))
    (callback,) = [c for c in trainer.callbacks if isinstance(c, Records)]
    assert len(augmented) >= 2 and callback.runner().last.stats is None


def test_fixmatch_controls_weigh_the_same_rows_as_lp_a3(tmp_path):
    """FixMatch's term: the rows solved (train_mask), their pseudo-labels, the confidence mask and the
    denominator (kept rate, number of x') are the same under LP-A3 and the controls on the first step."""
    parts = {}
    handed = {}
    for augment in ("lpa3", "null", "noise"):
        pl.seed_everything(0)
        module = UserFixMatch(num_unlabeled=64, loss_warmup=0, confidence=0.4)
        callback = Records(ratio=0.5, sigma=0.02, steps=2, seed=0, input_range=None, augment=augment,
                           noise_norm=0.5 if augment == "noise" else None)
        callback.handed = []
        _trainer(tmp_path, [callback], max_epochs=1, limit_train_batches=1).fit(module, _loaders())
        parts[augment], handed[augment] = module.parts[0], callback.handed[0]
    for augment in ("null", "noise"):
        for field in ("mask", "targets", "indices"):
            assert torch.equal(getattr(handed[augment], field), getattr(handed["lpa3"], field))
        assert handed[augment].skipped == handed["lpa3"].skipped
        for key in ("num_augmented", "lpa3_kept_rate", "mask_rate", "loss_labeled", "loss_unlabeled"):
            assert parts[augment][key] == pytest.approx(parts["lpa3"][key]), key
    assert parts["lpa3"]["num_augmented"] >= 2


# ------------------------------------------------------------------ off
def test_off_is_the_fit_without_the_callback_and_spends_no_forward(tmp_path):
    """Bitwise the same weights as no callback at all, no request and no extra forward of the network."""
    weights, forwards = {}, {}
    for name in ("none", "off"):
        pl.seed_everything(0)
        module = UserFixMatch(num_unlabeled=64, loss_warmup=0, confidence=0.4)
        calls = {"forward": 0, "request": 0}
        module.net.register_forward_hook(lambda *_: calls.__setitem__("forward", calls["forward"] + 1))
        request = module.lpa3_request

        def counted(batch, request=request, calls=calls):
            calls["request"] += 1
            return request(batch)

        module.lpa3_request = counted
        callbacks = [LPA3Callback(ratio=0.5, sigma=0.02, steps=2, seed=0, augment="off")] if name == "off" else []
        _trainer(tmp_path, callbacks, max_epochs=2).fit(module, _loaders())
        weights[name], forwards[name] = snapshot(module.net), calls
    assert forwards["off"] == forwards["none"] and forwards["off"]["request"] == 0
    assert forwards["none"]["forward"] == 8  # one joint forward a step (4 steps an epoch)
    for key, value in weights["none"].items():
        assert torch.equal(value, weights["off"][key]), key


def test_a_checkpoint_loads_with_lp_a3_on_or_off(tmp_path):
    pl.seed_everything(0)
    on = LPA3Callback(ratio=0.5, sigma=0.02, steps=2, seed=0)
    trainer = _trainer(tmp_path / "on", [on], max_epochs=1, limit_train_batches=2)
    trainer.fit(TinyClassifier(), _loader())
    trainer.save_checkpoint(tmp_path / "on.ckpt")
    memory = on.runner().tcs.state_dict()

    # off: the fit continues from the checkpoint without LP-A3 and writes its LP-A3 state back unchanged
    off = LPA3Callback(ratio=0.5, sigma=0.02, steps=2, seed=0, augment="off")
    trainer = _trainer(tmp_path / "off", [off], max_epochs=2, limit_train_batches=2)
    trainer.fit(TinyClassifier(), _loader(), ckpt_path=tmp_path / "on.ckpt")
    trainer.save_checkpoint(tmp_path / "off.ckpt")
    state = torch.load(tmp_path / "off.ckpt", weights_only=False)["callbacks"][off.state_key]
    assert torch.equal(state["networks"][""]["tcs"]["memory"], memory["memory"])

    # on again, from the checkpoint an off run wrote without any LP-A3 state: a fresh memory
    fresh_off = LPA3Callback(ratio=0.5, sigma=0.02, steps=2, seed=0, augment="off")
    trainer = _trainer(tmp_path / "off2", [fresh_off], max_epochs=1, limit_train_batches=2)
    trainer.fit(TinyClassifier(), _loader())
    trainer.save_checkpoint(tmp_path / "off2.ckpt")
    again = LPA3Callback(ratio=0.5, sigma=0.02, steps=2, seed=0)
    trainer = _trainer(tmp_path / "on2", [again], max_epochs=2, limit_train_batches=2)
    trainer.fit(TinyClassifier(), _loader(), ckpt_path=tmp_path / "off2.ckpt")
    assert again.runner().tcs is not None and int(again.runner().tcs.seen.sum()) == 32  # epoch 1's two batches


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("kwargs, match", [
    ({"augment": "nul"}, "`augment` must be one of"),
    ({"augment": "noise"}, "needs `noise_norm`"),
    ({"augment": "noise", "noise_norm": 0.0}, "`noise_norm` must be a finite number > 0"),
    ({"noise_norm": 1.0}, "used by augment='noise' only"),
    ({"augment": "null", "cache": {"regenerate_every_n_epochs": 5}}, "nothing to cache"),
])
def test_bad_augment_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LPA3Callback(**kwargs)
