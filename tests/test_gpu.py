"""The same behaviour on a CUDA GPU: solver invariants, mixed precision, cache and resume.

The rest of the suite runs on the CPU (CI has no GPU). The tests here that can run on the CPU
run there too (``[cpu]``, the same per-batch path as a GPU's), so that a check that contradicts the GPU's
defaults fails without a GPU; the ``[cuda]`` ones and the CUDA-only tests are skipped without
one, with the reason. On a GPU machine: ``pytest tests/test_gpu.py``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lpa3_lightning import LPA3Callback, LPA3Classifier, lpa3_attack
from lpa3_lightning.data import MedMNISTDataModule
from tests.helpers import independent_logp_drop, snapshot

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run on a GPU machine: pytest tests/test_gpu.py)")
#: the devices of the checks that run anywhere
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=needs_cuda)]


def _trainer(tmp_path, callbacks, max_epochs: int = 2, device: str = "cuda", **kwargs) -> pl.Trainer:
    return pl.Trainer(default_root_dir=tmp_path, max_epochs=max_epochs, accelerator="gpu" if device == "cuda" else "cpu",
                      devices=1, callbacks=callbacks, logger=pl.loggers.CSVLogger(tmp_path), enable_progress_bar=False,
                      enable_model_summary=False, log_every_n_steps=1, limit_val_batches=0,
                      num_sanity_val_steps=0, **kwargs)


def _remeasured_drop(model, x, x_adv, y, twin_bn: bool = False) -> torch.Tensor:
    """``independent_logp_drop`` in full float32: with TF32 (cuDNN's default) rows that the
    bisection left just under sigma can read above it by TF32 rounding alone."""
    from lpa3_lightning.core.forward_modes import full_float32

    with full_float32(x.device):
        return independent_logp_drop(model, x, x_adv, y, twin_bn=twin_bn)


def _breast(device: str = "cuda") -> MedMNISTDataModule:
    return MedMNISTDataModule("breastmnist", batch_size=64)  # the embedded copy


def _module(device: str = "cuda") -> LPA3Classifier:
    """ResNet-18 on a GPU; on the CPU (2 cores) a small CNN with BatchNorm: the logic checked here
    is the per-batch path's, not the network's."""
    from tests.helpers import small_cnn

    if device == "cpu":
        return LPA3Classifier(in_channels=1, num_classes=2, model=small_cnn(num_classes=2))
    return LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2)


@pytest.mark.parametrize("device", DEVICES)
def test_attack_keeps_the_model_unchanged_and_the_label(device):
    torch.manual_seed(0)
    module = _module(device).to(device).train()
    model = module.model
    x = torch.rand(32, 1, 28, 28, device=device) * 2 - 1
    y = torch.randint(0, 2, (32,), device=device)
    before = snapshot(model)

    def attack():
        return lpa3_attack(model, x, y, bn_mode="twin", input_range=(-1.0, 1.0), return_stats=True,
                           generator=torch.Generator(device).manual_seed(0))

    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True  # bitwise repeatable kernels (PyTorch's reproducibility notes)
    try:
        (x_adv, _), (again, _) = attack(), attack()
    finally:
        torch.backends.cudnn.deterministic = deterministic
    assert x_adv.device.type == device and x_adv.shape == x.shape
    # re-measured without the package's forward: twins swapped in with the clean batch's
    # statistics, full float32 (TF32 off for the check, as inside the solver)
    drop = _remeasured_drop(model, x, x_adv, y, twin_bn=True)
    assert bool((drop <= 0.02 + 1e-5).all()), drop.max()
    assert float((x_adv - x).abs().max()) > 0
    assert torch.equal(x_adv, again)  # a seeded generator gives the same x'
    assert model.training and all(p.grad is None for p in model.parameters())
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@needs_cuda
def test_the_constraint_holds_on_a_fresh_forward_with_tf32_on_outside():
    """TF32 (cuDNN's default) is switched off inside the solver and restored after it."""
    torch.manual_seed(0)
    model = LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2).model.cuda().eval()
    x = torch.rand(64, 1, 28, 28, device="cuda") * 2 - 1
    y = torch.randint(0, 2, (64,), device="cuda")
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, True
    try:
        x_adv = lpa3_attack(model, x, y, sigma=0.02, input_range=(-1.0, 1.0),
                            generator=torch.Generator("cuda").manual_seed(0))
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32  # restored
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = False, False
        with torch.no_grad():  # one forward of all 64, as a user would check it
            drop = (model(x).log_softmax(1) - model(x_adv).log_softmax(1)).gather(1, y[:, None]).flatten()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    assert float(drop.max()) <= 0.02 + 1e-5


@pytest.mark.parametrize("device, precision", [
    pytest.param("cpu", "32-true", id="cpu-32-true"), pytest.param("cpu", "bf16-mixed", id="cpu-bf16-mixed"),
    *[pytest.param("cuda", p, id=f"cuda-{p}", marks=needs_cuda) for p in ("32-true", "16-mixed", "bf16-mixed")]])
def test_fit_in_each_precision(tmp_path, device, precision):
    pl.seed_everything(0)
    module = _module(device)
    callback = LPA3Callback(ratio=0.5, steps=3, seed=0)
    trainer = _trainer(tmp_path, [callback], precision=precision, limit_train_batches=4, device=device)
    trainer.fit(module, datamodule=_breast(device))
    metrics = trainer.callback_metrics
    # the solver runs in float32 with autocast off, so the constraint holds in every precision
    assert float(metrics["lpa3/label_preserved_epoch"]) >= 0.99
    assert float(metrics["lpa3/perceptual_distance_epoch"]) > 0
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    rows = trainer.num_training_batches * trainer.datamodule.batch_size
    assert rows <= int(callback.runner().tcs.seen.sum()) <= 546  # each epoch recorded its batches


@pytest.mark.parametrize("device", DEVICES)
def test_cache_and_checkpoint_resume(tmp_path, device):
    pl.seed_everything(0)
    module = _module(device)
    callback = LPA3Callback(ratio=0.5, steps=2, seed=0, cache={"regenerate_every_n_epochs": 2})
    trainer = _trainer(tmp_path, [callback], limit_train_batches=3, device=device)
    trainer.fit(module, datamodule=_breast(device))
    assert float(trainer.callback_metrics["lpa3/reused_fraction_epoch"]) > 0  # epoch 1 reused epoch 0's x'
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(ckpt)
    saved_seen = int(callback.state_dict()["networks"][""]["tcs"]["seen"].sum())

    resumed = LPA3Callback(ratio=0.5, steps=2, seed=0, cache={"regenerate_every_n_epochs": 2})
    trainer2 = _trainer(tmp_path, [resumed], max_epochs=3, limit_train_batches=3, device=device)
    trainer2.fit(_module(device), datamodule=_breast(device),
                 ckpt_path=ckpt)
    assert trainer2.current_epoch == 3
    assert int(resumed.runner().tcs.seen.sum()) >= saved_seen  # restored, then extended by epoch 2
    assert float(trainer2.callback_metrics["lpa3/label_preserved_epoch"]) >= 0.99


@needs_cuda
@pytest.mark.parametrize("on_device", [True, False])
def test_the_x_prime_cache_lives_beside_the_model_and_reuse_reads_it_there(tmp_path, on_device):
    pl.seed_everything(0)
    callback = LPA3Callback(ratio=0.5, steps=2, seed=0,
                            cache={"regenerate_every_n_epochs": 2, "on_device": on_device})
    during: dict[str, str] = {}

    class Look(pl.Callback):  # the store and a read of it while the fit runs
        def on_train_epoch_end(self, trainer, pl_module):
            fresh = callback.runner().store.written >= 0
            during["store"] = callback.runner().store.storage.device.type
            during["read"] = callback.runner().store.get(fresh.nonzero().flatten()[:4].cuda()).device.type

    trainer = _trainer(tmp_path, [callback, Look()], limit_train_batches=3)
    trainer.fit(LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2), datamodule=_breast())
    assert float(trainer.callback_metrics["lpa3/reused_fraction_epoch"]) > 0
    assert during == ({"store": "cuda", "read": "cuda"} if on_device else {"store": "cpu", "read": "cpu"})
    assert callback.runner().store.storage.device.type == "cpu"  # offloaded at the end of the fit
