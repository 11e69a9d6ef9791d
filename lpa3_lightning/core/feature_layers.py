"""Which layers' activations make the perceptual features: the documented default (refined by one probe
forward) and names or glob patterns given by the user."""

from __future__ import annotations

import fnmatch
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lpa3_lightning.core.checks import CONV_TYPES, eval_mode, first_tensor, token_batch_first
from lpa3_lightning.core.forward_modes import capture_kept

__all__ = ["default_feature_layers", "resolve_layers"]


#: Samples of the example input used by the probe forward (cheap; what fires does not depend on N).
PROBE_SAMPLES = 2
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called, so their hooks never fire
_RESIDUAL_STAGE = re.compile(r"layer\d+")  # torchvision ResNet and our MedMNIST ResNets
_WRN_BLOCK = re.compile(r"block\d+")  # Wide-ResNet stages


@dataclass
class _Probe:
    """What one probe saw: ``order`` (the modules usable in both forwards, by first call), ``passthrough``
    (returned one of their inputs: identity, dropout in eval, in-place ops), ``produces_output`` (gave the
    model's output tensor), ``shapes`` (in the no-grad forward) and ``output_shape`` (of a tensor output)."""

    order: dict[str, int] = field(default_factory=dict)
    passthrough: set[str] = field(default_factory=set)
    produces_output: set[str] = field(default_factory=set)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    output_shape: tuple[int, ...] | None = None


def _probe(model: nn.Module, example_input: Tensor) -> _Probe:
    """Hooks on every module in two eval-mode forwards of the first samples of ``example_input``, under
    ``torch.no_grad()`` and with an input requiring grad: a fused fast path can skip submodules in one of
    them, so only modules with a usable activation (float, batch dim N first, or second for
    ``batch_first=False`` tokens) in both qualify. The model's state is untouched; RNG streams are forked."""
    if not isinstance(example_input, Tensor):
        raise TypeError(f"`example_input` must be a tensor (a batch of model inputs), got "
                        f"{type(example_input).__name__}.")
    x = example_input.detach()[:PROBE_SAMPLES]
    n = x.shape[0] if x.dim() > 0 else 0
    modules = dict(model.named_modules())
    result = _Probe()
    usable_in: list[set[str]] = []
    layouts: dict[str, bool | None] = {}

    def usable(name: str, activation: Tensor | None) -> bool:
        if activation is None or not activation.is_floating_point() or activation.is_nested \
                or activation.layout != torch.strided or activation.dim() < 2:
            return False
        if activation.shape[0] == n:
            return True
        if name not in layouts:  # only for the rare (L, N, D) outputs: the check walks the model
            layouts[name] = token_batch_first(modules, name)
        return layouts[name] is False and activation.dim() == 3 and activation.shape[1] == n

    def run(grad: bool) -> None:
        seen: set[str] = set()
        refused: set[str] = set()
        refs: dict[str, weakref.ref] = {}

        def make_hook(name: str) -> Callable[..., None]:
            def hook(_module: nn.Module, inputs: Any, output: Any) -> None:
                activation = first_tensor(output)
                if name not in seen:
                    seen.add(name)
                    if not grad:
                        result.order.setdefault(name, len(result.order))
                if not usable(name, activation):
                    refused.add(name)  # one unusable call spoils it: the features take the last call
                    return
                if not grad:
                    result.shapes[name] = tuple(activation.shape)
                    refs[name] = weakref.ref(activation)  # no reference kept: memory stays flat
                    if any(activation is i for i in inputs):
                        result.passthrough.add(name)

            return hook

        handles = [m.register_forward_hook(make_hook(name)) for name, m in modules.items() if name]
        try:
            if grad:
                with torch.enable_grad():
                    model(x.clone().requires_grad_(x.is_floating_point()))
            else:
                with torch.no_grad():
                    output = model(x)
                if isinstance(output, Tensor):
                    result.output_shape = tuple(output.shape)
                values = [output] if isinstance(output, Tensor) else list(output.values()) \
                    if isinstance(output, dict) else list(output) if isinstance(output, (tuple, list)) else []
                outputs = [o for o in values if isinstance(o, Tensor)]
                # the weak references of the head's activation are alive: the output holds it
                result.produces_output.update(name for name, ref in refs.items() if any(ref() is o for o in outputs))
        finally:
            for handle in handles:
                handle.remove()
        usable_in.append(seen - refused)

    devices = [x.device.index if x.device.index is not None else torch.cuda.current_device()] if x.is_cuda else []
    with eval_mode(model), torch.random.fork_rng(devices=devices), capture_kept(model):
        run(grad=False)
        run(grad=True)
    both = usable_in[0] & usable_in[1]
    result.order = {name: i for name, i in result.order.items() if name in both}
    return result


def _attention_blocks(named: list[tuple[str, nn.Module]], fires: Callable[[str], bool]) -> list[str]:
    """The module holding each ``nn.MultiheadAttention`` (one transformer block each), the outermost ones."""
    modules = dict(named)
    blocks: list[str] = []
    for name in (n for n, m in named if isinstance(m, nn.MultiheadAttention)):
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        # the attention itself when its parent is the root model or a container (never called)
        block = parent if parent and not isinstance(modules[parent], _CONTAINERS) and fires(parent) else name
        if fires(block) and block not in blocks:
            blocks.append(block)
    return [b for b in blocks if not any(b.startswith(o + ".") for o in blocks if o != b)]  # (nested: part of it)


