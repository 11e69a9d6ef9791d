"""A 2-process CPU (gloo) DDP fit, launched by tests/test_ddp.py as a script.

    python tests/ddp/run_ddp.py OUT_DIR {ignore_aug,supervised,empty_rank1,padded,bad_rank1,user_module,
                                         bad_index_rank1,crash_rank1,fixmatch,pes,dividemix,dividemix_stratified,
                                         noise_full,noise_first,noise_resume,syncbn_pes,syncbn_dividemix,
                                         syncbn_pes_grid}

'supervised' also caches x' (cache regenerate_every_n_epochs=2). 'user_module' trains a module
written as the README shows (LPA3ModuleMixin only) through a warm-up epoch. 'bad_index_rank1'
and 'crash_rank1' make one rank's ``lpa3_request`` return an out-of-range index or raise a
RuntimeError: every rank must stop with the reason instead of hanging; so must 'cache_dir_rank1' and
'cache_put_rank1' (rank 1's x' cache folder unusable, its first cache write failing). 'noise_full' trains 2 epochs,
'noise_first' 1 epoch and writes a checkpoint, 'noise_resume' resumes it (OUT_DIR's sibling
``noise_first``) for the second; each rank records every step's x'.

Lightning's "ddp" strategy starts the second process by running this script again. Each
rank writes ``OUT_DIR/rank{R}.pt`` with its TCS state and every step's (indices, mask); rank 0
also writes the checkpoint ``OUT_DIR/final.ckpt``. Every rank keeps the whole TCS memory (what
``memory_layout='auto'`` picks for a memory this small) unless the mode ends in ``+sharded``: then
the memory is split over the two ranks (rank 0's state assembles all of it, rank 1's holds none).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lpa3_lightning.callback.runner as runner_module  # noqa: E402
from lpa3_lightning import LPA3Callback, convert_dual_bn  # noqa: E402
from lpa3_lightning.callback.runner import check_request  # noqa: E402
from lpa3_lightning.mixins import LPA3ModuleMixin  # noqa: E402
from tests.callback.test_lpa3_callback import TinyClassifier  # noqa: E402
from tests.helpers import indexed_images, small_cnn  # noqa: E402

N, PER_RANK_BATCH, EPOCHS = 48, 8, 3
N_PADDED = 49  # DistributedSampler pads to 50: one sample is seen twice an epoch


def no_bn_net() -> nn.Module:
    """No BatchNorm and no dropout: DDP with 2 x 8 equals one process with 16 (up to rounding)."""
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


class IgnoresAugmentation(TinyClassifier):
    """Trains on the clean batch only, so DDP and one process follow the same weights."""

    def __init__(self) -> None:
        super().__init__(twin_bn=False)
        torch.manual_seed(0)
        self.model = no_bn_net()

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        logits = self.model(x)
        self.lpa3_record_predictions(idx, logits, y)
        self.lpa3_take_augmented()
        return F.cross_entropy(logits, y)


class UserModule(LPA3ModuleMixin, pl.LightningModule):
    """The README's custom-module recipe, nothing more (no anchor of its own for the twins)."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.net = convert_dual_bn(small_cnn(num_classes=3))
        self.lpa3_num_classes = 3
        self.fault = fault
        self.seen_augmented: list[int] = []

    def lpa3_model(self) -> nn.Module:
        return self.net

    def lpa3_request(self, batch):
        request = super().lpa3_request(batch)
        if self.fault is not None and self.trainer.global_rank == 1 and self.trainer.global_step == 2:
            if self.fault == "bad_index_rank1":
                request.indices = request.indices + 1000  # out of range on this rank only
            else:
                raise RuntimeError("lpa3_request failed on one rank (simulated)")
        return request

    def training_step(self, batch, batch_idx):
        x, y, index = self.lpa3_split_batch(batch)
        logits = self.net(x)
        self.lpa3_record_predictions(index, logits)
        loss = F.cross_entropy(logits, y)
        augmented = self.lpa3_take_augmented()
        self.seen_augmented.append(0 if augmented is None else len(augmented))
        if augmented is not None and len(augmented):
            loss = loss + F.cross_entropy(self.lpa3_forward_augmented(augmented), augmented.targets)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class ConsumesOnRankZero(UserModule):
    """A user's override that answers differently on the two ranks (a bug the callback must name)."""

    def lpa3_consumes_augmented(self, epoch: int) -> bool:
        return self.trainer.global_rank == 0


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "broadcast",
               "reduce_scatter_tensor", "barrier")
