"""HostReadCounter: it sees each kind of host read, and nothing else, and restores torch."""

from __future__ import annotations

import pytest
import torch

from lpa3_lightning.core.host_reads import HostReadCounter


def test_counts_every_kind_of_host_read() -> None:
    x = torch.arange(6.0)
    with HostReadCounter() as reads:
        x.sum().item()
        bool(x.any())
        int(x[0])
        float(x.max())
        x.tolist()
        x.nonzero()
        x[x > 2]
        x[x > 4] = torch.tensor([9.0])
        range(10)[torch.tensor(3)]  # __index__
    assert dict(reads.counts) == {"item": 1, "__bool__": 1, "__int__": 1, "__float__": 1, "tolist": 1,
                                  "nonzero": 1, "boolean mask index": 2, "__index__": 1}
    assert reads.total == 9


def test_device_side_work_is_not_counted() -> None:
    x = torch.arange(6.0)
    with HostReadCounter() as reads:
        mask = x > 2
        y = torch.where(mask, x, 0.0).sum()
        x.masked_fill(mask, 0.0)
        x[mask] = 0.0  # a scalar through a mask is a masked_fill
        x.index_select(0, torch.tensor([1, 2]))
        _ = x.shape[0], y.dim()
    assert reads.total == 0, dict(reads.counts)


def test_sites_name_the_package_frame() -> None:
    from lpa3_lightning.core.checks import check_class_labels

    with HostReadCounter() as reads:
        check_class_labels(torch.tensor([0, 1]), 2)
    assert reads.total == 2
    assert all(site.startswith("checks.py:") for site in reads.sites)


def test_restores_torch_and_refuses_nesting() -> None:
    saved = {name: getattr(torch.Tensor, name) for name in ("item", "__bool__", "__getitem__", "__setitem__")}
    counter = HostReadCounter()
    with pytest.raises(RuntimeError, match="boom"):
        with counter:
            raise RuntimeError("boom")
    assert all(getattr(torch.Tensor, name) is fn for name, fn in saved.items())
    with counter:
        with pytest.raises(RuntimeError, match="already active"):
            counter.__enter__()
    assert all(getattr(torch.Tensor, name) is fn for name, fn in saved.items())
