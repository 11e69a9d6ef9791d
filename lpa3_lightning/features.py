"""Perceptual features from the model's own layers (an LPIPS-style distance, no extra network).

LP-A3 measures how far an augmented input ``x'`` moved from ``x`` in the perceptual space of
the very model being trained (Yang et al., NeurIPS 2022, Sec. 4): each chosen layer's
activation is divided by its per-position channel L2 norm and by ``sqrt(H*W)``, flattened,
and all layers are concatenated. Activations are captured with forward hooks, so any
unmodified :class:`torch.nn.Module` works; the hooks live only for the duration of one call.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "PerceptualFeatures",
    "default_feature_layers",
    "normalize_activation",
    "output_to_logits",
    "resolve_layers",
    "unwrap_compiled",
]

#: eps added to the channel norm, as in the authors' code (METHOD.md).
FEATURE_EPS = 1e-10

_RESIDUAL_STAGE = re.compile(r"layer\d+")  # torchvision ResNet and our MedMNIST ResNets
_WRN_BLOCK = re.compile(r"block\d+")  # Wide-ResNet stages
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The eager module behind ``torch.compile`` wrappers (hooks need the eager submodules)."""
    compiled = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(compiled, "OptimizedModule", None)
    while optimized is not None and isinstance(model, optimized):
        model = model._orig_mod
    return model


def output_to_logits(output: Any) -> Tensor:
    """Return the logits tensor of a model output, refusing anything ambiguous.

    Args:
        output: what ``model(x)`` returned.

    Raises:
        TypeError: if the output is not a tensor.
    """
    if isinstance(output, Tensor):
        return output
    raise TypeError(
        f"The model returned {type(output).__name__}, but LP-A3 needs the logits tensor. "
        "Fix: pass `logits_fn=` (a callable mapping the model output to logits, e.g. "
        "`lambda out: out['logits']`), override `lpa3_logits(output)` in a LightningModule using "
        "LPA3Callback, or make forward() return the logits."
    )


def default_feature_layers(model: nn.Module) -> list[str]:
    """The documented default choice of feature layers for ``model``.

    In order of preference:

    1. residual stages named ``layer1``, ``layer2``, ... (torchvision ResNets and this
       project's MedMNIST ResNets), as the authors use for PreAct-ResNet18;
    2. stages named ``block1``, ``block2``, ... (Wide-ResNets), as the authors use for WRN-28;

    (for 1 and 2 the shallowest such modules, so a wrapper holding the network finds them);
    3. every convolution (plain CNNs);
    4. every ``nn.Linear`` except the last one registered (MLPs on tabular data or signals;
       the last linear is taken to be the classification head).

    Args:
        model: the network whose own activations define the perceptual space.

    Returns:
        Module names as in ``model.named_modules()``; empty when nothing qualifies.
    """
    names = [name for name, _ in model.named_modules() if name]
    for pattern in (_RESIDUAL_STAGE, _WRN_BLOCK):
        # the shallowest stages, so that a wrapper (e.g. a LightningModule holding the
        # network as ``self.model``) finds ``model.layer1`` ... as well
        stages = [name for name in names if pattern.fullmatch(name.rsplit(".", 1)[-1])]
        if stages:
            depth = min(name.count(".") for name in stages)
            return [name for name in stages if name.count(".") == depth]
    convs = [name for name, m in model.named_modules() if isinstance(m, _CONVS)]
    if convs:
        return convs
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return linears[:-1]


def resolve_layers(model: nn.Module, layers: str | Sequence[str] | None) -> list[str]:
    """Resolve exact names or ``fnmatch`` patterns (``"layer[1-4]"``, ``"features.?"``) to names.

    Patterns follow :mod:`fnmatch`: ``*`` also matches dots, so ``"layer*"`` selects every
    submodule of the stages too; use ``"layer?"`` or ``"layer[1-4]"`` for the stages alone.

    Args:
        model: the network.
        layers: None for :func:`default_feature_layers`, or names / glob patterns.

    Raises:
        ValueError: naming the patterns and listing the available module names when a
            pattern matches nothing.
    """
    available = [name for name, _ in model.named_modules() if name]
    if layers is None:
        chosen = default_feature_layers(model)
        if not chosen:
            raise ValueError(
                f"No default feature layer found in {type(model).__name__} (no `layerN`/`blockN` "
                "stage, convolution or hidden nn.Linear). Fix: pass `layers=` with module names "
                f"or patterns. Available names: {available}"
            )
        return chosen
    patterns = [layers] if isinstance(layers, str) else list(layers)
    if not patterns:
        raise ValueError("`layers` is empty. Fix: pass None for the default or at least one name.")
    chosen: list[str] = []
    for pattern in patterns:
        hits = [n for n in available if n == pattern or fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"`layers` pattern {pattern!r} matches no module of {type(model).__name__}. "
                f"Fix: use one of the available names (or a glob over them): {available}"
            )
        chosen.extend(h for h in hits if h not in chosen)
    return chosen


def normalize_activation(activation: Tensor, eps: float = FEATURE_EPS) -> Tensor:
    """LPIPS-style normalisation of one layer's activation, flattened to ``(N, D)``.

    Shape:
        - activation: ``(N, C, *spatial)`` or ``(N, C)``.
        - output: ``(N, C * prod(spatial))``.
    """
    if activation.dim() < 2:
        raise ValueError(f"A feature activation needs a batch and a channel dim, got {tuple(activation.shape)}.")
    norm = activation.pow(2).sum(dim=1, keepdim=True).sqrt() + eps
    positions = math.prod(activation.shape[2:])  # H*W (1 for vector activations)
    return (activation / (norm * positions**0.5)).flatten(1)


class PerceptualFeatures:
    """Capture the perceptual features of chosen layers of an unmodified model.

    Calling the object runs ``model(x)`` once with forward hooks on the chosen layers and
    returns ``(logits, features)``; the hooks are removed and the captured activations
    released before the call returns, also when the forward raises.

    Args:
        model: the network (not modified, no wrapper needed).
        layers: module names or glob patterns; None for :func:`default_feature_layers`.
        logits_fn: maps the model output to logits (for models returning dicts, tuples or
            dataclasses); defaults to requiring a tensor.
        eps: added to the channel norm.

    Raises:
        ValueError: when no layer matches (the message lists the available names).

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
        self.layer_names = resolve_layers(model, layers)
        self.logits_fn = logits_fn or output_to_logits
        self.eps = eps
        modules = dict(model.named_modules())
        self._modules = [modules[name] for name in self.layer_names]

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor]:
        captured: list[Tensor | None] = [None] * len(self._modules)

        def make_hook(slot: int) -> Callable[..., None]:
            def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
                # Blocks may return tuples (e.g. (out, aux)); the first tensor is the activation.
                if not isinstance(output, Tensor):
                    output = next((o for o in output if isinstance(o, Tensor)), None)
                captured[slot] = output

            return hook

        handles = [m.register_forward_hook(make_hook(i)) for i, m in enumerate(self._modules)]
        try:
            logits = self.logits_fn(self.model(x))
            missing = [n for n, a in zip(self.layer_names, captured) if a is None]
            if missing:
                raise RuntimeError(
                    f"Feature layers {missing} did not run in the forward pass (or returned no tensor). "
                    "Fix: choose layers that the forward of the model uses, via `layers=`."
                )
            features = torch.cat([normalize_activation(a, self.eps) for a in captured], dim=1)
        finally:
            for handle in handles:
                handle.remove()
            captured.clear()  # release the activations (and their graphs) promptly
        return logits, features