_IN_HOOK = [None]  # the counts of the callback hook running now, or None outside its hooks


def _count_collectives() -> None:
    """Count every torch.distributed collective called inside the callback's batch hooks (Lightning's
    strategy.reduce goes through torch.distributed.all_reduce too)."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name)
        if getattr(original, "_counted", False):
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            if _IN_HOOK[0] is not None:
                _IN_HOOK[0][_name] = _IN_HOOK[0].get(_name, 0) + 1
            return _original(*args, **kwargs)

        counted._counted = True  # type: ignore[attr-defined]
        setattr(dist, name, counted)


class Recording(LPA3Callback):
    def __init__(self, *args, empty_rank: int | None = None, bad_rank: int | None = None,
                 hook_fault_rank: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hook_fault_rank = hook_fault_rank
        self.empty_rank = empty_rank
        self.bad_rank = bad_rank
        self.record: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.applied_per_epoch: dict[int, int] = {}
        self.x_prime: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (epoch, indices, x') per step
        self.collectives: list[dict[str, int]] = []  # per step: the collectives of the callback's batch hooks
        _count_collectives()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.collectives.append({})
        _IN_HOOK[0] = self.collectives[-1]
        try:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        finally:
            _IN_HOOK[0] = None

    def _check_request(self, request, num_classes, num_samples):
        if self.bad_rank is not None and self._rank == self.bad_rank and len(self.record) == 1:
            raise ValueError("Labels out of range (simulated on one rank)")
        check_request(request, num_classes, num_samples)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # applied rows, counted from the outside: the samples whose score this step's update changed
        # (a padded repeat applied again in a later step of the epoch would be counted twice)
        before = self.runner().tcs.scores.clone()
        _IN_HOOK[0] = self.collectives[-1]
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            _IN_HOOK[0] = None
        changed = int((self.runner().tcs.scores != before).sum())
        self.applied_per_epoch[trainer.current_epoch] = self.applied_per_epoch.get(trainer.current_epoch, 0) + changed

    def on_augmented(self, trainer, pl_module, augmented):
        if self.hook_fault_rank == trainer.global_rank and len(self.x_prime) == 1:
            raise RuntimeError("on_augmented failed on one rank (simulated)")
        self.x_prime.append((trainer.current_epoch, augmented.indices.cpu().clone(), augmented.inputs.cpu().clone()))

    def select(self, memory, request, finite, epoch):
        by_memory, mask = super().select(memory, request, finite, epoch)
        if self.empty_rank is not None and self._rank == self.empty_rank:
            mask = torch.zeros_like(mask)  # (the selection rule a subclass may override, per rank)
        self.record.append((request.indices.cpu().clone(), mask.cpu().clone()))
        return by_memory, mask

    def _patch_stages(self, own: bool) -> None:
        # the runner looks its request check up by name: this callback's version simulates a bad rank
        runner_module.check_request = self._check_request if own else check_request

    def on_fit_end(self, trainer, pl_module):
        self._patch_stages(False)
        super().on_fit_end(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception):
        self._patch_stages(False)
        super().on_exception(trainer, pl_module, exception)

    def on_train_start(self, trainer, pl_module):
        self._rank = trainer.global_rank
        self._patch_stages(True)
        super().on_train_start(trainer, pl_module)


class SeedPerRank(Callback):
    """Each rank's torch seed its own (1000 + rank) when the fit starts: after Lightning's DDP set-up,
    which seeds every rank with ``seed_everything``'s seed again."""

    def on_fit_start(self, trainer, pl_module):
        torch.manual_seed(1000 + trainer.global_rank)


