"""The time-consistency score of one step, as pure functions (no state, no Lightning): the
divergence between a sample's stored and current prediction, and the score's moving average.
:class:`~lpa3_lightning.core.tcs.TimeConsistency` keeps the per-sample state around them.

Defaults are the authors' code's (docs/method.md): ``a = mean_c p_t * (log p_t - log p_prev)``
(``F.kl_div(log p_prev, p_t).mean(1)``, i.e. KL(p_t || p_prev) / C) and
``c_t = 0.01 * c_{t-1} - 0.99 * a_t``. ``divergence="paper"`` uses the paper's
``KL(p_prev || p_t) + |log p_prev[y] / p_t[y]|`` instead.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lpa3_lightning.core.arguments import check_choice

__all__ = ["AUTHORS_INITIAL_MEMORY", "DEFAULT_GAMMA", "STORAGE_DTYPES", "check_divergence", "check_initial_memory",
           "storage_dtype_of", "tcs_divergence", "tcs_update"]

#: Weight of the new divergence in the score's moving average (authors' code: 0.99).
DEFAULT_GAMMA = 0.99
#: The authors' initial value of every entry of the stored prediction.
AUTHORS_INITIAL_MEMORY = 1.01
#: The dtypes the stored predictions may be kept in (names as in configs).
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def storage_dtype_of(value: str | torch.dtype, name: str = "storage_dtype") -> torch.dtype:
    """The torch dtype of a ``storage_dtype`` given by name or dtype.

    Raises:
        ValueError: for any other dtype, naming ``name`` and the accepted ones.
    """
    dtype = STORAGE_DTYPES.get(value) if isinstance(value, str) else value
    if dtype not in STORAGE_DTYPES.values():
        check_choice(value, tuple(STORAGE_DTYPES), name,
                     "use 'float32' (exact), or 'bfloat16' / 'float16' to halve the stored predictions.")
    return dtype  # type: ignore[return-value]


def check_divergence(divergence: str, name: str = "divergence") -> None:
    """Raise a ValueError naming ``name`` unless ``divergence`` is ``"code"`` or ``"paper"``."""
    check_choice(divergence, ("code", "paper"), name, "use 'code' (the authors' code).")


def check_initial_memory(initial_memory: str, name: str = "initial_memory") -> None:
    """Raise a ValueError naming ``name`` unless ``initial_memory`` is ``"uniform"`` or ``"authors"``."""
    check_choice(initial_memory, ("uniform", "authors"), name, "use 'uniform' (a distribution).")


def tcs_divergence(
    previous: Tensor,
    current: Tensor,
    targets: Tensor | None = None,
    divergence: Literal["code", "paper"] = "code",
) -> Tensor:
    """Per-sample divergence ``a_t`` between the stored and the current prediction.

    Args:
        previous: ``(N, C)`` stored predictions (a distribution, or the authors' 1.01s).
        current: ``(N, C)`` current probabilities.
        targets: ``(N,)`` labels for the paper's ``|log ratio|`` term; None uses the
            argmax of ``previous`` (the previous pseudo-label).
        divergence: ``"code"`` (authors' code) or ``"paper"`` (paper appendix A.1).

    Returns:
        ``(N,)`` divergences.
    """
    if previous.shape != current.shape or current.dim() != 2:
        raise ValueError(
            f"`previous` and `current` must both be (N, C); got {tuple(previous.shape)} and {tuple(current.shape)}."
        )
    check_divergence(divergence)
    tiny = torch.finfo(current.dtype).tiny
    if divergence == "code":
        return F.kl_div(previous.clamp_min(tiny).log(), current, reduction="none").mean(dim=1)
    kl = F.kl_div(current.clamp_min(tiny).log(), previous, reduction="none").sum(dim=1)
    label = previous.argmax(dim=1) if targets is None else targets.long()
    p_prev = previous.gather(1, label[:, None]).squeeze(1).clamp_min(tiny)
    p_now = current.gather(1, label[:, None]).squeeze(1).clamp_min(tiny)
    return kl + (p_prev.log() - p_now.log()).abs()


def tcs_update(scores: Tensor, divergence: Tensor, gamma: float = DEFAULT_GAMMA) -> Tensor:
    """New TCS scores: ``gamma * (-a) + (1 - gamma) * c`` (higher = more consistent).

    Example:
        >>> round(float(tcs_update(torch.tensor([-1.0]), torch.tensor([0.5]))[0]), 3)
        -0.505
    """
    return gamma * (-divergence) + (1.0 - gamma) * scores
