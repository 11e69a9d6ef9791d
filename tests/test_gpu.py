"""The same behaviour on a CUDA GPU: solver invariants, mixed precision, cache and resume.

The rest of the suite runs on the CPU (CI has no GPU). The tests here that can run on the CPU
run there too (``[cpu]``), on the path a GPU takes by default (``sync_free=True``, which
``sync_free="auto"`` picks on an accelerator), so that a check that contradicts the GPU's
defaults fails without a GPU; the ``[cuda]`` ones and the CUDA-only tests are skipped without
one, with the reason. On a GPU machine: ``pytest tests/test_gpu.py``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lpa3_lightning import LPA3Callback, LPA3Classifier, SolverGraphs, lpa3_attack
from lpa3_lightning.data import MedMNISTDataModule
from tests.helpers import independent_logp_drop, snapshot

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run on a GPU machine: pytest tests/test_gpu.py)")
#: the devices of the checks that run anywhere (the CPU one with the GPU's default per-batch path)
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=needs_cuda)]


def _trainer(tmp_path, callbacks, max_epochs: int = 2, device: str = "cuda", **kwargs) -> pl.Trainer:
    return pl.Trainer(default_root_dir=tmp_path, max_epochs=max_epochs, accelerator="gpu" if device == "cuda" else "cpu",
                      devices=1, callbacks=callbacks, logger=pl.loggers.CSVLogger(tmp_path), enable_progress_bar=False,
                      enable_model_summary=False, log_every_n_steps=1, limit_val_batches=0,
                      num_sanity_val_steps=0, **kwargs)


def _callback(device: str, **kwargs) -> LPA3Callback:
    """The callback with sync_free="auto" on the GPU, and its GPU choice (True) forced on the CPU."""
    if device == "cpu":
        kwargs["runtime"] = {**kwargs.get("runtime", {}), "sync_free": True}
    return LPA3Callback(**kwargs)


def _remeasured_drop(model, x, x_adv, y, twin_bn: bool = False) -> torch.Tensor:
    """``independent_logp_drop`` in full float32: with TF32 (cuDNN's default) rows that the
    bisection left just under sigma can read above it by TF32 rounding alone."""
    from lpa3_lightning.core.solver_forward import full_float32

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
    callback = _callback(device, ratio=0.5, steps=3, seed=0)
    seen_on: list[str] = []

    class Where(pl.Callback):  # the memory's device during the fit (teardown may move things)
        def on_train_epoch_end(self, trainer, pl_module):
            seen_on.append(callback.runner().tcs.memory.device.type)

    trainer = _trainer(tmp_path, [callback, Where()], precision=precision, limit_train_batches=4, device=device)
    trainer.fit(module, datamodule=_breast(device))
    metrics = trainer.callback_metrics
    # the solver runs in float32 with autocast off, so the constraint holds in every precision
    assert float(metrics["lpa3/label_preserved_epoch"]) >= 0.99
    assert float(metrics["lpa3/perceptual_distance_epoch"]) > 0
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    rows = trainer.num_training_batches * trainer.datamodule.batch_size
    assert rows <= int(callback.runner().tcs.seen.sum()) <= 546  # each epoch recorded its batches
    # the GPU's default, the sync-free path, keeps the memory beside the model (selection and
    # update then read nothing back to the host); no solver timing (it would synchronise)
    assert seen_on == [device, device] and "lpa3/solver_seconds_epoch" not in metrics


@pytest.mark.parametrize("device", DEVICES)
def test_cache_and_checkpoint_resume(tmp_path, device):
    pl.seed_everything(0)
    module = _module(device)
    callback = _callback(device, ratio=0.5, steps=2, seed=0, cache={"regenerate_every_n_epochs": 2})
    trainer = _trainer(tmp_path, [callback], limit_train_batches=3, device=device)
    trainer.fit(module, datamodule=_breast(device))
    assert float(trainer.callback_metrics["lpa3/reused_fraction_epoch"]) > 0  # epoch 1 reused epoch 0's x'
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(ckpt)
    saved_seen = int(callback.state_dict()["networks"][""]["tcs"]["seen"].sum())

    resumed = _callback(device, ratio=0.5, steps=2, seed=0, cache={"regenerate_every_n_epochs": 2})
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


# ---------------------------------------------------------------- the sync-free path on the device
@needs_cuda
def test_sync_free_attack_makes_no_synchronisation_and_matches_the_default_path():
    torch.manual_seed(0)
    model = LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2).model.cuda().train()
    x = torch.rand(48, 1, 28, 28, device="cuda") * 2 - 1
    y = torch.randint(0, 2, (48,), device="cuda")
    before = snapshot(model)
    from lpa3_lightning.core.input_box import resolve_input_range

    # the bounds as device tensors: built from Python numbers at each call they would be a copy (a sync)
    kwargs = dict(input_range=resolve_input_range((-1.0, 1.0), x), max_step=None, return_stats=True)
    # deterministic cuDNN: with the authors' unbounded step (1/slope) the run-to-run differences of
    # cuDNN's atomic input-gradient kernels alone moved every row's x' by more than 1e-4 on an H100
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        x_ref, ref = lpa3_attack(model, x, y, generator=torch.Generator("cuda").manual_seed(0), **kwargs)
        lpa3_attack(model, x, y, sync_free=True, **kwargs)  # warm-up: lazy CUDA initialisation may synchronise
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call inside raises
        try:
            x_adv, stats = lpa3_attack(model, x, y, generator=torch.Generator("cuda").manual_seed(0), sync_free=True,
                                       **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved
    assert all(torch.equal(before[k], snapshot(model)[k]) for k in before)
    assert model.training
    # same x' to float tolerance (the batched forwards round differently); the constraint on every sample
    close = (x_adv - x_ref).flatten(1).abs().amax(1) <= 1e-4
    assert float(close.float().mean()) >= 0.9, float(close.float().mean())
    assert bool((_remeasured_drop(model, x, x_adv, y) <= 0.02 + 1e-4).all())
    assert bool(stats.preserved.all()) and int(ref.projected.sum()) > 0


@needs_cuda
def test_a_sync_free_callback_step_synchronises_at_most_once_in_the_package(tmp_path):
    """CUDA's own sync detector (set_sync_debug_mode) over the callback's hooks of one step: it
    also sees host-to-device copies, which the CPU read counter cannot."""
    import warnings

    from lightning.pytorch.callbacks import Callback

    syncs: list[str] = []

    class Window(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if (trainer.current_epoch, batch_idx) == (1, 1):
                self.caught = warnings.catch_warnings(record=True)
                self.records = self.caught.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")

    class Close(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (trainer.current_epoch, batch_idx) == (1, 1):
                torch.cuda.set_sync_debug_mode("default")
                window.caught.__exit__(None, None, None)
                syncs.extend(f"{w.filename}:{w.lineno}" for w in window.records
                             if "synchroniz" in str(w.message).lower())

    window = Window()
    pl.seed_everything(0)
    module = LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2)
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.01)  # no Adam step counters
    callback = LPA3Callback(ratio=0.3, steps=2, seed=0, runtime={"sync_free": True})
    _trainer(tmp_path, [window, callback, Close()], max_epochs=2).fit(module, datamodule=_breast())
    in_package = [site for site in syncs if "lpa3_lightning" in site]
    assert len(in_package) <= 1, in_package


@pytest.mark.parametrize("device", DEVICES)
def test_sync_free_fit_keeps_the_memory_on_the_device(tmp_path, device):
    pl.seed_everything(0)
    module = _module(device)
    callback = _callback(device, ratio=0.3, steps=2, seed=0)  # sync_free="auto": on here on a GPU
    trainer = _trainer(tmp_path, [callback], max_epochs=2, device=device)
    trainer.fit(module, datamodule=_breast(device))
    assert callback.runner().tcs.memory.device.type == device
    assert float(trainer.callback_metrics["lpa3/label_preserved_epoch"]) >= 0.99
    assert "lpa3/solver_seconds_epoch" not in trainer.callback_metrics


# ---------------------------------------------------------------- the solver as a CUDA graph
@needs_cuda
@pytest.mark.parametrize("twin", [False, True])
def test_graphed_solve_replays_the_eager_padded_solve_without_a_synchronisation(twin):
    """Captured once per bucket, replayed on new data: the x' of the same padded solve run eagerly
    (SolverGraphs(capture=False)), no synchronisation during a replay, the attack's invariants, and
    the constraint re-measured independently on every returned row."""
    from lpa3_lightning.core.dual_bn import convert_dual_bn
    from lpa3_lightning.core.input_box import resolve_input_range

    torch.manual_seed(0)
    model = LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2, twin_bn=False).model.cuda().train()
    if twin:
        convert_dual_bn(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = snapshot(model)
    grads = [p.grad.clone() for p in model.parameters()]
    bounds = resolve_input_range((-1.0, 1.0), torch.zeros(1, 1, 28, 28, device="cuda"))
    graphs = SolverGraphs()
    # the same kernels in the eager and the captured solve: deterministic cuDNN algorithms, or
    # the 1/slope step would amplify run-to-run differences of the convolutions
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        _graph_against_eager(model, bounds, graphs, twin)
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved
    assert graphs.captures == 2 and graphs.replays == 6  # one graph per steps setting, each replayed thrice
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert model.training


def _graph_against_eager(model, bounds, graphs, twin: bool) -> None:
    for steps in (1, 5):
        for call, n in enumerate((37, 35, 38)):  # one bucket (40): a capture, then replays on other data
            x = torch.rand(n, 1, 28, 28, device="cuda") * 2 - 1
            y = torch.randint(0, 2, (n,), device="cuda")
            kwargs = dict(input_range=bounds, max_step=None, steps=steps, sync_free=True, return_stats=True,
                          bn_mode="twin" if twin else "eval")
            x_eager, eager = lpa3_attack(model, x, y, generator=torch.Generator("cuda").manual_seed(call),
                                         graphs=SolverGraphs(capture=False), **kwargs)
            generator = torch.Generator("cuda").manual_seed(call)
            torch.cuda.synchronize()
            replaying = graphs.captures > 0 and call > 0
            if replaying:
                torch.cuda.set_sync_debug_mode("error")  # any synchronising call inside raises
            try:
                x_graph, stats = lpa3_attack(model, x, y, generator=generator, graphs=graphs, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if steps == 1:  # one step: nothing amplifies the rounding of other kernels
                torch.testing.assert_close(x_graph, x_eager, rtol=0, atol=1e-5)
            else:
                close = (x_graph - x_eager).flatten(1).abs().amax(1) <= 1e-4
                assert float(close.float().mean()) >= 0.9, float(close.float().mean())
            assert bool((_remeasured_drop(model, x, x_graph, y, twin_bn=twin) <= 0.02 + 1e-4).all())
            assert bool(stats.preserved.all())


@needs_cuda
def test_graphs_are_captured_again_when_the_model_moves():
    torch.manual_seed(0)
    model = LPA3Classifier(arch="resnet18", in_channels=1, num_classes=2, twin_bn=False).model.cuda().eval()
    x = torch.rand(16, 1, 28, 28, device="cuda") * 2 - 1
    y = torch.randint(0, 2, (16,), device="cuda")
    graphs = SolverGraphs()
    # deterministic cuDNN: the two captures must record the same kernels (an H100 run without it
    # differed by 3.5e-3 after 5 steps)
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        first = lpa3_attack(model, x, y, sync_free=True, graphs=graphs,
                            generator=torch.Generator("cuda").manual_seed(0))
        # the old storages are kept alive, so the allocator cannot hand the same blocks back
        old = [t.detach() for t in [*model.parameters(), *model.buffers()]]
        model.cpu().cuda()  # same values, new memory: the old graph would read the old addresses
        again = lpa3_attack(model, x, y, sync_free=True, graphs=graphs,
                            generator=torch.Generator("cuda").manual_seed(0))
        del old  # held until the second solve has run
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved
    assert graphs.captures == 2
    torch.testing.assert_close(again, first, rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_fit_with_cuda_graphs_replays_and_keeps_the_label_as_trained(tmp_path, device):
    pl.seed_everything(0)
    module = _module(device)
    callback = _callback(device, ratio=0.3, steps=3, seed=0, runtime={"cuda_graphs": True})  # sync_free="auto": on a GPU
    trainer = _trainer(tmp_path, [callback], max_epochs=3, device=device)
    trainer.fit(module, datamodule=_breast(device))
    graphs = callback.runner().solver_graphs
    if device == "cuda":  # (on the CPU the padded rows are solved eagerly: nothing is captured)
        assert graphs.captures >= 1 and graphs.replays > graphs.captures, (graphs.captures, graphs.replays)
    assert len(graphs._entries) == 0  # released at the end of the fit
    # measured in the training forward of x' (label kept as trained), not the solver's flag
    assert float(trainer.callback_metrics["lpa3/label_preserved_epoch"]) >= 0.99
