"""Perceptual features from the model's own layers (an LPIPS-style distance, no extra network; Sec. 4).

Each chosen layer's activation, captured by forward hooks, is normalised per position
(:func:`normalize_activation`) and flattened; the layers are concatenated. Token sequences (3-D outputs of
attention and recurrent layers, of modules holding one, and inside a transformer block) are channel-last,
``(L, N, D)`` transposed first; every other activation is channel-first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lpa3_lightning.core.checks import batch_major, first_tensor, output_to_logits, token_batch_first
from lpa3_lightning.core.feature_layers import resolve_layers

__all__ = ["PerceptualFeatures", "normalize_activation"]


#: eps added to the channel norm, as in the authors' code (docs/method.md).
FEATURE_EPS = 1e-10


def normalize_activation(activation: Tensor, eps: float = FEATURE_EPS, channels_last: bool = False) -> Tensor:
    """``(N, C * #positions)``: each position's channel vector of ``activation`` (``(N, C, *spatial)``; with
    ``channels_last``, ``(N, *positions, C)``) divided by its L2 norm (+ ``eps``), everything by
    ``sqrt(#positions)``, flattened. ValueError without a batch and a channel dim."""
    if activation.dim() < 2:
        raise ValueError(f"A feature activation needs a batch and a channel dim, got {tuple(activation.shape)}.")
    # the sum of squares clamped at the dtype's smallest normal number: the square root's infinite
    # derivative at 0 (a position of all-zero channels) sent NaN into the backward, and through it to x'
    squares = activation.pow(2).sum(dim=-1 if channels_last else 1, keepdim=True)
    norm = squares.clamp_min(torch.finfo(squares.dtype).tiny).sqrt() + eps
    positions = math.prod(activation.shape[1:-1]) if channels_last else math.prod(activation.shape[2:])
    return (activation / (norm * positions**0.5)).flatten(1)


class PerceptualFeatures:
    """``(logits, features)`` of one ``model(x)`` with forward hooks on the chosen layers (removed, and the
    activations released, before the call returns, also when the forward raises).

    Args:
        model: the network (not modified, no wrapper needed).
        layers: module names or glob patterns, resolved at construction; None for the default layers, probed
            with the first call's input and kept.
        logits_fn: maps the model output to logits (dicts, tuples, dataclasses); default: a tensor is required.
        eps: added to the channel norm.

    Raises:
        ValueError: when no layer matches (listing the available names; ``layers=None``: at construction
            when the structure offers none, else at the first call when none fires).

    Example:
        >>> import torchvision
        >>> feats = PerceptualFeatures(torchvision.models.resnet18(num_classes=3))
        >>> feats.layer_names
        ['layer1', 'layer2', 'layer3', 'layer4']
        >>> logits, phi = feats(torch.randn(2, 3, 32, 32))
        >>> tuple(logits.shape), phi.dim()
        ((2, 3), 2)
    """

    def __init__(self, model: nn.Module, layers: str | Sequence[str] | None = None,
                 logits_fn: Callable[[Any], Tensor] | None = None, eps: float = FEATURE_EPS) -> None:
        self.model, self.logits_fn, self.eps = model, logits_fn or output_to_logits, eps
        self._resolved = False
        self._hooked: list[nn.Module] = []
        self._layouts: list[bool | None] = []
        if layers is None:  # the structural rules now (no candidate fails at once), the probe at the first call
            self._names = resolve_layers(model, None)
        else:
            self._bind(resolve_layers(model, layers))

    @property
    def layer_names(self) -> list[str]:
        """The feature layers' names (with ``layers=None``, the unprobed choice until the first call)."""
        return list(self._names)

    def _bind(self, names: list[str]) -> None:
        modules = dict(self.model.named_modules())
        self._names = names
        self._hooked = [modules[name] for name in names]
        self._layouts = [token_batch_first(modules, name) for name in names]
        self._resolved = True

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if not self._resolved:
            self._bind(resolve_layers(self.model, None, example_input=x))
        captured: list[Tensor | None] = [None] * len(self._hooked)

        def make_hook(slot: int) -> Callable[..., None]:
            def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
                captured[slot] = first_tensor(output)

            return hook

        handles = [m.register_forward_hook(make_hook(i)) for i, m in enumerate(self._hooked)]
        try:
            logits = self.logits_fn(self.model(x))
            missing = [n for n, a in zip(self._names, captured) if a is None]
            if missing:
                raise RuntimeError(f"Feature layers {missing} did not run in the forward pass (or returned no tensor). "
                                   "Fix: choose layers that the forward of the model uses, via `layers=`.")
            parts = []
            for name, activation, batch_first in zip(self._names, captured, self._layouts):
                activation = batch_major(activation, batch_first)
                if activation.dim() > 0 and x.dim() > 0 and activation.shape[0] != x.shape[0]:
                    raise RuntimeError(f"Feature layer {name!r} returned shape {tuple(activation.shape)}, whose first "
                                       f"dim is not the batch size {x.shape[0]}. Fix: choose layers with batch-major "
                                       "activations via `layers=`.")
                tokens = batch_first is not None and activation.dim() == 3
                parts.append(normalize_activation(activation, self.eps, channels_last=tokens))
            features = torch.cat(parts, dim=1)
        finally:
            for handle in handles:
                handle.remove()
            captured.clear()  # release the activations (and their graphs) promptly
        return logits, features
