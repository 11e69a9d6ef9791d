"""Train, be killed mid-epoch (a real SIGKILL), resume: launched by tests/test_resume.py.

    python tests/resume/run_resume.py OUT_DIR {full,killed,resume} [KILL_AT]

'full' trains 3 epochs of 3 steps uninterrupted; 'killed' trains the same run and SIGKILLs
itself at the start of global step KILL_AT (default 5, the middle of epoch 1; 3 or 6, an
epoch's first step: the last checkpoint is then the previous epoch's last batch), after a
checkpoint at every step; 'resume' continues from the last checkpoint. 'full' and 'resume'
write OUT_DIR/final.pt.
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
from lpa3_lightning.data import train_loader  # noqa: E402
from tests.callback.test_callback import TinyClassifier  # noqa: E402
from tests.helpers import GlobalRandomState, indexed_images  # noqa: E402

KILL_AT = 5  # 48 samples / 16 = 3 steps an epoch: step 5 is the middle of epoch 1
EPOCHS = 3


class KillAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(out: Path, mode: str, kill_at: int = KILL_AT) -> None:
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
        callbacks.append(KillAt(kill_at))
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
    main(Path(sys.argv[1]), sys.argv[2], *(int(a) for a in sys.argv[3:]))
