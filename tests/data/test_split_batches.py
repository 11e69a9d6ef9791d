"""The old module of the split-balanced sampler re-exports it (``lpa3_lightning.methods`` imports it there)."""

from __future__ import annotations

from lpa3_lightning.data import sampling, split_batches


def test_the_old_module_names_the_samplings_objects():
    for name in split_batches.__all__:
        assert getattr(split_batches, name) is getattr(sampling, name)
