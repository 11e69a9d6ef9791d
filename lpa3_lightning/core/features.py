"""Perceptual features from the model's own layers (an LPIPS-style distance, no extra network).

LP-A3 measures how far an augmented input ``x'`` moved from ``x`` in the perceptual space of
the very model being trained (Yang et al., NeurIPS 2022, Sec. 4): each chosen layer's
activation is divided by its per-position channel L2 norm and by the square root of the
number of positions, flattened, and all layers are concatenated. Activations are captured
with forward hooks, so any unmodified :class:`torch.nn.Module` works; the hooks live only
for the duration of one call.

Which layers: :func:`default_feature_layers` names them from the model's structure, and, given
an example input, keeps only modules whose forward hooks fire in the solver's conditions (a
"probe"); :class:`PerceptualFeatures` with ``layers=None`` probes with the first batch it sees.

Activation layouts (see :func:`normalize_activation`):

- channel-first ``(N, C, *spatial)`` or ``(N, C)``: convolutions, MLPs, and every module not
  listed next;
- token sequences, channel-last: the 3-D outputs of ``nn.MultiheadAttention`` and recurrent
  layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), of modules holding one (transformer encoder
  layers, torchvision ViT ``EncoderBlock``, wrappers around them), and of modules inside a
  transformer block (e.g. its MLP). ``(N, L, D)`` is used as is; ``(L, N, D)`` (the module's
  ``batch_first`` is False) is transposed first. Each token is normalised over ``D`` and the
  result divided by ``sqrt(L)``: the LPIPS per-position rule with positions = time steps/tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lpa3_lightning.core.feature_layers import resolve_layers
from lpa3_lightning.core.model_outputs import batch_major, first_tensor, output_to_logits, token_batch_first

__all__ = ["PerceptualFeatures", "normalize_activation"]


#: eps added to the channel norm, as in the authors' code (docs/method.md).
FEATURE_EPS = 1e-10


def normalize_activation(activation: Tensor, eps: float = FEATURE_EPS, channels_last: bool = False) -> Tensor:
    """LPIPS-style normalisation of one layer's activation, flattened to ``(N, D)``.

    At every position the channel vector is divided by its L2 norm (+ ``eps``), and everything
    by ``sqrt(#positions)``, so each layer contributes a block of squared norm 1 per sample.

    Args:
        activation: a batch-major activation.
        eps: added to the channel norm.
        channels_last: False: ``(N, C, *spatial)`` (convolutions; ``(N, C)`` vectors), the
            positions are the spatial ones. True: ``(N, *positions, C)``, e.g. token sequences
            ``(N, L, D)`` of transformers and recurrent layers: each token is normalised over
            ``D`` and the result divided by ``sqrt(L)``.

    Shape:
        - activation: ``(N, C, *spatial)``, ``(N, *positions, C)`` or ``(N, C)``.
        - output: ``(N, C * #positions)``, in the activation's memory order.

    Raises:
        ValueError: for an activation without a batch and a channel dim.
    """
    if activation.dim() < 2:
        raise ValueError(f"A feature activation needs a batch and a channel dim, got {tuple(activation.shape)}.")
    channel_dim = -1 if channels_last else 1
    # the square root's derivative is infinite at 0: a position whose channels are all 0 (a
    # bias-free convolution of a ReLU's zeros) sent NaN into any product's backward (mobilenet_v3's
    # squeeze-and-excitation), and through it to every pixel of x'. Clamping the sum of squares
    # at the dtype's smallest normal number leaves every other norm as it was (below it, the
    # norm is eps-dominated either way, the activation 0 or subnormal) and gives those
    # positions a zero gradient through the norm.
    squares = activation.pow(2).sum(dim=channel_dim, keepdim=True)
    norm = squares.clamp_min(torch.finfo(squares.dtype).tiny).sqrt() + eps
    # H*W or L (1 for vector activations)
    positions = math.prod(activation.shape[1:-1]) if channels_last else math.prod(activation.shape[2:])
    return (activation / (norm * positions**0.5)).flatten(1)


class PerceptualFeatures:
    """Capture the perceptual features of chosen layers of an unmodified model.

    Calling the object runs ``model(x)`` once with forward hooks on the chosen layers and
    returns ``(logits, features)``; the hooks are removed and the captured activations
    released before the call returns, also when the forward raises.

    With ``layers=None`` the default layers are resolved lazily: the first call probes the
    model with the first 2 samples of its input (see :func:`resolve_layers`) and the names
    are cached for every later call. Explicit ``layers`` are resolved at construction.

    Args:
        model: the network (not modified, no wrapper needed).
        layers: module names or glob patterns; None for :func:`default_feature_layers`.
        logits_fn: maps the model output to logits (for models returning dicts, tuples or
            dataclasses); defaults to requiring a tensor.
        eps: added to the channel norm.

    Raises:
        ValueError: when no layer matches (the message lists the available names); with
            ``layers=None`` already at construction when the structure offers no candidate,
            else at the first call when no default layer fires.

    Example:
        >>> import torchvision
        >>> net = torchvision.models.resnet18(num_classes=3)
        >>> feats = PerceptualFeatures(net)
        >>> feats.layer_names
        ['layer1', 'layer2', 'layer3', 'layer4']
        >>> logits, phi = feats(torch.randn(2, 3, 32, 32))
        >>> tuple(logits.shape), phi.dim()
        ((2, 3), 2)
    """

    def __init__(
        self,
        model: nn.Module,
        layers: str | Sequence[str] | None = None,
        logits_fn: Callable[[Any], Tensor] | None = None,
        eps: float = FEATURE_EPS,
    ) -> None:
        self.model = model
        self.logits_fn = logits_fn or output_to_logits
        self.eps = eps
        self._resolved = False
        self._names: list[str] = []
        self._hooked: list[nn.Module] = []
        self._layouts: list[bool | None] = []
        if layers is None:
            # Structural rules now: a model without any candidate fails at once; the probe,
            # which needs an input, refines the choice at the first call.
            self._names = resolve_layers(model, None)
        else:
            self._bind(resolve_layers(model, layers))

    @property
    def layer_names(self) -> list[str]:
        """The feature layers' names.

        With ``layers=None`` and before the first call: the structural (unprobed) choice;
        the first call replaces it with the probed one.
        """
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
                raise RuntimeError(
                    f"Feature layers {missing} did not run in the forward pass (or returned no tensor). "
                    "Fix: choose layers that the forward of the model uses, via `layers=`."
                )
            parts = []
            for name, activation, batch_first in zip(self._names, captured, self._layouts):
                activation = batch_major(activation, batch_first)
                if activation.dim() > 0 and x.dim() > 0 and activation.shape[0] != x.shape[0]:
                    raise RuntimeError(
                        f"Feature layer {name!r} returned shape {tuple(activation.shape)}, whose first dim is not "
                        f"the batch size {x.shape[0]}. Fix: choose layers with batch-major activations via `layers=`."
                    )
                tokens = batch_first is not None and activation.dim() == 3
                parts.append(normalize_activation(activation, self.eps, channels_last=tokens))
            features = torch.cat(parts, dim=1)
        finally:
            for handle in handles:
                handle.remove()
            captured.clear()  # release the activations (and their graphs) promptly
        return logits, features
