"""A 2-process DDP fit launched by ``torchrun`` (tests/test_multinode.py), checkpointing every step.

    torchrun --standalone --nproc_per_node 2 tests/multinode/fit_ddp.py OUT_DIR {full,killed,resume}

'full' trains EPOCHS epochs uninterrupted. 'killed' trains the same run, but rank 1 SIGKILLs
itself at the start of global step KILL_AT (mid-epoch 1): torchrun stops rank 0 and fails.
'resume' is the same command launched again (as a scheduler's requeue does): it resumes from
the last checkpoint in OUT_DIR. Each rank writes ``OUT_DIR/rank{R}.pt``: the TCS state (rank 0's
holds the whole sharded memory), the x' cache, weights, optimizer state and the x' of every step
it ran.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lpa3_lightning import LPA3Callback  # noqa: E402
from lpa3_lightning.data.sampling import train_loader  # noqa: E402
from tests.callback.test_lpa3_callback import TinyClassifier  # noqa: E402
from tests.ddp.run_ddp import no_bn_net  # noqa: E402
from tests.helpers import indexed_images  # noqa: E402

N, PER_RANK_BATCH, EPOCHS = 48, 8, 3  # 3 steps an epoch on each of 2 ranks
KILL_AT = 4  # the middle of epoch 1


class Classifier(TinyClassifier):
    """Trains on its x' (supervised mixin), without BatchNorm: BatchNorm's running statistics are
    per rank under DDP and a resumed rank 1 would take rank 0's from the checkpoint."""

    def __init__(self) -> None:
        super().__init__(twin_bn=False)
        torch.manual_seed(0)
        self.model = no_bn_net()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Record(Callback):
    def __init__(self, kill: bool) -> None:
        self.kill, self.steps, self.indices = kill, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.kill and trainer.global_rank == 1 and trainer.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost rank: no exception, no clean-up
        self.steps.append(trainer.global_step)
        self.indices.append(batch[2].clone())


class RecordXPrime(LPA3Callback):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.x_prime: list = []

    def on_augmented(self, trainer, pl_module, augmented):
        self.x_prime.append((trainer.global_step, augmented.indices.clone(), augmented.inputs.clone()))


def main(out: Path, mode: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    # the memory split over the ranks (the layout large data sets get): its checkpoint is assembled from both
    lpa3 = RecordXPrime(ratio=0.5, steps=2, seed=0, cache={"regenerate_every_n_epochs": 2, "in_checkpoint": True},
                        selection={"memory_layout": "sharded"})
    record = Record(kill=mode == "killed")
    checkpoints = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_top_k=0, save_last=True)
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS, deterministic=True,
                         callbacks=[lpa3, record, checkpoints], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out)
    module = Classifier()
    last = out / "ckpt" / "last.ckpt"
    # the package's resumable loader: torch's DistributedSampler order for (seed, epoch), its position
    # checkpointed by Lightning (a StatefulDataLoader(shuffle=True) would not do: Lightning does not
    # recognise torchdata's RandomSampler as a shuffle and wraps it: each rank then draws the permutation
    # from its global generator, and the ranks split one order only while those generators agree)
    loader = train_loader(indexed_images(N), PER_RANK_BATCH, seed=0, num_replicas=trainer.world_size,
                          rank=trainer.global_rank)
    trainer.fit(module, loader, ckpt_path=last if last.exists() else None)
    tcs = lpa3.runner().tcs.state_dict()  # the core memory's: a collective, every rank calls it
    torch.save({"tcs": tcs, "cache": lpa3.runner().store.state_dict(include_inputs=True),
                "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
                "optimizer": trainer.optimizers[0].state_dict(), "x_prime": lpa3.x_prime, "steps": record.steps,
                "indices": record.indices,
                "sharded": type(lpa3.runner().tcs).__name__},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    if torch.distributed.is_initialized():  # (left to interpreter exit, gloo's threads can abort the process)
        torch.distributed.destroy_process_group()
