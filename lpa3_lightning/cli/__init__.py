"""The ``lpa3`` command (LightningCLI over any module and data module) and ``lpa3 show``."""

from lpa3_lightning.cli.main import LPA3CLI, build_cli, main

__all__ = ["LPA3CLI", "build_cli", "main"]
