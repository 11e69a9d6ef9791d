"""The package's checks and its small readings of a model, one definition each (no Lightning).

Settings, the per-sample tensors every stage receives, a model's logits and eval mode, the module behind
``torch.compile``, a layer's batch axis and an epoch's seed. A value is refused with one message wherever it is
given (``lam`` to ``lpa3_attack``, ``solver.lam`` to the callback).
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

__all__ = ["batch_major", "check_choice", "check_class_labels", "check_class_prior", "check_dataset_indices",
           "check_flag", "check_int", "check_number", "check_split_loader_covered", "dataclass_from", "epoch_seed",
           "eval_mode", "first_tensor", "output_to_logits", "token_batch_first", "unwrap_compiled"]

D = TypeVar("D")


def dataclass_from(cls: type[D], value: Any, argument: str, home: Callable[[str], str | None] | None = None) -> D:
    """``value`` as a ``cls``: an instance as it is, a mapping as its fields (the defaults for the others).
    TypeError naming ``argument`` and the fix for another type, or for a key with no field (naming the group
    ``home(key)`` says holds it, or the closest field)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        for key in value:
            if key not in known:
                elsewhere = home(str(key)) if home is not None else None
                close = difflib.get_close_matches(str(key), known, n=1)
                where = (f": it is a setting of the `{elsewhere}` group" if elsewhere is not None
                         else f": did you mean `{close[0]}`?" if close else "")
                raise TypeError(f"`{argument}` has no setting `{key}`{where}. Fix: use the fields of {cls.__name__}: "
                                f"{known}.")
        return cls(**dict(value))
    raise TypeError(f"`{argument}` must be a {cls.__name__}, a mapping of its fields or None, got "
                    f"{type(value).__name__}. Fix: pass {argument}={cls.__name__}(...).")


def check_choice(value: Any, choices: Sequence[Any], name: str, fix: str) -> None:
    """Refuse ``value`` unless it is one of ``choices`` (ValueError naming ``name``, the choices and the fix)."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {listed}, got {value!r}. Fix: {fix}")


def check_flag(value: Any, name: str, fix: str) -> None:
    """Refuse anything but ``True`` or ``False`` (ValueError naming ``name`` and the fix)."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}. Fix: {fix}")


def check_int(value: Any, name: str, low: int, fix: str) -> None:
    """Refuse anything but an int (not a bool) of at least ``low`` (ValueError naming ``name`` and the fix)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}. Fix: {fix}")


def check_number(value: Any, name: str, fix: str, *, minimum: float | None = None, above: float | None = None,
                 maximum: float | None = None, below: float | None = None) -> float:
    """``value`` as a float, refused (ValueError naming ``name``, the range and the fix) unless it is a finite int or
    float (not a bool) with ``minimum <= value``, ``above < value``, ``value <= maximum``, ``value < below``."""
    bounds = [f"{sign} {bound:g}" for sign, bound in ((">=", minimum), (">", above), ("<=", maximum), ("<", below))
              if bound is not None]
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (minimum is not None and value < minimum) or (above is not None and value <= above) \
            or (maximum is not None and value > maximum) or (below is not None and value >= below):
        where = " and ".join(bounds)
        raise ValueError(f"`{name}` must be a finite number{' ' + where if where else ''}, got {value!r}. Fix: {fix}")
    return float(value)


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch's draws (the data modules' shuffles): ``seed * 1000003 + epoch`` in the
    63 bits ``torch.Generator.manual_seed`` takes (the same on every rank and on resume)."""
    return (int(seed) * 1_000_003 + int(epoch)) % 2**63


def _integer_range(t: Any, name: str, what: str, fix: str) -> tuple[int, int] | None:
    """``(min, max)`` of a 1-D integer tensor (None when empty); ValueError naming ``name`` and ``fix`` else."""
    if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool \
            or t.dim() != 1:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"`{name}` must be a 1-D integer tensor of {what}, got {got}. Fix: {fix}")
    return (int(t.min()), int(t.max())) if t.numel() else None


def check_dataset_indices(indices: Tensor, num_samples: int, name: str = "indices") -> None:
    """Refuse anything but a 1-D integer tensor of positions in a data set of ``num_samples`` (ValueError
    naming ``name``, what was received and the fix)."""
    span = _integer_range(indices, name, "dataset indices", "make the dataset return its index with each item "
                          "(e.g. wrap it in `lpa3_lightning.data.IndexedDataset`).")
    if span is not None and (span[0] < 0 or span[1] >= num_samples):
        raise ValueError(f"`{name}` out of range: got values in [{span[0]}, {span[1]}] for a training set of "
                         f"{num_samples} samples. Fix: pass indices of the training set itself (not of a subset or a "
                         "concatenation), and `num_samples` equal to its length.")


