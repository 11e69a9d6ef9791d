"""The ``lpa3`` command's argument parser: a refusal in a few lines (the error and where the options are
listed, not jsonargparse's whole usage), and an unknown LPA3Callback setting in a config or on the command
line named with its place, in the words the Python API uses."""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

__all__ = ["LPA3ArgumentParser", "OPTIMIZER_NOTE", "explain", "import_class"]

#: what ``lpa3 fit --help`` and a config with an ``optimizer:`` / ``lr_scheduler:`` key say
OPTIMIZER_NOTE = (
    "The optimizer and the learning-rate schedule belong to the module (its configure_optimizers), so `optimizer:` "
    "and `lr_scheduler:` keys are not taken: set the ready modules' recipe under model.init_args (lr, momentum, "
    "weight_decay; LPA3Classifier: milestones, lr_gamma), or write configure_optimizers in your own module."
)
#: jsonargparse's report of a key a class does not take (the class path, then the key), and of an optimizer or
#: schedule key (LightningCLI's, off in ``lpa3``)
_NOT_ACCEPTED = re.compile(r"class_path '([\w.]+)':\s*\n\s*Option '(\w+)' is not accepted")
_OPTIMIZER_KEY = re.compile(r"(?:does not accept option|Option) '(optimizer|lr_scheduler)\b")


def import_class(path: str) -> Any:
    """The object a dotted ``path`` names (``"lpa3_lightning.LPA3Callback"``), None when it does not import."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def explain(message: str) -> str | None:
    """The package's message for a key that LPA3Callback or one of its settings groups does not take, or an
    ``optimizer:`` / ``lr_scheduler:`` key, found in a jsonargparse error ``message`` (None when there is none)."""
    optimizer = _OPTIMIZER_KEY.search(message)
    if optimizer is not None:
        return f"{message.strip()}: `{optimizer.group(1)}:` is not an option of lpa3. {OPTIMIZER_NOTE}"
    from lpa3_lightning.callback.lpa3_callback import LPA3Callback
    from lpa3_lightning.callback.settings import GROUPS, _group_of
    from lpa3_lightning.core.checks import dataclass_from

    groups = {cls: name for name, cls in GROUPS.items()}
    for path, key in _NOT_ACCEPTED.findall(message):
        cls = import_class(path)
        try:
            if isinstance(cls, type) and issubclass(cls, LPA3Callback):
                cls(**{key: None})  # its unknown-argument check: the group that holds `key`, or the closest
            elif cls in groups:
                dataclass_from(cls, {key: None}, groups[cls], home=_group_of)
        except TypeError as exc:
            return str(exc)
    return None


class LPA3ArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose refusals are short and name a misplaced LPA3Callback setting's group."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        from jsonargparse._common import debug_mode_active

        if not self.exit_on_error or debug_mode_active():  # (jsonargparse's own retries: an exception)
            super().error(message, ex)
        explained = explain(message)
        key = re.match(r'Parser key "([\w.]+)"', message)
        prog = (getattr(ex, "subcommand_parser", None) or self).prog.replace(" [options]", "")
        where = f'Parser key "{key.group(1)}": ' if explained and key else ""
        sys.stderr.write(f"error: {where}{explained or message}\n"
                         f"tip: `{prog} --help` lists the accepted options.\n")
        self.exit(2)
