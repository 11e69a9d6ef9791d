"""The ``lpa3`` command: LightningCLI over any LightningModule / LightningDataModule (``python -m
lpa3_lightning`` is the same). ``lpa3 fit --config ... --test_after_fit true`` trains, then tests the best
checkpoint; ``lpa3 show`` draws x, x' and |x' - x| for a checkpoint (:mod:`lpa3_lightning.cli.show`);
``lpa3 compare`` runs a config with LP-A3 and with it off on paired seeds (:mod:`lpa3_lightning.cli.compare`).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.cli import LightningCLI

from lpa3_lightning.cli.parser import OPTIMIZER_NOTE, LPA3ArgumentParser

__all__ = ["LPA3CLI", "build_cli", "main", "run_best_test"]


def run_best_test(trainer: Trainer, model: LightningModule, datamodule: Any, verbose: bool = True) -> tuple[list, str]:
    """Test the best checkpoint of the trainer's checkpoint callback (the final weights when none monitors a
    metric); returns the test results and the checkpoint's path ("" for the final weights)."""
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    best = getattr(checkpoint, "best_model_path", "") if checkpoint is not None else ""
    return trainer.test(model, datamodule=datamodule, ckpt_path=best or None, verbose=verbose), best


class LPA3CLI(LightningCLI):
    """LightningCLI with a ``--test_after_fit`` switch for one-command train-and-test runs."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--test_after_fit", type=bool, default=False,
                            help="After fit, test the best checkpoint and print the test metrics.")
        parser.epilog = OPTIMIZER_NOTE

    def after_fit(self) -> None:
        if not self.config[self.subcommand].get("test_after_fit"):
            return
        trainer = self.trainer
        results, best = run_best_test(trainer, self.model, self.datamodule)
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank reads it, or rank 0 waits alone
        if trainer.is_global_zero:
            print("\n=== LP-A3 run finished ===")
            for key, value in sorted((results[0] if results else {}).items()):
                print(f"{key}: {value:.4f}")
            averaging = [type(c).__name__ for c in trainer.callbacks if isinstance(c, WeightAveraging)]
            weights = f"the {averaging[0]} average" if averaging else "the trained weights"
            print(f"tested checkpoint: {best or '(final weights)'} ({weights}: the checkpoint's state_dict, which "
                  f"`lpa3 test --ckpt_path` tests too)" if best else f"tested: the final weights ({weights})")
            print(f"logs and checkpoints: {log_dir}")


def build_cli(args: Any = None, run: bool = True) -> LPA3CLI:
    """The CLI as ``lpa3`` builds it (``run=False`` only instantiates trainer, model and data)."""
    return LPA3CLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, args=args,
                   run=run, save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False,
                   parser_class=LPA3ArgumentParser)


def main(args: Any = None) -> None:
    """Entry point of the ``lpa3`` console script: ``lpa3 show ...``, ``lpa3 compare ...`` (a ``SystemExit``
    with its exit code when it fails), or a LightningCLI subcommand."""
    # as ``python -m lpa3_lightning`` does: a class path (``--model my_module.MyModule``) may name a
    # module of the working folder, which a console script's sys.path (its own folder) lacks
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] in (["show"], ["compare"]):  # (their own parsers; compare returns its exit code)
        code = importlib.import_module(f"lpa3_lightning.cli.{argv[0]}").main(argv[1:])
        if argv[0] == "compare" and code:
            raise SystemExit(code)
        return
    build_cli(args)
    # release the process group a DDP run created: left to interpreter exit, gloo's threads can abort the
    # process (SIGABRT) after a run that succeeded, and torchrun then reports the job failed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    main()
