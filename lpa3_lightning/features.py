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

import contextlib
import fnmatch
import math
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lpa3_lightning.dual_bn import _dual_layers

__all__ = [
    "eval_mode",
    "PerceptualFeatures",
    "default_feature_layers",
    "normalize_activation",
    "output_to_logits",
    "resolve_layers",
    "unwrap_compiled",
]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` for the block, then every module's own ``training`` flag back.

    Restoring each flag (not ``model.train(previous)``) keeps a submodule the user froze in
    eval mode frozen: the attack never changes the train/eval mode of anything.
    """
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, training in flags:
            m.training = training

#: eps added to the channel norm, as in the authors' code (docs/method.md).
FEATURE_EPS = 1e-10

#: Samples of the example input used by the probe forward (cheap; what fires does not depend on N).
PROBE_SAMPLES = 2

_RESIDUAL_STAGE = re.compile(r"layer\d+")  # torchvision ResNet and our MedMNIST ResNets
_WRN_BLOCK = re.compile(r"block\d+")  # Wide-ResNet stages
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_SEQUENCE = (nn.MultiheadAttention, nn.RNNBase)  # modules with a ``batch_first`` token layout
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called, so their hooks never fire


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


def _first_tensor(output: Any) -> Tensor | None:
    """The activation of a module output: the tensor itself, or the first tensor of a tuple/list.

    Blocks may return ``(out, aux)``; recurrent layers return ``(output, h_n)`` and
    ``nn.MultiheadAttention`` returns ``(attn_output, weights)``: the first tensor is the activation.
    """
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, Tensor)), None)
    return None


def _token_batch_first(modules: dict[str, nn.Module], name: str) -> bool | None:
    """Whether module ``name`` emits token sequences, and in which layout.

    Returns:
        None for channel-first activations; for token sequences (channel-last when 3-D) the
        ``batch_first`` flag of the attention/recurrent module that decides the layout: the
        module itself or its first such descendant, else the attention held by the nearest
        enclosing transformer block (a non-root module with an ``nn.MultiheadAttention`` child).
    """
    module = modules[name]
    if isinstance(module, _CONVS):
        return None  # (N, C, L) even inside a transformer block (e.g. a conformer's conv module)
    own = next((m for m in module.modules() if isinstance(m, _SEQUENCE)), None)
    if own is not None:
        return bool(own.batch_first)
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):  # nearest ancestor first; the root is no block
        ancestor = modules.get(".".join(parts[:depth]))
        if ancestor is None:
            continue
        attention = next((c for c in ancestor.children() if isinstance(c, nn.MultiheadAttention)), None)
        if attention is not None:
            return bool(attention.batch_first)
    return None


def _batch_major(activation: Tensor, batch_first: bool | None) -> Tensor:
    """``(L, N, D)`` token sequences of a ``batch_first=False`` module as ``(N, L, D)``."""
    if batch_first is False and activation.dim() == 3:
        return activation.transpose(0, 1)
    return activation


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
    parameter or ``.grad`` moves), BatchNorm running statistics do not move in eval mode, the
    twin BatchNorms' frozen-statistics capture is restored (the solver's first real forward
    must still capture the whole batch's statistics), and the global RNG streams are forked.

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
            layouts[name] = _token_batch_first(modules, name)
        return layouts[name] is False and activation.dim() == 3 and activation.shape[1] == n

    def run(grad: bool) -> None:
        seen: set[str] = set()
        refused: set[str] = set()
        refs: dict[str, weakref.ref] = {}

        def make_hook(name: str) -> Callable[..., None]:
            def hook(_module: nn.Module, inputs: Any, output: Any) -> None:
                activation = _first_tensor(output)
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

    twins = [(layer, layer._twin_frozen) for layer in _dual_layers(model)]
    devices = [x.device.index if x.device.index is not None else torch.cuda.current_device()] if x.is_cuda else []
    try:
        with eval_mode(model), torch.random.fork_rng(devices=devices):
            run(grad=False)
            run(grad=True)
    finally:
        for layer, frozen in twins:
            layer._twin_frozen = frozen
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
    for kinds in (nn.RNNBase, _CONVS):
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
    norm = activation.pow(2).sum(dim=channel_dim, keepdim=True).sqrt() + eps
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
        self._layouts = [_token_batch_first(modules, name) for name in names]
        self._resolved = True

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if not self._resolved:
            self._bind(resolve_layers(self.model, None, example_input=x))
        captured: list[Tensor | None] = [None] * len(self._hooked)

        def make_hook(slot: int) -> Callable[..., None]:
            def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
                captured[slot] = _first_tensor(output)

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
                activation = _batch_major(activation, batch_first)
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
