"""``python -m lpa3_lightning`` runs the ``lpa3`` command."""

from lpa3_lightning.cli import main

main()
