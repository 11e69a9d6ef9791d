"""Counting the host reads of tensor values in a block of code (where a GPU run would wait).

On a GPU every read of a tensor's value on the host (``.item()``, ``bool()``/``int()``/
``float()`` of a tensor, ``.tolist()``, ``nonzero()``, indexing with a boolean mask, whose
result size depends on the data) waits for the device: a synchronisation. On the CPU they cost
nothing but happen at the same places, so counting them on the CPU says how often a GPU step
would stop. Copies between devices (``.to("cpu")``) are not seen here.

Example:
    >>> x = torch.arange(4.0)
    >>> with HostReadCounter() as reads:
    ...     total = float(x.sum())
    ...     positive = x[x > 0]
    >>> reads.total
    2
"""

from __future__ import annotations

import collections
import threading
import traceback
from pathlib import Path
from typing import Any

import torch

__all__ = ["HOST_READS", "HostReadCounter"]

#: The ``Tensor`` methods that read a value on the host.
HOST_READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero")


class HostReadCounter:
    """Counts host reads of tensor values while active (a context manager; not re-entrant).

    Attributes:
        counts: reads by kind (method name, or ``"boolean mask index"``).
        sites: reads by call site, the innermost frame inside ``package`` (else ``"(outside)"``).
    """

    def __init__(self, package: str = "lpa3_lightning") -> None:
        self.package = package
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}
        self._local = threading.local()

    @property
    def total(self) -> int:
        """All reads counted so far."""
        return sum(self.counts.values())

    def _record(self, kind: str) -> None:
        if getattr(self._local, "inside", False):
            return  # a read made by another counted read (e.g. __bool__ calling item)
        self._local.inside = True
        try:
            self.counts[kind] += 1
            site = "(outside)"
            for frame in reversed(traceback.extract_stack()[:-2]):
                if f"/{self.package}/" in frame.filename.replace("\\", "/") and "host_reads.py" not in frame.filename:
                    site = f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"
                    break
            self.sites[site] += 1
        finally:
            self._local.inside = False

    def _wrap(self, name: str, original: Any) -> Any:
        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._record(name)
            return original(tensor, *args, **kwargs)

        return wrapped

    def __enter__(self) -> HostReadCounter:
        if self._saved:
            raise RuntimeError("HostReadCounter is already active. Fix: use one `with` block at a time.")
        tensor = torch.Tensor
        for name in (*HOST_READS, "__getitem__", "__setitem__"):
            self._saved[name] = getattr(tensor, name)
        for name in HOST_READS:
            setattr(tensor, name, self._wrap(name, self._saved[name]))
        getitem, setitem = self._saved["__getitem__"], self._saved["__setitem__"]

        def is_mask(index: Any) -> bool:
            parts = index if isinstance(index, tuple) else (index,)
            return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)

        def masked_getitem(t: torch.Tensor, index: Any) -> Any:
            if is_mask(index):
                self._record("boolean mask index")
            return getitem(t, index)

        def masked_setitem(t: torch.Tensor, index: Any, value: Any) -> Any:
            # a scalar written through a mask is a masked_fill (no read); a tensor of values is not
            if is_mask(index) and isinstance(value, torch.Tensor) and value.dim() > 0:
                self._record("boolean mask index")
            return setitem(t, index, value)

        tensor.__getitem__ = masked_getitem  # type: ignore[method-assign]
        tensor.__setitem__ = masked_setitem  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}
