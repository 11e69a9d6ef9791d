"""Per-sample time-consistency (TCS) memory (Zhou et al. 2020, as used by LP-A3).

For every training sample (addressed by its dataset index) the memory keeps the previous
predicted distribution and a score ``c``: an exponential moving average of the negative
divergence between consecutive predictions. Higher ``c`` = more consistent. At the end of
each pass over the data a threshold is refreshed and the least consistent ``ratio`` of the
samples are selected for LP-A3 (see :mod:`lpa3_lightning.core.selection`).

The score's update is the pure function of :mod:`lpa3_lightning.core.tcs_scores` (the authors'
divergence by default, the paper's on request).

Improvement over the authors' code: their stored previous prediction starts at 1.01 for
every class, which is not a distribution, so the first divergence of every sample is
meaningless (negative for confident predictions). Here the memory starts as the uniform
distribution (``initial_memory="uniform"``), so the first visit scores how far the model
moved from "no knowledge"; ``initial_memory="authors"`` restores 1.01 for comparison.
All state lives in tensors indexed by dataset index. Under data parallelism :meth:`TimeConsistency.update`
is a collective: every process's rows of the step reach every process (one size exchange, one
gather), so every rank applies the same rows and the memory stays identical. The stored
predictions may be kept in 16 bits (``storage_dtype``; scores and divergences are always computed
in float32); :class:`~lpa3_lightning.core.tcs_shards.ShardedTimeConsistency` splits them over the
processes (its update routes each row to its owner instead of gathering it everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lpa3_lightning.core.checks import check_dataset_indices
from lpa3_lightning.core.distributed import deduplicate_first, exchange_sizes, gather_padded
from lpa3_lightning.core.selection import (
    check_criterion,
    check_initial_selection,
    check_ratio,
    check_threshold_rule,
    random_selection,
    selection_threshold,
)
from lpa3_lightning.core.tcs_scores import (
    AUTHORS_INITIAL_MEMORY,
    DEFAULT_GAMMA,
    STORAGE_DTYPES,
    check_divergence,
    check_initial_memory,
    storage_dtype_of,
    tcs_divergence,
    tcs_update,
)

__all__ = ["STORAGE_DTYPES", "TimeConsistency", "check_divergence", "check_initial_memory", "storage_dtype_of",
           "tcs_divergence", "tcs_update"]

_STATE_VERSION = 3  # 3: the per-sample epoch of the last update is part of the memory


@dataclass
class StepRows:
    """One step's rows as an update applies them: every process's, in rank order.

    Attributes:
        indices: ``(R,)`` dataset indices (``R`` rows over all processes).
        finite: ``(R,)`` whether each row's probabilities are finite.
        targets: ``(R,)`` labels, or None.
        probs: ``(R, C)`` every row's probabilities (float32), or, for a sharded memory, this
            process's own ``(B, C)`` rows (they travel to their owners only).
        sizes: rows per process.
    """

    indices: Tensor
    finite: Tensor
    targets: Tensor | None
    probs: Tensor
    sizes: list[int]


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
        initial_selection: how a sample without a score is selected (every sample before the
            first threshold; later, the samples no pass has reached yet, as with
            ``limit_train_batches``): ``"random"`` (default) a seeded random ``ratio`` share of
            the data set each epoch, ``"all"`` every such sample (the authors').
        seed: seed of that random share.
        threshold_rule: ``"count"`` (default: the ``round(ratio * N)`` lowest scores) or
            ``"authors"`` (see :func:`~lpa3_lightning.core.selection.selection_threshold`).
        criterion: ``"tcs"`` (default: the lowest time-consistency scores) or ``"random"`` (the
            paper's ablation: a fresh seeded random ``ratio`` share every epoch, whatever the
            scores; the memory is still updated, so its diagnostics stay comparable).
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
        criterion: Literal["tcs", "random"] = "tcs",
    ) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"`num_samples` must be a positive int (the training set size), got {num_samples!r}.")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"`num_classes` must be an int >= 2, got {num_classes!r}.")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"`gamma` must be in (0, 1], got {gamma!r}. Fix: use 0.99 (the authors').")
        check_divergence(divergence)
        check_initial_memory(initial_memory)
        check_initial_selection(initial_selection)
        check_threshold_rule(threshold_rule)
        check_criterion(criterion)
        self.num_samples, self.num_classes = num_samples, num_classes
        self.ratio, self.gamma = check_ratio(ratio), float(gamma)
        self.divergence, self.initial_memory = divergence, initial_memory
        self.initial_selection, self.threshold_rule = initial_selection, threshold_rule
        self.criterion = criterion
        self.seed = int(seed)
        self.storage_dtype = storage_dtype_of(storage_dtype)
        self._random_share: tuple[int, Tensor] | None = None  # (epoch, mask over all samples)
        device = torch.device(device)
        # One row more than the data set everywhere: the rows an update does not apply are
        # written to it (the scratch row), so an update selects what it writes with torch.where
        # and reads nothing on the host, however many rows repeat an index.
        self._rows = self._initial_rows(self._stored_rows() + 1, device)
        self._scores = torch.zeros(num_samples + 1, device=device)
        self._seen = torch.zeros(num_samples + 1, dtype=torch.bool, device=device)
        self._last_update = torch.full((num_samples + 1,), -1, dtype=torch.long, device=device)
        self.threshold = torch.tensor(float("nan"), device=device)  # nan: no pass finished yet
        #: rows refused since the owner last read them: non-finite predictions, and (with
        #: ``check_values=False``) indices outside the data set (device counts: no host read)
        self.nonfinite_rows = torch.zeros((), dtype=torch.long, device=device)
        self.refused_rows = torch.zeros((), dtype=torch.long, device=device)
        self.rows_recorded = 0  # rows every update received (host count of shapes)

    def _stored_rows(self) -> int:
        """Rows of stored predictions this memory keeps (all of them; a shard keeps its own)."""
        return self.num_samples

    @property
    def initial_value(self) -> float:
        """Every entry of a stored prediction before its first update."""
        return 1.0 / self.num_classes if self.initial_memory == "uniform" else AUTHORS_INITIAL_MEMORY

    def _initial_rows(self, rows: int, device: torch.device) -> Tensor:
        return torch.full((rows, self.num_classes), self.initial_value, device=device, dtype=self.storage_dtype)

    # ------------------------------------------------------------------ state, by dataset index
    @property
    def memory(self) -> Tensor:
        """``(N, C)`` the stored prediction of every sample (row ``i`` = dataset index ``i``)."""
        return self._rows[: self.num_samples]

    @property
    def scores(self) -> Tensor:
        """``(N,)`` the TCS scores (higher = more consistent)."""
        return self._scores[: self.num_samples]

    @property
    def seen(self) -> Tensor:
        """``(N,)`` whether each sample was updated at least once."""
        return self._seen[: self.num_samples]

    @property
    def last_update_epoch(self) -> Tensor:
        """``(N,)`` the epoch of each sample's last update (-1: never, or updated without an epoch)."""
        return self._last_update[: self.num_samples]

    @property
    def threshold(self) -> Tensor:
        """The current selection threshold (0-dim; NaN until the first pass finished)."""
        return self._threshold

    @threshold.setter
    def threshold(self, value: Tensor) -> None:
        self._threshold = value
        # read once here, when the threshold changes (once a pass), so that selecting a batch
        # needs no host read of it
        self._has_threshold = not bool(torch.isnan(value))

    @property
    def has_threshold(self) -> bool:
        return self._has_threshold

    @property
    def device(self) -> torch.device:
        return self._scores.device

    def _check_indices(self, indices: Tensor, values: bool = True) -> Tensor:
        check_dataset_indices(indices, self.num_samples, values=values)
        return indices.to(self.device, torch.long)

    # ------------------------------------------------------------------ the update
    def update(self, indices: Tensor, probs: Tensor, targets: Tensor | None = None, *, epoch: int | None = None,
               check_values: bool = True, abort: bool = False) -> Tensor:
        """Score and store one step's predictions of every process.

        Under a process group of several processes this is a collective: every process calls it
        once a step (with an empty batch when it has no rows), and the rows of all reach all. A
        row is applied when its index comes first among the step's rows (``DistributedSampler``
        pads with repeats), its probabilities are finite (a NaN would poison the score for good),
        and, with ``epoch``, the sample was not updated in that epoch yet (padding repeats a
        sample in a later step). Selected with ``torch.where``: nothing is read on the host.

        Args:
            indices: ``(B,)`` dataset indices of this process's rows.
            probs: ``(B, C)`` their predicted probabilities (softmax output).
            targets: optional ``(B,)`` labels, used by ``divergence="paper"`` only (every process
                passes them, or none).
            epoch: the training epoch, for the once-an-epoch rule; None applies every first row.
            check_values: refuse out-of-range indices with a ValueError (a host read); False
                counts them in :attr:`refused_rows` and leaves them out.
            abort: this process withdraws from the step (its own error follows): every other
                process raises :class:`~lpa3_lightning.core.distributed.PeerAborted`, so none
                waits in a later collective.

        Returns:
            ``(R,)`` the divergences ``a_t`` of every process's rows (zero where not applied).
        """
        check_dataset_indices(indices, self.num_samples, values=False)
        indices = indices.detach().to(self.device)
        if probs.dim() != 2 or probs.shape != (indices.numel(), self.num_classes):
            raise ValueError(
                f"`probs` must have shape ({indices.numel()}, {self.num_classes}), got {tuple(probs.shape)}. Fix: one "
                f"probability row per index, with as many classes as the memory was built for ({self.num_classes})."
            )
        probs = probs.detach().to(self.device, torch.float32)
        targets = None if targets is None else targets.detach().to(self.device, torch.long)
        every = self._gather(indices.long(), probs, targets, abort)
        if every is None:  # withdrawn
            return probs.new_zeros(0)
        self.rows_recorded += every.indices.numel()
        first = deduplicate_first(every.indices)
        in_range = (every.indices >= 0) & (every.indices < self.num_samples)
        if check_values:
            check_dataset_indices(every.indices, self.num_samples)
        else:
            self.refused_rows = self.refused_rows + (first & ~in_range).sum()
        self.nonfinite_rows = self.nonfinite_rows + (first & in_range & ~every.finite).sum()
        index = every.indices.clamp(0, self.num_samples - 1)
        keep = first & in_range & every.finite
        if epoch is not None:
            keep = keep & (self._last_update[index] != epoch)
        divergence = self._score_rows(every, index, keep)
        target = torch.where(keep, index, self.num_samples)  # the rows not applied go to the scratch row
        self._scores[target] = tcs_update(self._scores[target], divergence, self.gamma)
        self._seen[target] = True
        if epoch is not None:
            self._last_update[target] = epoch
        return divergence

    def _gather(self, indices: Tensor, probs: Tensor, targets: Tensor | None, abort: bool) -> StepRows | None:
        """Every process's rows of this step (None on a process that withdraws)."""
        finite = torch.isfinite(probs).all(dim=1)
        sizes = exchange_sizes(int(indices.numel()), abort)
        if abort:
            return None
        columns = [indices, finite.long(), probs] + ([] if targets is None else [targets])
        every = gather_padded(columns, sizes)
        return StepRows(every[0], every[1].bool(), None if targets is None else every[3], every[2], sizes)

    def _score_rows(self, every: StepRows, index: Tensor, keep: Tensor) -> Tensor:
        """The divergences of the kept rows (zero elsewhere), their predictions stored."""
        target = torch.where(keep, index, self.num_samples)
        divergence = tcs_divergence(self._rows[target].float(), every.probs, every.targets, self.divergence)
        self._rows[target] = every.probs.to(self.storage_dtype)
        return torch.where(keep, divergence, torch.zeros_like(divergence))

    # ------------------------------------------------------------------ the selection
    def refresh_threshold(self) -> None:
        """Recompute the threshold from the scores of every sample seen so far (end of a pass)."""
        valid = self.seen & torch.isfinite(self.scores)  # a non-finite score must not set the threshold
        if bool(valid.any()):
            self.threshold = selection_threshold(self.scores[valid], self.ratio, self.threshold_rule)

    def select(self, indices: Tensor, epoch: int = 0, check_values: bool = True) -> Tensor:
        """Boolean mask over ``indices``: True for the samples that get LP-A3.

        A sample with a score is selected when it is below the threshold of the last pass; a
        sample without one (every sample before the first threshold, later those no pass has
        reached) by the initial rule: a random ``ratio`` share drawn per ``epoch``
        (``initial_selection="random"``) or every such sample (``"all"``). No host read of a value
        with ``check_values=False`` (see :meth:`update`).
        """
        indices = self._check_indices(indices, values=check_values)
        if self.initial_selection == "all" and self.criterion == "tcs":
            initial = torch.ones_like(indices, dtype=torch.bool)
        else:
            if self._random_share is None or self._random_share[0] != epoch:
                everyone = torch.arange(self.num_samples)
                share = random_selection(everyone, self.num_samples, self.ratio, self.seed, epoch)
                self._random_share = (epoch, share.to(self.device))  # drawn once an epoch, kept on the device
            initial = self._random_share[1][indices]
        if not self.has_threshold or self.criterion == "random":
            return initial
        return torch.where(self._seen[indices], self._scores[indices] < self.threshold, initial)

    # ------------------------------------------------------------------ checkpoints
    def full_memory(self) -> Tensor | None:
        """The stored predictions of every sample, ``(N, C)`` on the CPU in the storage dtype
        (a sharded memory assembles them on shard 0 and gives None on the others: a collective)."""
        return self.memory.cpu()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (tensors on CPU; the memory in its storage dtype).

        A sharded memory's is a collective (see :class:`~lpa3_lightning.core.tcs_shards.ShardedTimeConsistency`).
        """
        return self._state(self.full_memory())

    def _state(self, memory: Tensor | None) -> dict[str, Any]:
        if memory is not None and memory.data_ptr() == self._rows.data_ptr():  # (a CPU memory: no copy was made)
            memory = memory.clone()
        return {
            "version": _STATE_VERSION,
            "num_samples": self.num_samples,
            "num_classes": self.num_classes,
            "ratio": self.ratio,
            "storage_dtype": str(self.storage_dtype).removeprefix("torch."),
            "memory": memory,
            "scores": self.scores.cpu().clone(),
            "seen": self.seen.cpu().clone(),
            "last_update_epoch": self.last_update_epoch.cpu().clone(),
            "threshold": self.threshold.cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, of this layout or another.

        A state saved with another storage dtype or by a run of another world size (replicated
        or sharded) loads as well: the rows are converted to this memory's dtype and layout.

        Raises:
            ValueError: if the state is of another version, data set size or number of classes,
                or holds no stored predictions (a sharded memory's state taken on one process).
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"This TCS state is of version {state.get('version')!r}; this package reads version "
                             f"{_STATE_VERSION}. Fix: resume with the lpa3-lightning version that wrote it, or start a "
                             "new run.")
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
        self._load_rows(state["memory"])
        for buffer, key, dtype in ((self._scores, "scores", torch.float32), (self._seen, "seen", torch.bool),
                                   (self._last_update, "last_update_epoch", torch.long)):
            buffer[: self.num_samples] = state[key].to(self.device, dtype)
        self.threshold = state["threshold"].to(self.device, torch.float32).clone()

    def _load_rows(self, memory: Tensor) -> None:
        self._rows[: self.num_samples] = memory.to(self.device, self.storage_dtype)