def _cache_fault_run(out: Path, mode: str) -> None:
    """Rank 1's x' cache fails: its folder lies under a file ('cache_dir_rank1', found when the fit
    starts), or its first write raises ('cache_put_rank1', after the step's reduction). Every rank
    must stop with the reason, none with a dropped connection."""
    from lpa3_lightning.core.cache import AugmentationCache

    rank1 = int(os.environ.get("LOCAL_RANK", 0)) == 1  # (Lightning starts rank 1 with LOCAL_RANK=1)
    folder = out / f"rank{int(rank1)}_cache"
    if mode == "cache_dir_rank1" and rank1:
        (out / "a_file").write_text("not a folder")
        folder = out / "a_file" / "cache"
    if mode == "cache_put_rank1" and rank1:
        put = AugmentationCache.put

        def failing(self, indices, *args, **kwargs):
            if len(indices):
                raise OSError("x' cache write failed on one rank (simulated)")
            return put(self, indices, *args, **kwargs)

        AugmentationCache.put = failing
    callback = LPA3Callback(ratio=0.5, steps=1, seed=0, warmup_epochs=1,
                            cache={"regenerate_every_n_epochs": 2, "max_bytes": 0, "dir": str(folder)})
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, callbacks=[callback],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out)
    trainer.fit(TinyClassifier(twin_bn=True), DataLoader(indexed_images(N), batch_size=PER_RANK_BATCH))


SYNCED_FORWARDS = [0]  # train-mode SyncBatchNorm forwards of this process (the stand-in's count)


def _count_synced_forwards() -> None:
    """A stand-in for SyncBatchNorm on the CPU (torch syncs BN on GPUs only): each train-mode
    forward, a collective on a GPU, is counted and normalised locally. Every rank must count as
    many as the others, or on a GPU the ones ahead would wait for ever."""

    def forward(self, x):
        if self.training:
            SYNCED_FORWARDS[0] += 1
        momentum = 0.0 if self.momentum is None else self.momentum
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, momentum,
                            self.eps)

    nn.SyncBatchNorm.forward = forward
    # DDP refuses SyncBatchNorm on CPU modules; the stand-in needs no GPU
    torch.nn.parallel.DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None


def _synced(net: nn.Module) -> nn.Module:
    """``net`` with SyncBatchNorm (main, the stand-in) and local twins for x'."""
    return convert_dual_bn(nn.SyncBatchNorm.convert_sync_batchnorm(net))


