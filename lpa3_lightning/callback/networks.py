"""Several networks in one module (DivideMix's two): one LP-A3 protocol view per named network.

A module with one network (the usual case) implements the protocol of
:class:`~lpa3_lightning.mixins.LPA3ModuleMixin` as it is. A module that trains several
networks, each needing its own time-consistency memory, selection, twin BatchNorms and ``x'``
cache, names them in ``lpa3_networks()`` and accepts a ``network=`` keyword in the protocol
methods (the mixin's defaults already do). :class:`NetworkView` then presents one named network
as a single-network module, so :class:`~lpa3_lightning.LPA3Callback` runs its unchanged
per-batch path once per network, with a state of its own for each.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NetworkView", "module_networks"]


def module_networks(module: Any) -> tuple[str, ...] | None:
    """The network names a module declares in ``lpa3_networks()``, or None for a single network.

    Raises:
        ValueError: if the names are not a non-empty sequence of distinct non-empty strings.
    """
    declare = getattr(module, "lpa3_networks", None)
    if not callable(declare):
        return None
    names = declare()
    if names is None:
        return None
    names = tuple(names) if isinstance(names, (list, tuple)) else names
    if not isinstance(names, tuple) or not names or not all(isinstance(n, str) and n for n in names) \
            or len(set(names)) != len(names) or any("/" in n for n in names):
        raise ValueError(
            f"{type(module).__name__}.lpa3_networks() must return distinct non-empty names without '/', e.g. "
            f"('net1', 'net2'), got {names!r}. Fix: return one name per network, or None for a single network."
        )
    return names


class NetworkView:
    """One named network of a multi-network module, seen as a single-network LP-A3 module.

    The protocol methods forward to the module's with ``network=name``; every other attribute
    (``log``, ``device``, ``lpa3_num_classes``, ...) is the module's own.

    Args:
        module: the LightningModule that declares ``lpa3_networks()``.
        name: one of the declared names.
    """

    def __init__(self, module: Any, name: str) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_network", name)

    def __getattr__(self, attr: str) -> Any:
        if attr in ("_module", "_network") or (attr.startswith("__") and attr.endswith("__")):
            raise AttributeError(attr)  # (copy and pickle look these up on an empty instance)
        return getattr(self._module, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._module, attr, value)

    def __repr__(self) -> str:
        return f"{type(self._module).__name__}[network={self._network!r}]"

    @property
    def lpa3_network(self) -> str:
        return self._network

    def lpa3_request(self, batch: Any) -> Any:
        return self._module.lpa3_request(batch, network=self._network)

    def lpa3_model(self) -> Any:
        return self._module.lpa3_model(network=self._network)

    def lpa3_set_augmented(self, augmented: Any) -> None:
        if augmented is not None:
            augmented.network = self._network  # the module's forward of x' picks this network
        self._module.lpa3_set_augmented(augmented, network=self._network)

    def lpa3_augmented_pending(self) -> bool:
        return bool(self._module.lpa3_augmented_pending(network=self._network))

    def lpa3_pop_predictions(self) -> Any:
        return self._module.lpa3_pop_predictions(network=self._network)

    def lpa3_pop_augmented_logits(self) -> Any:
        return self._module.lpa3_pop_augmented_logits(network=self._network)