def _fallback(named: list[tuple[str, nn.Module]], probe: _Probe | None) -> list[str]:
    """The deepest modules with an activation but the head: probed, those firing with no firing descendant
    that neither return their input nor give the model's output (else: the last with the output's shape);
    unprobed, every leaf module but the last registered one."""
    if probe is None:
        leaves = [n for n, m in named if next(m.children(), None) is None and not isinstance(m, _CONTAINERS)]
        return leaves[:-1]
    firing = list(probe.order)
    deepest = [n for n in firing if not any(o.startswith(n + ".") for o in firing) and n not in probe.passthrough]
    if any(n in probe.produces_output for n in deepest):
        deepest = [n for n in deepest if n not in probe.produces_output]
    else:
        # the head's output went through an op outside a module (e.g. logits / T)
        by_call = sorted(deepest, key=probe.order.__getitem__)
        if by_call and probe.output_shape is not None and probe.shapes.get(by_call[-1]) == probe.output_shape:
            deepest.remove(by_call[-1])
    registered = {name: i for i, (name, _) in enumerate(named)}
    return sorted(deepest, key=registered.__getitem__)


def default_feature_layers(model: nn.Module, example_input: Tensor | None = None) -> list[str]:
    """The documented default feature layers of ``model`` (names as in ``named_modules()``; empty: none), by
    the first rule that finds a module: 1. the shallowest stages ``layer1``, ``layer2``, ... (ResNets), 2. or
    ``block1``, ... (Wide-ResNets), as the authors use; 3. the module holding each ``nn.MultiheadAttention``
    (transformer blocks); 4. recurrent layers; 5. every convolution; 6. every ``nn.Linear`` but the last one
    registered (the head); 7. the deepest modules producing an activation, except the head.

    ``example_input``: a batch to probe with (its first 2 samples): each rule then keeps only modules that fire
    with a float activation whose batch dim is N, under ``torch.no_grad()`` and with an input requiring grad,
    in eval mode (TypeError if not a tensor). None: the structure alone.
    """
    named = [(name, m) for name, m in model.named_modules() if name]
    probe = None if example_input is None else _probe(model, example_input)

    def fires(name: str) -> bool:
        return probe is None or name in probe.order

    names = [name for name, _ in named if fires(name)]
    for pattern in (_RESIDUAL_STAGE, _WRN_BLOCK):
        # the shallowest, so that a wrapper (a LightningModule's ``self.model``) finds ``model.layer1`` ... too
        stages = [name for name in names if pattern.fullmatch(name.rsplit(".", 1)[-1])]
        if stages:
            depth = min(name.count(".") for name in stages)
            return [name for name in stages if name.count(".") == depth]
    blocks = _attention_blocks(named, fires)
    if blocks:
        return blocks
    for kinds in (nn.RNNBase, CONV_TYPES):
        found = [name for name, m in named if isinstance(m, kinds) and fires(name)]
        if found:
            return found
    linears = [name for name, m in named if isinstance(m, nn.Linear) and fires(name)]
    return linears[:-1] if len(linears) > 1 else _fallback(named, probe)


def resolve_layers(model: nn.Module, layers: str | Sequence[str] | None,
                   example_input: Tensor | None = None) -> list[str]:
    """Module names for ``layers``: exact names or ``fnmatch`` patterns (``"layer[1-4]"``; ``*`` also matches
    dots), or None for :func:`default_feature_layers` (probed with ``example_input``, model state untouched).

    Raises:
        ValueError: naming ``layers=`` and listing the available module names when no default layer
            qualifies, or when a pattern matches nothing.
        TypeError: if ``example_input`` is not a tensor.
    """
    available = [name for name, _ in model.named_modules() if name]
    if layers is None:
        chosen = default_feature_layers(model, example_input)
        if not chosen:
            reason = ("(no `layerN`/`blockN` stage, attention block, recurrent layer, convolution, hidden nn.Linear "
                      "or module before the head)" if example_input is None else
                      "that produces a float activation with the batch dim first in a forward pass in eval mode "
                      "(probed under torch.no_grad() and with an input requiring grad)")
            raise ValueError(f"No default feature layer found in {type(model).__name__} {reason}. Fix: pass "
                             f"`layers=` with module names or patterns. Available names: {available}")
        return chosen
    patterns = [layers] if isinstance(layers, str) else list(layers)
    if not patterns:
        raise ValueError("`layers` is empty. Fix: pass None for the default or at least one name.")
    chosen = []
    for pattern in patterns:
        hits = [n for n in available if n == pattern or fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"`layers` pattern {pattern!r} matches no module of {type(model).__name__}. "
                             f"Fix: use one of the available names (or a glob over them): {available}")
        chosen.extend(h for h in hits if h not in chosen)
    return chosen
