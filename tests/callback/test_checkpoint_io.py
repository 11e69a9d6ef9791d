"""AtomicCheckpointIO: a checkpoint is written whole or not at all, and a failed write leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from lpa3_lightning.callback.checkpoint_io import AtomicCheckpointIO


def test_a_checkpoint_is_written_whole_under_its_name_and_no_partial_file_is_left(tmp_path):
    target = tmp_path / "ckpt" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1, "weights": torch.arange(4.0)}, target)
    assert torch.load(target)["step"] == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]


def test_a_failed_write_keeps_the_previous_checkpoint_and_leaves_no_partial_file(tmp_path):
    target = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, target)
    with pytest.raises(Exception):  # a lambda does not pickle
        io.save_checkpoint({"step": 2, "hook": lambda: None}, target)
    assert torch.load(target)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_path_under_home_is_expanded_as_lightnings_own_io_does(tmp_path, monkeypatch):
    """``~/ckpts/final.ckpt`` is written under $HOME (it was written to ./~/ckpts), and loads by the same string."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 3}, "~/ckpts/final.ckpt")
    assert (tmp_path / "home" / "ckpts" / "final.ckpt").is_file() and not (tmp_path / "~").exists()
    assert io.load_checkpoint("~/ckpts/final.ckpt")["step"] == 3
