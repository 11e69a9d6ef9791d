"""Which layers' activations make the perceptual features: the documented default (found by
one probe forward: the residual stages, attention blocks, or the convolutions) and names or
glob patterns given by the user."""

from __future__ import annotations

import fnmatch
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lpa3_lightning.core.batch_statistics import capture_kept
from lpa3_lightning.core.model_outputs import CONV_TYPES, eval_mode, first_tensor, token_batch_first

__all__ = ["default_feature_layers", "resolve_layers"]


#: Samples of the example input used by the probe forward (cheap; what fires does not depend on N).
PROBE_SAMPLES = 2
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called, so their hooks never fire

_RESIDUAL_STAGE = re.compile(r"layer\d+")  # torchvision ResNet and our MedMNIST ResNets

_WRN_BLOCK = re.compile(r"block\d+")  # Wide-ResNet stages


@dataclass
class _Probe:
    """What one probe saw: modules with a usable activation in both solver modes, and more."""

    #: usable in the no-grad and the grad forward, with the position of its first call
    order: dict[str, int] = field(default_factory=dict)
    #: modules that returned one of their inputs (identity, dropout in eval, in-place ops)
    passthrough: set[str] = field(default_factory=set)
    #: modules whose activation is the model's output tensor (the logits head)
    produces_output: set[str] = field(default_factory=set)
    #: activation shapes in the no-grad forward
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: shape of the model output when it is a tensor
    output_shape: tuple[int, ...] | None = None


def _probe(model: nn.Module, example_input: Tensor) -> _Probe:
    """Run the model on the first samples of ``example_input`` as the solver does and record hooks.

    Two forwards with a hook on every module, the model in eval mode (as in the solver): one under
    ``torch.no_grad()`` (the solver's clean forward) and one with an input that requires grad
    (its later forwards). A fused fast path can skip submodules in one of them (e.g.
    ``nn.TransformerEncoderLayer`` in eval mode under no_grad), and ``nn.MultiheadAttention``
    never calls its ``out_proj`` (it uses the weights directly), so only modules that fire with
    a usable activation (float, batch dim N first, or second for ``batch_first=False`` token
    sequences) in both forwards qualify. Hooks may themselves switch a fast path off (current
    torch runs ``nn.TransformerEncoderLayer``'s only when no hook is attached inside the layer);
    that depends on hooks inside the layer only, so a module that fires here, with every module
    hooked, also fires when only the chosen ones are.

    Nothing of the model changes: every train/eval flag is restored, no backward runs (no
    parameter or ``.grad`` moves), BatchNorm running statistics do not move in eval mode, a
    frozen-statistics capture in progress is kept for the solver's first real forward
    (:func:`~lpa3_lightning.core.batch_statistics.capture_kept`), and the global RNG streams are forked.

    Raises:
        TypeError: if ``example_input`` is not a tensor.
    """
    if not isinstance(example_input, Tensor):
        raise TypeError(
            f"`example_input` must be a tensor (a batch of model inputs), got {type(example_input).__name__}."
        )
    x = example_input.detach()[:PROBE_SAMPLES]
    n = x.shape[0] if x.dim() > 0 else 0
    modules = dict(model.named_modules())
    result = _Probe()
    usable_in: list[set[str]] = []
    layouts: dict[str, bool | None] = {}

    def usable(name: str, activation: Tensor | None) -> bool:
        if activation is None or not activation.is_floating_point() or activation.is_nested:
            return False
        if activation.layout != torch.strided or activation.dim() < 2:
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
                    outputs = [output]
                    result.output_shape = tuple(output.shape)
                elif isinstance(output, dict):
                    outputs = [o for o in output.values() if isinstance(o, Tensor)]
                else:
                    outputs = [o for o in output if isinstance(o, Tensor)] if isinstance(output, (tuple, list)) else []
                # the weak references of the head's activation are alive: the output holds it
                result.produces_output.update(
                    name for name, ref in refs.items() if any(ref() is o for o in outputs))
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


def _outermost(names: list[str]) -> list[str]:
    """Drop names nested in another name of the list (their activation is part of the outer one)."""
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


def _attention_blocks(named: list[tuple[str, nn.Module]], fires: Callable[[str], bool]) -> list[str]:
    """The module holding each ``nn.MultiheadAttention``: one transformer block / encoder layer each."""
    modules = dict(named)
    blocks: list[str] = []
    for name, module in named:
        if not isinstance(module, nn.MultiheadAttention):
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        # the attention itself when its parent is the root model or a container (never called)
        block = parent if parent and not isinstance(modules[parent], _CONTAINERS) and fires(parent) else name
        if fires(block) and block not in blocks:
            blocks.append(block)
    return _outermost(blocks)


