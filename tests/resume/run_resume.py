"""Train, be killed mid-epoch (a real SIGKILL), resume: launched by tests/test_resume.py.

    python tests/resume/run_resume.py OUT_DIR {full,killed,resume} [KILL_AT | write:STEP]

'full' trains 3 epochs of 3 steps uninterrupted; 'killed' trains the same run and SIGKILLs
itself at the start of global step KILL_AT (default 5, the middle of epoch 1; 3 or 6, an
epoch's first step: the last checkpoint is then the previous epoch's last batch), or with
``write:STEP`` while the checkpoint of global step STEP is being written over ``last.ckpt``
(:class:`KillWhileWriting`), after a checkpoint at every step; 'resume' continues from the last
checkpoint. 'full' and 'resume' write OUT_DIR/final.pt.
"""

from __future__ import annotations

import builtins
import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lpa3_lightning import LPA3Callback  # noqa: E402
from lpa3_lightning.data import train_loader  # noqa: E402
from tests.callback.test_lpa3_callback import TinyClassifier  # noqa: E402
from tests.helpers import GlobalRandomState, indexed_images  # noqa: E402

KILL_AT = 5  # 48 samples / 16 = 3 steps an epoch: step 5 is the middle of epoch 1
EPOCHS = 3


class KillAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class KillWhileWriting(Callback):
    """SIGKILL while the checkpoint of global step ``step`` is written: right after a file of
    ``folder`` whose name holds ``last`` is opened for writing (the checkpoint, or its temporary
    copy beside it). Armed in ``on_save_checkpoint``, which Lightning calls before the write."""

    def __init__(self, folder: Path, step: int) -> None:
        self.folder, self.step = folder.resolve(), step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step != self.step:
            return
        real_open, folder = builtins.open, self.folder

        def open_then_die(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            path = Path(os.fsdecode(file)) if isinstance(file, (str, bytes, os.PathLike)) else None
            if path is not None and "w" in mode and path.resolve().parent == folder and "last" in path.name:
                os.kill(os.getpid(), signal.SIGKILL)
            return handle

        builtins.open = open_then_die


def main(out: Path, mode: str, kill_at: int | str = KILL_AT) -> None:
    pl.seed_everything(0)
    module = TinyClassifier()
    # seed=None: the solver's base seed is fixed at the first fit and checkpointed; the x' cache
    # (K=2) is checkpointed too.
    callbacks: list[Callback] = [LPA3Callback(ratio=0.5, steps=2,
                                              cache={"regenerate_every_n_epochs": 2, "in_checkpoint": True}),
                                 GlobalRandomState(),
                                 ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_top_k=-1,
                                                 save_last=True)]
    if mode == "killed":
        writing = isinstance(kill_at, str) and kill_at.startswith("write:")
        callbacks.append(KillWhileWriting(out / "ckpt", int(kill_at[6:])) if writing else KillAt(int(kill_at)))
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, deterministic=True, callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
    loader = train_loader(indexed_images(48), batch_size=16, seed=0)
    ckpt = out / "ckpt" / "last.ckpt" if mode == "resume" else None
    trainer.fit(module, loader, ckpt_path=ckpt)
    lpa3 = callbacks[0]
    torch.save({"tcs": lpa3.runner().tcs.state_dict(), "cache": lpa3.runner().store.state_dict(include_inputs=True),
                "weights": {k: v.clone() for k, v in module.state_dict().items()},
                "seen_augmented": module.seen_augmented}, out / "final.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], *sys.argv[3:])
