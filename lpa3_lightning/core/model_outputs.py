"""How the package reads a model: its logits from any output, its eval mode with every flag
restored, the module behind ``torch.compile``, and the batch axis of a layer's activation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["eval_mode", "output_to_logits", "unwrap_compiled"]


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


CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

SEQUENCE_TYPES = (nn.MultiheadAttention, nn.RNNBase)  # modules with a ``batch_first`` token layout


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The eager module behind ``torch.compile`` wrappers (hooks need the eager submodules)."""
    compiled = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(compiled, "OptimizedModule", None)
    while optimized is not None and isinstance(model, optimized):
        model = model._orig_mod
    return model


#: The fix for a non-tensor output where the caller passes the function (lpa3_attack's ``logits_fn``).
LOGITS_FN_FIX = ("pass `logits_fn=` (a callable mapping the model output to logits, e.g. `lambda out: out['logits']`), "
                 "or make the model return the logits")


def output_to_logits(output: Any, fix: str = LOGITS_FN_FIX) -> Tensor:
    """Return the logits tensor of a model output, refusing anything ambiguous.

    Args:
        output: what ``model(x)`` returned.
        fix: the remedy the message names (the caller's way of mapping an output to logits).

    Raises:
        TypeError: if the output is not a tensor.
    """
    if isinstance(output, Tensor):
        return output
    raise TypeError(f"The model returned {type(output).__name__}, but LP-A3 needs the logits tensor. Fix: {fix}.")


def first_tensor(output: Any) -> Tensor | None:
    """The activation of a module output: the tensor itself, or the first tensor of a tuple/list.

    Blocks may return ``(out, aux)``; recurrent layers return ``(output, h_n)`` and
    ``nn.MultiheadAttention`` returns ``(attn_output, weights)``: the first tensor is the activation.
    """
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, Tensor)), None)
    return None


def token_batch_first(modules: dict[str, nn.Module], name: str) -> bool | None:
    """Whether module ``name`` emits token sequences, and in which layout.

    Returns:
        None for channel-first activations; for token sequences (channel-last when 3-D) the
        ``batch_first`` flag of the attention/recurrent module that decides the layout: the
        module itself or its first such descendant, else the attention held by the nearest
        enclosing transformer block (a non-root module with an ``nn.MultiheadAttention`` child).
    """
    module = modules[name]
    if isinstance(module, CONV_TYPES):
        return None  # (N, C, L) even inside a transformer block (e.g. a conformer's conv module)
    own = next((m for m in module.modules() if isinstance(m, SEQUENCE_TYPES)), None)
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


def batch_major(activation: Tensor, batch_first: bool | None) -> Tensor:
    """``(L, N, D)`` token sequences of a ``batch_first=False`` module as ``(N, L, D)``."""
    if batch_first is False and activation.dim() == 3:
        return activation.transpose(0, 1)
    return activation
