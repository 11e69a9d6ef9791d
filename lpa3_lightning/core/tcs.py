"""Per-sample time-consistency (TCS) memory (Zhou et al. 2020, as used by LP-A3).

For every training sample (addressed by its dataset index) the memory keeps the previous
predicted distribution and a score ``c``: an exponential moving average of the negative
divergence between consecutive predictions. Higher ``c`` = more consistent. At the end of
each pass over the data a threshold is refreshed and the least consistent ``ratio`` of the
samples are selected for LP-A3 (see :mod:`lpa3_lightning.core.selection`).

Defaults are the authors' code's (docs/method.md): ``a = mean_c p_t * (log p_t - log p_prev)``
(``F.kl_div(log p_prev, p_t).mean(1)``, i.e. KL(p_t || p_prev) / C) and
``c_t = 0.01 * c_{t-1} - 0.99 * a_t``. ``divergence="paper"`` uses the paper's
``KL(p_prev || p_t) + |log p_prev[y] / p_t[y]|`` instead.

Improvement over the authors' code: their stored previous prediction starts at 1.01 for
every class, which is not a distribution, so the first divergence of every sample is
meaningless (negative for confident predictions). Here the memory starts as the uniform
distribution (``initial_memory="uniform"``), so the first visit scores how far the model
moved from "no knowledge"; ``initial_memory="authors"`` restores 1.01 for comparison.
All state lives in tensors indexed by dataset index, so it can be all-gathered under DDP.
The stored predictions may be kept in 16 bits (``storage_dtype``; scores and divergences are
always computed in float32); :class:`~lpa3_lightning.core.tcs_shards.ShardedTimeConsistency`
splits them over the processes of a data-parallel run.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lpa3_lightning.core.checks import check_dataset_indices
from lpa3_lightning.core.selection import (
    check_initial_selection,
    check_ratio,
    check_threshold_rule,
    random_selection,
    selection_threshold,
)

__all__ = ["STORAGE_DTYPES", "TimeConsistency", "storage_dtype_of", "tcs_divergence", "tcs_update"]

#: Weight of the new divergence in the score's moving average (authors' code: 0.99).
DEFAULT_GAMMA = 0.99
#: The authors' initial value of every entry of the stored prediction.
AUTHORS_INITIAL_MEMORY = 1.01
#: The dtypes the stored predictions may be kept in (names as in configs).
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STATE_VERSION = 2  # 2: the memory is saved in its storage dtype, named by "storage_dtype"


def storage_dtype_of(value: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a ``storage_dtype`` given by name or dtype.

    Raises:
        ValueError: for any other dtype, naming the accepted ones.
    """
    dtype = STORAGE_DTYPES.get(value) if isinstance(value, str) else value
    if dtype not in STORAGE_DTYPES.values():
        raise ValueError(f"`storage_dtype` must be one of {sorted(STORAGE_DTYPES)}, got {value!r}. Fix: use "
                         "'float32' (exact), or 'bfloat16' / 'float16' to halve the stored predictions.")
    return dtype  # type: ignore[return-value]


def _copy_to(t: Tensor, device: torch.device, dtype: torch.dtype, copy: bool = True) -> Tensor:
    """``t`` on ``device`` in ``dtype``; with ``copy`` never sharing storage with ``t`` (one copy at most)."""
    moved = t.to(device, dtype)
    return moved.clone() if copy and moved.data_ptr() == t.data_ptr() else moved


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
    tiny = torch.finfo(current.dtype).tiny
    if divergence == "code":
        return F.kl_div(previous.clamp_min(tiny).log(), current, reduction="none").mean(dim=1)
    if divergence == "paper":
        kl = F.kl_div(current.clamp_min(tiny).log(), previous, reduction="none").sum(dim=1)
        label = previous.argmax(dim=1) if targets is None else targets.long()
        p_prev = previous.gather(1, label[:, None]).squeeze(1).clamp_min(tiny)
        p_now = current.gather(1, label[:, None]).squeeze(1).clamp_min(tiny)
        return kl + (p_prev.log() - p_now.log()).abs()
    raise ValueError(f"`divergence` must be 'code' or 'paper', got {divergence!r}.")


