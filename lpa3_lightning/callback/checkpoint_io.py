"""Checkpoint files written whole or not at all, so that a process killed while it writes one
leaves the previous checkpoint usable.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction: the bytes go to a file in
the system's temporary folder, which is then moved onto the checkpoint's path. On one file
system the move is a rename (atomic); across file systems (a tmpfs ``/tmp``, checkpoints on
another disk or a network file system) it is a copy that first truncates the previous
checkpoint, and a kill during that copy leaves ``last.ckpt`` empty or cut short: the run has
nothing to resume from. A kill before the move leaves the temporary file in ``/tmp``.

:class:`AtomicCheckpointIO` writes the checkpoint to a temporary file beside its target, on the
same file system, flushes it to the disk and renames it over the target (``os.replace``).
:class:`~lpa3_lightning.LPA3Callback` puts it in place of Lightning's default when a fit starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with a local checkpoint written to ``.<name>.partial``
    beside it and renamed over it once whole; a remote path (``s3://...``) or ``storage_options``
    go through Lightning's own save. Loading and removing are Lightning's."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path).expanduser()  # "~/ckpts/x.ckpt" under $HOME, as Lightning's own save and load read it
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")  # one name: an interrupted write's is overwritten
        try:
            with open(partial, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())  # whole on the disk before it takes the target's name
        except BaseException:
            partial.unlink(missing_ok=True)  # a failed save (an unpicklable object, a full disk) leaves nothing
            raise
        os.replace(partial, target)
        _sync_folder(target.parent)


def _sync_folder(folder: Path) -> None:
    """Flush the folder's entry of the renamed file to the disk (POSIX; a no-op where a folder cannot be opened)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some file systems refuse fsync on a folder
    finally:
        os.close(descriptor)