def _fallback(named: list[tuple[str, nn.Module]], probe: _Probe | None) -> list[str]:
    """The deepest modules with an activation, except the logits head.

    With a probe: the modules that fire with a float batch-major activation in both forwards and
    have no such descendant, minus modules returning their input unchanged and the module whose
    output is the model's output (else the last to fire with the output's shape). Without one:
    every leaf module but the last registered one (taken to be the head).
    """
    if probe is None:
        leaves = [n for n, m in named if next(m.children(), None) is None and not isinstance(m, _CONTAINERS)]
        return leaves[:-1]
    firing = list(probe.order)
    deepest = [n for n in firing if not any(o.startswith(n + ".") for o in firing)]
    deepest = [n for n in deepest if n not in probe.passthrough]
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
    """The documented default choice of feature layers for ``model``.

    In order of preference (the first rule that finds a module wins):

    1. residual stages named ``layer1``, ``layer2``, ... (torchvision ResNets and this
       project's MedMNIST ResNets), as the authors use for PreAct-ResNet18;
    2. stages named ``block1``, ``block2``, ... (Wide-ResNets), as the authors use for WRN-28;

    (for 1 and 2 the shallowest such modules, so a wrapper holding the network finds them);
    3. transformer blocks: the module holding each ``nn.MultiheadAttention`` (every
       ``nn.TransformerEncoderLayer`` / ``DecoderLayer``, every torchvision ViT ``EncoderBlock``),
       i.e. the output of each encoder layer;
    4. recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): their output sequence (the top
       layer's hidden state at every time step);
    5. every convolution (plain CNNs, MobileNets, EfficientNets);
    6. every ``nn.Linear`` except the last one registered (MLPs on tabular data or signals;
       the last linear is taken to be the classification head);
    7. a generic fallback: the deepest modules producing an activation, except the head.

    Without ``example_input`` the rules read the structure only (cheap, for early validation);
    with it, the model is probed (see :func:`resolve_layers`) and each rule keeps only modules
    whose forward hooks fire, with a float activation whose batch dim is N, both under
    ``torch.no_grad()`` and with an input requiring grad, the model in eval mode. So a module the
    forward never calls (``nn.MultiheadAttention.out_proj``, whose weights are used directly)
    or skips in a fused fast path is never chosen.

    Args:
        model: the network whose own activations define the perceptual space.
        example_input: a batch of inputs to probe with (only its first 2 samples are used);
            None for the structural rules alone.

    Returns:
        Module names as in ``model.named_modules()``; empty when nothing qualifies.

    Raises:
        TypeError: if ``example_input`` is not a tensor.
    """
    named = [(name, m) for name, m in model.named_modules() if name]
    probe = None if example_input is None else _probe(model, example_input)

    def fires(name: str) -> bool:
        return probe is None or name in probe.order

    names = [name for name, _ in named if fires(name)]
    for pattern in (_RESIDUAL_STAGE, _WRN_BLOCK):
        # the shallowest stages, so that a wrapper (e.g. a LightningModule holding the
        # network as ``self.model``) finds ``model.layer1`` ... as well
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
    if len(linears) > 1:
        return linears[:-1]
    return _fallback(named, probe)


def resolve_layers(
    model: nn.Module, layers: str | Sequence[str] | None, example_input: Tensor | None = None
) -> list[str]:
    """Resolve exact names or ``fnmatch`` patterns (``"layer[1-4]"``, ``"features.?"``) to names.

    Patterns follow :mod:`fnmatch`: ``*`` also matches dots, so ``"layer*"`` selects every
    submodule of the stages too; use ``"layer?"`` or ``"layer[1-4]"`` for the stages alone.

    Args:
        model: the network.
        layers: None for :func:`default_feature_layers`, or names / glob patterns.
        example_input: for ``layers=None``, a batch to probe the default choice with: the
            model runs twice on its first 2 samples, in eval mode, under ``torch.no_grad()``
            and with an input requiring grad (the solver's two kinds of forward); flags,
            parameters, ``.grad``, BatchNorm statistics and RNG streams are left as they were.
            None: the structural rules alone. Explicit ``layers`` are not probed.

    Raises:
        ValueError: naming ``layers=`` and listing the available module names when no default
            layer qualifies (or, with ``example_input``, none fires), or when a pattern
            matches nothing.
        TypeError: if ``example_input`` is not a tensor.
    """
    available = [name for name, _ in model.named_modules() if name]
    if layers is None:
        chosen = default_feature_layers(model, example_input)
        if not chosen:
            if example_input is None:
                reason = ("(no `layerN`/`blockN` stage, attention block, recurrent layer, convolution, hidden "
                          "nn.Linear or module before the head)")
            else:
                reason = ("that produces a float activation with the batch dim first in a forward pass in eval mode "
                          "(probed under torch.no_grad() and with an input requiring grad)")
            raise ValueError(
                f"No default feature layer found in {type(model).__name__} {reason}. Fix: pass `layers=` with "
                f"module names or patterns. Available names: {available}"
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