def tcs_update(scores: Tensor, divergence: Tensor, gamma: float = DEFAULT_GAMMA) -> Tensor:
    """New TCS scores: ``gamma * (-a) + (1 - gamma) * c`` (higher = more consistent).

    Example:
        >>> round(float(tcs_update(torch.tensor([-1.0]), torch.tensor([0.5]))[0]), 3)
        -0.505
    """
    return gamma * (-divergence) + (1.0 - gamma) * scores


class TimeConsistency:
    """Per-sample time-consistency memory with a per-pass selection threshold.

    Args:
        num_samples: size of the training set (dataset indices are ``0..num_samples-1``).
        num_classes: number of classes of the predictions.
        ratio: fraction of samples to select, in (0, 1] (the paper's tau).
        gamma: weight of the new divergence in the moving average (authors: 0.99).
        divergence: ``"code"`` (default, the authors' code) or ``"paper"``.
        initial_memory: ``"uniform"`` (default, a distribution) or ``"authors"`` (1.01s).
        device: where the memory lives (CPU by default: N x C floats need no GPU memory).
        initial_selection: before the first threshold exists, ``"random"`` (default) selects a
            seeded random ``ratio`` share of the data set each epoch; ``"all"`` selects every
            sample (the authors').
        seed: seed of that random share.
        threshold_rule: ``"count"`` (default: the ``round(ratio * N)`` lowest scores) or
            ``"authors"`` (see :func:`~lpa3_lightning.core.selection.selection_threshold`).
        storage_dtype: dtype of the stored predictions, ``"float32"`` (default), ``"bfloat16"`` or
            ``"float16"`` (half the memory; the divergences are computed in float32 from the
            rounded stored rows, so scores and selections can differ slightly from float32's).

    Raises:
        ValueError: on a bad argument, naming it and the fix.

    Example:
        >>> tcs = TimeConsistency(num_samples=4, num_classes=2, ratio=0.5)
        >>> int(tcs.select(torch.arange(4)).sum())  # no threshold yet: a random half
        2
        >>> _ = tcs.update(torch.arange(4), torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.99, 0.01], [0.6, 0.4]]))
        >>> tcs.refresh_threshold()
        >>> tcs.select(torch.arange(4)).tolist()  # the two least consistent (most changed) samples
        [False, True, True, False]
    """

    def __init__(
        self,
        num_samples: int,
        num_classes: int,
        ratio: float,
        gamma: float = DEFAULT_GAMMA,
        divergence: Literal["code", "paper"] = "code",
        initial_memory: Literal["uniform", "authors"] = "uniform",
        device: torch.device | str = "cpu",
        initial_selection: Literal["random", "all"] = "random",
        seed: int = 0,
        threshold_rule: Literal["count", "authors"] = "count",
        storage_dtype: str | torch.dtype = "float32",
    ) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"`num_samples` must be a positive int (the training set size), got {num_samples!r}.")
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"`num_classes` must be an int >= 2, got {num_classes!r}.")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"`gamma` must be in (0, 1], got {gamma!r}. Fix: use 0.99 (the authors').")
        if divergence not in ("code", "paper"):
            raise ValueError(f"`divergence` must be 'code' or 'paper', got {divergence!r}.")
        if initial_memory not in ("uniform", "authors"):
            raise ValueError(f"`initial_memory` must be 'uniform' or 'authors', got {initial_memory!r}.")
        check_initial_selection(initial_selection)
        self.initial_selection = initial_selection
        check_threshold_rule(threshold_rule)
        self.threshold_rule = threshold_rule
        self.seed = int(seed)
        self._random_share: tuple[int, Tensor] | None = None  # (epoch, mask over all samples)
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.ratio = check_ratio(ratio)
        self.gamma = float(gamma)
        self.divergence = divergence
        self.initial_memory = initial_memory
        self.storage_dtype = storage_dtype_of(storage_dtype)
        self.memory = self._initial_rows(num_samples, torch.device(device))
        self.scores = torch.zeros(num_samples, device=device)
        self.seen = torch.zeros(num_samples, dtype=torch.bool, device=device)
        self.threshold = torch.tensor(float("nan"), device=device)  # nan: no pass finished yet

    @property
    def initial_value(self) -> float:
        """Every entry of a stored prediction before its first update."""
        return 1.0 / self.num_classes if self.initial_memory == "uniform" else AUTHORS_INITIAL_MEMORY

    def _initial_rows(self, rows: int, device: torch.device) -> Tensor:
        return torch.full((rows, self.num_classes), self.initial_value, device=device, dtype=self.storage_dtype)

    @property
    def threshold(self) -> Tensor:
        """The current selection threshold (0-dim; NaN until the first pass finished)."""
        return self._threshold

    @threshold.setter
    def threshold(self, value: Tensor) -> None:
        self._threshold = value
        # read once here, when the threshold changes (once a pass), so that selecting a batch
        # needs no host read of it
        self._has_threshold = not value.is_meta and not bool(torch.isnan(value))

    @property
    def device(self) -> torch.device:
        return self.memory.device

    def _check_indices(self, indices: Tensor, values: bool = True) -> Tensor:
        check_dataset_indices(indices, self.num_samples, values=values)
        return indices.to(self.device, torch.long)

    def update(self, indices: Tensor, probs: Tensor, targets: Tensor | None = None, keep: Tensor | None = None,
               check_values: bool = True) -> Tensor:
        """Score the new predictions of the samples ``indices`` and store them.

        Args:
            indices: ``(B,)`` dataset indices.
            probs: ``(B, C)`` current predicted probabilities (softmax output).
            targets: optional ``(B,)`` labels, used by ``divergence="paper"`` only.
            keep: optional ``(B,)`` boolean mask: only these rows are applied (the others are
                written back unchanged), selected on the device without a host read.
            check_values: read the indices on the host to refuse out-of-range ones (False:
                the caller checked them; an out-of-range index then fails in the indexing).

        Returns:
            ``(B,)`` divergences ``a_t`` of this update.
        """
        indices = self._check_indices(indices, values=check_values)
        self._check_probs(indices, probs)
        probs = probs.detach().to(self.device, torch.float32)
        div = tcs_divergence(self.memory[indices].float(), probs, None if targets is None else targets.to(self.device),
                             self.divergence)
        scores = tcs_update(self.scores[indices], div, self.gamma)
        if keep is not None:
            keep = keep.to(self.device)
            scores = torch.where(keep, scores, self.scores[indices])
            probs = torch.where(keep[:, None], probs, self.memory[indices].float())
        self.scores[indices] = scores
        self.memory[indices] = probs.to(self.storage_dtype)
        self.seen[indices] = self.seen[indices] | keep if keep is not None else True
        return div

    def _check_probs(self, indices: Tensor, probs: Tensor) -> None:
        if probs.shape != (indices.numel(), self.num_classes):
            raise ValueError(
                f"`probs` must have shape ({indices.numel()}, {self.num_classes}), got {tuple(probs.shape)}. Fix: one "
                f"probability row per index, with as many classes as the memory was built for ({self.num_classes})."
            )

    def refresh_threshold(self) -> None:
        """Recompute the threshold from the scores of every sample seen so far (end of a pass)."""
        valid = self.seen & torch.isfinite(self.scores)  # a non-finite score must not set the threshold
        if bool(valid.any()):
            self.threshold = selection_threshold(self.scores[valid], self.ratio, self.threshold_rule)

    @property
    def has_threshold(self) -> bool:
        return self._has_threshold

    def select(self, indices: Tensor, epoch: int = 0, check_values: bool = True) -> Tensor:
        """Boolean mask over ``indices``: True for the samples that get LP-A3.

        Before the first threshold, a random ``ratio`` share drawn per ``epoch``
        (``initial_selection="random"``) or every sample (``"all"``). No host read of a value
        with ``check_values=False`` (see :meth:`update`).
        """
        indices = self._check_indices(indices, values=check_values)
        if self.has_threshold:
            return self.scores[indices] < self.threshold
        if self.initial_selection == "all":
            return torch.ones_like(indices, dtype=torch.bool)
        if self._random_share is None or self._random_share[0] != epoch:
            everyone = torch.arange(self.num_samples)
            share = random_selection(everyone, self.num_samples, self.ratio, self.seed, epoch)
            self._random_share = (epoch, share.to(self.device))  # drawn once an epoch, kept on the device
        return self._random_share[1][indices]

    def full_memory(self) -> Tensor | None:
        """The stored predictions of every sample, ``(N, C)`` on the CPU in the storage dtype
        (a sharded memory assembles them on shard 0 and gives None on the others)."""
        return self.memory.cpu()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (tensors on CPU; the memory in its storage dtype)."""
        return self._state(copy=True)

    def _state(self, copy: bool) -> dict[str, Any]:
        memory = self.full_memory()
        if copy and memory is not None and memory.data_ptr() == self.memory.data_ptr():
            memory = memory.clone()
        tensors = {"scores": self.scores.cpu(), "seen": self.seen.cpu(), "threshold": self.threshold.cpu()}
        return {
            "version": _STATE_VERSION,
            "num_samples": self.num_samples,
            "num_classes": self.num_classes,
            "ratio": self.ratio,
            "storage_dtype": str(self.storage_dtype).removeprefix("torch."),
            "memory": memory,
            **{k: v.clone() if copy else v for k, v in tensors.items()},
        }

    def adopt(self, other: TimeConsistency) -> None:
        """Take over another memory's state (an earlier fit's, or one read from a checkpoint),
        converted to this one's device, dtype and layout, without an intermediate copy of the rows.

        Raises:
            ValueError: when ``other`` is split over several processes and this memory is not split
                the same way (assembling it would be a collective): on every process alike.
        """
        shards = getattr(other, "num_shards", 1)
        if shards > 1:
            raise ValueError(
                f"An earlier fit left this callback a TCS memory split over {shards} processes "
                "(selection.memory_layout), and this fit keeps it another way. Fix: save a checkpoint and "
                "resume from it (a checkpoint holds the whole memory and loads into any layout and world size), "
                "or keep the layout and the world size of the earlier fit."
            )
        self._load(other._state(copy=False), copy=False)

    def _check_state(self, state: dict[str, Any]) -> Tensor:
        """The state's full memory, after refusing one of another data set size or without rows."""
        if state.get("num_samples") != self.num_samples or state.get("num_classes") != self.num_classes:
            raise ValueError(
                f"The checkpointed TCS memory is for {state.get('num_samples')} samples x "
                f"{state.get('num_classes')} classes, but this training set has {self.num_samples} x "
                f"{self.num_classes}. Fix: resume with the same training data, or start a new run "
                "(drop `ckpt_path`) if the data set changed on purpose."
            )
        if state.get("memory") is None:
            raise ValueError(
                "This TCS state has no stored predictions: it was taken on a process other than global rank 0 of "
                "a run with a sharded memory (only rank 0 assembles them; its state is the one a checkpoint "
                "holds). Fix: load the checkpoint file that rank 0 wrote, or rank 0's state_dict()."
            )
        return state["memory"]

    def _load_rows(self, memory: Tensor, copy: bool) -> None:
        self.memory = _copy_to(memory, self.device, self.storage_dtype, copy)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, refusing one written for another data set size.

        A state saved with another storage dtype or by a run of another world size (replicated
        or sharded) loads as well: the rows are converted to this memory's dtype and layout.

        Raises:
            ValueError: if the stored number of samples or classes differs from this memory's,
                or the state holds no stored predictions (a sharded run's rank other than 0).
        """
        self._load(state, copy=True)

    def _load(self, state: dict[str, Any], copy: bool) -> None:
        """Load ``state``; ``copy=False`` may share its stored predictions (N x C: not copied when the
        state is discarded after, as a checkpoint's is), never its other tensors."""
        memory = self._check_state(state)
        if self.device.type == "meta":  # built to be loaded (nothing allocated): the state's tensors on the CPU
            self.memory = torch.empty((0, self.num_classes), dtype=self.storage_dtype)
        self._load_rows(memory, copy)
        self.scores = _copy_to(state["scores"], self.device, torch.float32)
        self.seen = _copy_to(state.get("seen", torch.ones(self.num_samples, dtype=torch.bool)), self.device, torch.bool)
        self.threshold = _copy_to(state.get("threshold", torch.tensor(float("nan"))), self.device, torch.float32)