def check_class_labels(labels: Tensor, num_classes: int, name: str = "labels") -> None:
    """Refuse anything but a 1-D integer tensor of class indices in ``[0, num_classes)`` (ValueError naming
    ``name``, what was received and the fix; "Labels out of range" for values outside the classes)."""
    span = _integer_range(labels, name, "class indices", "pass labels as a long tensor (not one-hot or float).")
    if span is not None and (span[0] < 0 or span[1] >= num_classes):
        raise ValueError(f"Labels out of range: `{name}` holds values in [{span[0]}, {span[1]}] for {num_classes} "
                         f"classes (lpa3_num_classes). Fix: use class indices 0..{num_classes - 1}, or set "
                         "lpa3_num_classes to the number of classes.")


def check_class_prior(prior: object, num_classes: int, name: str = "class_prior") -> tuple[float, ...]:
    """``num_classes`` finite class frequencies, each at least float32's smallest normal number, summing to 1
    (a sequence or a host tensor, read once: a prior is a setting), as a tuple (ValueError naming ``name``)."""
    items: Any = prior.tolist() if isinstance(prior, Tensor) else prior
    try:
        values = None if isinstance(items, (str, bytes)) or any(isinstance(v, (str, bytes)) for v in items) \
            else tuple(float(v) for v in items)
    except (TypeError, ValueError):
        values = None
    tiny = torch.finfo(torch.float32).tiny
    if (values is None or len(values) != num_classes or not all(v >= tiny for v in values)
            or abs(sum(values) - 1.0) > 1e-4):
        raise ValueError(f"`{name}` must hold num_classes={num_classes} positive frequencies summing to 1, got "
                         f"{prior!r}. Fix: e.g. the training set's class shares, or None (uniform).")
    return values


def check_split_loader_covered(visits: Tensor, begin_method: str) -> None:
    """Refuse a split whose loader left training samples out (``visits``: times each sample was seen):
    an unseen sample would land on the unlabeled side silently."""
    missing = int((visits == 0).sum())
    if missing:
        raise ValueError(f"The split loader left {missing} training samples out. Fix: pass a loader over the whole "
                         f"training set (no drop_last) to `{begin_method}`.")


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` for the block, then every module's own ``training`` flag back (a submodule the
    user froze in eval mode stays frozen: nothing here changes a train/eval flag for good)."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, training in flags:
            m.training = training


CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
SEQUENCE_TYPES = (nn.MultiheadAttention, nn.RNNBase)  # modules with a ``batch_first`` token layout


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The eager module behind ``torch.compile`` wrappers (forward hooks need the eager submodules)."""
    compiled = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(compiled, "OptimizedModule", None)
    while optimized is not None and isinstance(model, optimized):
        model = model._orig_mod
    return model


def output_to_logits(output: Any, fix: str = "pass `logits_fn=` (a callable mapping the model output to logits, e.g. "
                     "`lambda out: out['logits']`), or make the model return the logits") -> Tensor:
    """The logits tensor of a model output (TypeError naming ``fix`` for anything but a tensor)."""
    if isinstance(output, Tensor):
        return output
    raise TypeError(f"The model returned {type(output).__name__}, but LP-A3 needs the logits tensor. Fix: {fix}.")


def first_tensor(output: Any) -> Tensor | None:
    """A module's activation: the output tensor, or the first tensor of a tuple/list (``(out, aux)``,
    a recurrent layer's ``(output, h_n)``, attention's ``(attn_output, weights)``)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, Tensor)), None)
    return None


def token_batch_first(modules: dict[str, nn.Module], name: str) -> bool | None:
    """None for a channel-first activation of module ``name``; for token sequences the ``batch_first`` flag of
    its own (or first descendant) attention/recurrent layer, else of the nearest enclosing transformer block's
    attention (a non-root module with an ``nn.MultiheadAttention`` child)."""
    module = modules[name]
    if isinstance(module, CONV_TYPES):
        return None  # (N, C, L) even inside a transformer block (a conformer's convolution)
    own = next((m for m in module.modules() if isinstance(m, SEQUENCE_TYPES)), None)
    if own is not None:
        return bool(own.batch_first)
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):  # nearest ancestor first; the root is no block
        ancestor = modules.get(".".join(parts[:depth]))
        children = () if ancestor is None else ancestor.children()
        attention = next((c for c in children if isinstance(c, nn.MultiheadAttention)), None)
        if attention is not None:
            return bool(attention.batch_first)
    return None


def batch_major(activation: Tensor, batch_first: bool | None) -> Tensor:
    """``(L, N, D)`` token sequences of a ``batch_first=False`` module as ``(N, L, D)``."""
    if batch_first is False and activation.dim() == 3:
        return activation.transpose(0, 1)
    return activation