def _syncbn_run(out: Path, mode: str) -> None:
    """PES and DivideMix over synced BatchNorm, where rank 1's batches leave one side of a split
    empty: PES's guess (no unlabeled row), DivideMix's co-guess and co-refinement (no unlabeled
    row on even steps, no labeled row on odd ones); and PES's image grid, whose request forwards
    the guess (logged by rank 0 only)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from lpa3_lightning import DivideMixClassifier, PESClassifier
    from tests.methods.test_pes import NoisyTwoViews, _net

    _count_synced_forwards()
    SYNCED_FORWARDS[0] = 0  # (several runs may share the process)
    logger, callback_args = False, {}
    if mode in ("syncbn_pes", "syncbn_pes_grid"):
        if mode == "syncbn_pes_grid":
            logger = TensorBoardLogger(out, name="")
            callback_args = {"logging": {"images_every_n_epochs": 1, "num_images": 4}}
        module = PESClassifier(num_classes=3, num_samples=N, model=_synced(_net()), twin_bn=False,
                               pes={"early_epochs": 1, "refine_epochs": 1, "lambda_u": 5.0, "rampup_epochs": 1.0})
        split = module._pes_split_rows

        def rank1_all_labeled(idx):
            rows = split(idx)
            return torch.ones_like(rows) if module.trainer.global_rank == 1 else rows

        module._pes_split_rows = rank1_all_labeled
        loader = DataLoader(NoisyTwoViews(N), batch_size=PER_RANK_BATCH, shuffle=True)
    else:  # syncbn_dividemix
        module = DivideMixClassifier(num_classes=3, num_samples=N, twin_bn=False,
                                     dividemix={"warmup_epochs": 1, "lambda_u": 5.0, "rampup_epochs": 1.0})
        module.net1, module.net2 = _synced(module.net1), _synced(module.net2)
        labeled = module._dm_labeled

        def rank1_one_side(network, idx):
            rows, w = labeled(network, idx)
            if module.trainer.global_rank == 1:
                rows = torch.full_like(rows, module.trainer.global_step % 2 == 1)
            return rows, w

        module._dm_labeled = rank1_one_side
        loader = DataLoader(NoisyTwoViews(N), batch_size=PER_RANK_BATCH, shuffle=True)
    callback = LPA3Callback(ratio=0.9, steps=2, seed=0, warmup_epochs=1, **callback_args)
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=3, callbacks=[callback],
                         logger=logger, enable_checkpointing=False, enable_progress_bar=False, log_every_n_steps=1,
                         enable_model_summary=False, default_root_dir=out)
    trainer.fit(module, loader)
    torch.save({"synced_forwards": SYNCED_FORWARDS[0], "grid": None if callback.networks else callback.runner().last_grid,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
               out / f"rank{trainer.global_rank}.pt")


def main(out: Path, mode: str) -> None:
    # "<mode>+sharded": the TCS memory is split over the ranks (the layout 'auto' picks for memories of
    # hundreds of MB)
    mode, _, path = mode.partition("+")
    layout = {"memory_layout": "sharded" if path == "sharded" else "auto"}
    if mode.startswith("syncbn_"):
        _syncbn_run(out, mode)
        return
    if mode in ("cache_dir_rank1", "cache_put_rank1"):
        _cache_fault_run(out, mode)
        return
    pl.seed_everything(0)
    user = mode in ("user_module", "bad_index_rank1", "crash_rank1")
    if mode == "fixmatch":
        from tests.methods.test_fixmatch import UserFixMatch, _loaders

        module = UserFixMatch(num_unlabeled=64, confidence=0.4)
        callback = Recording(ratio=0.5, steps=2, seed=0, input_range=None)
        trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, callbacks=[callback],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=out)
        trainer.fit(module, _loaders(n_unlabeled=64, batch=2, mu=4))
        torch.save({"tcs": callback.runner().tcs.state_dict(), "parts": module.parts,
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
                   out / f"rank{trainer.global_rank}.pt")
        return
    if mode == "pes":
        from lpa3_lightning import PESClassifier
        from tests.methods.test_pes import NoisyTwoViews, _net

        module = PESClassifier(num_classes=3, num_samples=N, model=_net(),
                               pes={"early_epochs": 1, "refine_epochs": 1, "lambda_u": 5.0, "rampup_epochs": 1.0})
        callback = LPA3Callback(ratio=0.9, steps=2, seed=0, warmup_epochs=2)
        trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS + 1, callbacks=[callback],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=out)
        trainer.fit(module, DataLoader(NoisyTwoViews(N), batch_size=PER_RANK_BATCH, shuffle=True))
        torch.save({"tcs": callback.runner().tcs.state_dict(), "labeled": module._pes_labeled.cpu(),
                    "params": {k: v.detach().clone() for k, v in module.named_parameters()},
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
                   out / f"rank{trainer.global_rank}.pt")
        return
    if mode in ("dividemix", "dividemix_stratified"):
        from lpa3_lightning import DivideMixClassifier
        from tests.methods.test_pes import NoisyTwoViews

        module = DivideMixClassifier(num_classes=3, num_samples=N,
                                     dividemix={"warmup_epochs": 1, "lambda_u": 5.0, "rampup_epochs": 1.0,
                                                "stratified_split": mode == "dividemix_stratified"})
        callback = LPA3Callback(ratio=0.9, steps=2, seed=0, warmup_epochs=1, cache={"regenerate_every_n_epochs": 2})
        trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS, callbacks=[callback],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=out)
        trainer.fit(module, DataLoader(NoisyTwoViews(N), batch_size=PER_RANK_BATCH, shuffle=True))
        torch.save({"tcs": {n: c.tcs.state_dict() for n, c in callback.networks.items()},
                    "cache": {n: c.store.state_dict(include_inputs=True) for n, c in callback.networks.items()},
                    "clean_prob": {n: module.dividemix_clean_probability(n) for n in module.lpa3_networks()},
                    "stratified_count": dict(module._dm_state().get("stratified_count", {})),
                    "params": {k: v.detach().clone() for k, v in module.named_parameters()},  # (BN buffers are local)
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
                   out / f"rank{trainer.global_rank}.pt")
        return
    if mode.startswith("noise_"):  # noise_full: 2 epochs; noise_first: epoch 0 + checkpoint; noise_resume: epoch 1
        callback = Recording(ratio=0.5, steps=2, seed=0)
        trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1 if mode == "noise_first" else 2,
                             callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=out, deterministic=True)
        first = out.parent / out.name.replace("noise_resume", "noise_first")  # (noise_first ran before)
        ckpt = first / "epoch0.ckpt" if mode == "noise_resume" else None
        # no dropout (torch's global random state is not restored per rank under DDP) and x' not
        # trained: the weights of both runs stay equal, so x' differ only by the solver's noise
        trainer.fit(IgnoresAugmentation(), DataLoader(indexed_images(N), batch_size=PER_RANK_BATCH), ckpt_path=ckpt)
        if mode == "noise_first":
            trainer.save_checkpoint(out / "epoch0.ckpt")
        torch.save({"x_prime": callback.x_prime}, out / f"rank{trainer.global_rank}.pt")
        return
    if mode == "consumes_rank0":  # a user override that answers differently on the two ranks
        module = ConsumesOnRankZero()
        callback = LPA3Callback(ratio=0.5, steps=1, seed=0)
        trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, callbacks=[callback],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=out)
        trainer.fit(module, DataLoader(indexed_images(N), batch_size=PER_RANK_BATCH))
        return
    if mode == "state_dict_rank0":  # the common rank-0-only save, on a memory split over the ranks
        callback = LPA3Callback(ratio=0.5, steps=1, seed=0, selection={"memory_layout": "sharded"})
        trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, callbacks=[callback],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=out)
        trainer.fit(TinyClassifier(twin_bn=True), DataLoader(indexed_images(N), batch_size=PER_RANK_BATCH))
        outcome = "returned"
        if trainer.is_global_zero:
            try:
                callback.state_dict()
            except RuntimeError as error:
                outcome = str(error)
        torch.save({"outcome": outcome, "layout": type(callback.runner().tcs).__name__}, out / f"rank{trainer.global_rank}.pt")
        return
    if user:
        module = UserModule(fault=None if mode == "user_module" else mode)
    else:
        module = IgnoresAugmentation() if mode in ("ignore_aug", "padded") else TinyClassifier(twin_bn=True)
    callback = Recording(ratio=0.5, steps=2, seed=None if mode == "seed_differs" else 0,
                         empty_rank=1 if mode == "empty_rank1" else None,
                         bad_rank=1 if mode == "bad_rank1" else None,
                         hook_fault_rank=1 if mode == "on_augmented_rank1" else None,
                         warmup_epochs=1 if user else 0,
                         cache={"regenerate_every_n_epochs": 2 if mode in ("supervised", "empty_rank1") else 1}, selection=layout)
    callbacks: list = [callback]
    if mode == "seed_differs":  # each rank's torch seed its own; the callback's seed=None must still be one
        callbacks.insert(0, SeedPerRank())
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS, callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out)
    n = N_PADDED if mode == "padded" else N
    loader = DataLoader(indexed_images(n), batch_size=PER_RANK_BATCH, shuffle=False)
    trainer.fit(module, loader)
    trainer.save_checkpoint(out / "final.ckpt")
    torch.save({"tcs": callback.runner().tcs.state_dict(), "steps": callback.record, "applied": callback.applied_per_epoch,
                "collectives": callback.collectives, "seed": callback._base_seed,
                "cache": None if callback.runner().store is None else callback.runner().store.state_dict(include_inputs=True),
                "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
                "seen_augmented": getattr(module, "seen_augmented", None),
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    # one mode: OUT_DIR/rank{R}.pt; several (comma-separated): each in OUT_DIR/<mode>/, one after the
    # other in the same two processes (their start-up is most of a short run's time)
    modes = sys.argv[2].split(",")
    for run_mode in modes:
        target = Path(sys.argv[1]) if len(modes) == 1 else Path(sys.argv[1]) / run_mode
        target.mkdir(parents=True, exist_ok=True)
        print(f"### {run_mode}", flush=True)
        main(target, run_mode)
    if torch.distributed.is_initialized():  # (left to interpreter exit, gloo's threads can abort the process)
        torch.distributed.destroy_process_group()
