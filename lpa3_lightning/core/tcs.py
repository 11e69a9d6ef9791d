"""Per-sample time-consistency (TCS) memory and the selection it drives (Zhou et al. 2020, as used by LP-A3).

Per training sample (by dataset index) the memory keeps the last predicted distribution and a score ``c``, a
moving average of the negative divergence between consecutive predictions: by default the authors' code's
``a = KL(p_t || p_prev) / C`` and ``c_t = 0.01 c_{t-1} - 0.99 a_t`` (``divergence="paper"``: the paper's
``KL(p_prev || p_t) + |log p_prev[y] / p_t[y]|``). A threshold refreshed after each pass selects the samples
scored below it (the least consistent: a hard positive is likely nearby). :meth:`TimeConsistency.update` is a
collective under data parallelism (every memory stays identical); predictions may be stored in 16 bits.

Departures from the authors' code, each with a switch:

- the stored prediction starts uniform (``initial_memory="uniform"``; theirs 1.01 for every class);
- the threshold selects ``round(ratio N)`` samples (``threshold_rule="count"``; theirs one fewer);
- a sample without a score is in a seeded random ``ratio`` share (``initial_selection="random"``; theirs: all).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lpa3_lightning.core.checks import check_choice, check_dataset_indices, check_int
from lpa3_lightning.core.distributed import deduplicate_first, exchange_sizes, gather_padded

__all__ = ["STORAGE_DTYPES", "TimeConsistency", "check_ratio", "random_selection", "selected_count",
           "selection_threshold", "storage_dtype_of", "tcs_divergence", "tcs_update"]

_STATE_VERSION = 3  # 3: the per-sample epoch of the last update is part of the memory
DEFAULT_GAMMA = 0.99  # weight of the new divergence in the moving average (authors)
AUTHORS_INITIAL_MEMORY = 1.01  # the authors' initial value of every entry of the stored prediction
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def storage_dtype_of(value: str | torch.dtype, name: str = "storage_dtype") -> torch.dtype:
    """The torch dtype of a ``storage_dtype`` given by name or dtype (ValueError naming ``name`` otherwise)."""
    dtype = STORAGE_DTYPES.get(value) if isinstance(value, str) else value
    if dtype not in STORAGE_DTYPES.values():
        check_choice(value, tuple(STORAGE_DTYPES), name,
                     "use 'float32' (exact), or 'bfloat16' / 'float16' to halve the stored predictions.")
    return dtype  # type: ignore[return-value]


def check_ratio(ratio: float) -> float:
    """``ratio`` (tau, the selected fraction) as a float (ValueError unless it is in (0, 1])."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
        raise ValueError(f"`ratio` is the fraction of samples given LP-A3 and must be in (0, 1], got {ratio!r}. "
                         "Fix: use e.g. 0.3 (the paper's MedMNIST range is 0.2 to 0.9).")
    return float(ratio)


def tcs_divergence(previous: Tensor, current: Tensor, targets: Tensor | None = None,
                   divergence: Literal["code", "paper"] = "code") -> Tensor:
    """Per-sample divergence ``a_t`` between the stored ``(N, C)`` and the current ``(N, C)`` prediction;
    ``targets`` (the paper's ``|log ratio|`` term) default to the argmax of ``previous``."""
    if previous.shape != current.shape or current.dim() != 2:
        raise ValueError(f"`previous` and `current` must both be (N, C); got {tuple(previous.shape)} and "
                         f"{tuple(current.shape)}. Fix: pass one row of class probabilities per sample.")
    check_choice(divergence, ("code", "paper"), "divergence", "use 'code' (the authors' code).")
    tiny = torch.finfo(current.dtype).tiny
    if divergence == "code":
        return F.kl_div(previous.clamp_min(tiny).log(), current, reduction="none").mean(dim=1)
    kl = F.kl_div(current.clamp_min(tiny).log(), previous, reduction="none").sum(dim=1)
    label = (previous.argmax(dim=1) if targets is None else targets.long())[:, None]
    p_prev, p_now = (p.gather(1, label).squeeze(1).clamp_min(tiny) for p in (previous, current))
    return kl + (p_prev.log() - p_now.log()).abs()


def tcs_update(scores: Tensor, divergence: Tensor, gamma: float = DEFAULT_GAMMA) -> Tensor:
    """New TCS scores: ``gamma * (-a) + (1 - gamma) * c``."""
    return gamma * (-divergence) + (1.0 - gamma) * scores


def selected_count(num_samples: int, ratio: float) -> int:
    """How many of ``num_samples`` the rule selects: ``round(ratio * N)`` (halves up), at least 1."""
    return min(num_samples, max(1, int(math.floor(ratio * num_samples + 0.5))))


def selection_threshold(scores: Tensor, ratio: float, rule: str = "count") -> Tensor:
    """The score below which a sample is selected: the ``(k + 1)``-th lowest of ``scores`` for
    ``k = round(ratio N)`` (``+inf`` when ``k = N``). ``rule="authors"``: the value at rank
    ``floor((1 - ratio) N)`` of the scores sorted descending (selecting ``ceil(ratio N) - 1``)."""
    ratio = check_ratio(ratio)
    if scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(f"`scores` must be a non-empty 1-D tensor, got shape {tuple(scores.shape)}. Fix: pass the "
                         "memory's scores, one per sample.")
    check_choice(rule, ("count", "authors"), "threshold_rule", "use 'count' (select round(ratio * N)).")
    if rule == "authors" and ratio < 1.0:
        rank = int(math.floor((1.0 - ratio) * scores.numel()))
        return torch.sort(scores, descending=True).values[min(rank, scores.numel() - 1)]
    k = selected_count(scores.numel(), ratio)  # k = N for ratio 1, under either rule
    if k >= scores.numel():
        return torch.tensor(math.inf, dtype=scores.dtype, device=scores.device)
    return torch.sort(scores).values[k]


def random_selection(num_samples: int, ratio: float, seed: int, epoch: int) -> Tensor:
    """``(num_samples,)`` a random ``round(ratio N)`` of the data set, drawn from ``(seed, epoch)`` alone (the
    same on every rank and on resume), on a stream of its own: not ``epoch_seed``'s, which the loaders
    shuffle with (one seed for both selected the first rows each epoch's loader yields)."""
    digest = hashlib.blake2b(f"lpa3-random-selection/{seed}/{epoch}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    order = torch.randperm(num_samples, generator=generator)
    chosen = torch.zeros(num_samples, dtype=torch.bool)
    chosen[order[: selected_count(num_samples, ratio)]] = True
    return chosen


@dataclass
class StepRows:
    """One step's rows of every process in rank order (``(R,)``; ``probs`` ``(R, C)``, a shard's: its own
    ``(B, C)``), and ``sizes``, the rows per process."""

    indices: Tensor
    finite: Tensor
    targets: Tensor | None
    probs: Tensor
    sizes: list[int]


def _samples_of(buffer: str, doc: str) -> property:
    """A read-only view of the data set's rows of ``buffer`` (without the scratch row)."""
    return property(lambda self: getattr(self, buffer)[: self.num_samples], doc=doc)


class TimeConsistency:
    """Per-sample time-consistency memory with a per-pass selection threshold.

    Args:
        num_samples: size of the training set (dataset indices ``0..num_samples-1``).
        num_classes: number of classes of the predictions.
        ratio: fraction of samples to select, in (0, 1] (the paper's tau).
        gamma: weight of the new divergence in the moving average (authors: 0.99).
        divergence: ``"code"`` (the authors' code) or ``"paper"``.
        initial_memory: ``"uniform"`` (a distribution) or ``"authors"`` (1.01s).
        device: where the memory lives.
        initial_selection: a sample without a score: ``"random"`` (a seeded ``ratio`` share an epoch) or ``"all"``.
        seed: seed of that random share.
        threshold_rule: ``"count"`` or ``"authors"`` (:func:`selection_threshold`).
        criterion: ``"tcs"`` (the lowest scores) or ``"random"`` (the paper's ablation; the memory still learns).
        storage_dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` for the stored predictions.

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

    _gathers_probs = True  # every process receives every row's probabilities (a shard: its own rows only)

    def __init__(self, num_samples: int, num_classes: int, ratio: float, gamma: float = DEFAULT_GAMMA,
                 divergence: Literal["code", "paper"] = "code", initial_memory: Literal["uniform", "authors"] = "uniform",
                 device: torch.device | str = "cpu", initial_selection: Literal["random", "all"] = "random",
                 seed: int = 0, threshold_rule: Literal["count", "authors"] = "count",
                 storage_dtype: str | torch.dtype = "float32", criterion: Literal["tcs", "random"] = "tcs") -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"`num_samples` must be a positive int (the training set size), got {num_samples!r}. "
                             "Fix: pass len(train_dataset).")
        check_int(num_classes, "num_classes", 2, "pass the number of classes of the predictions.")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"`gamma` must be in (0, 1], got {gamma!r}. Fix: use 0.99 (the authors').")
        for value, choices, name, fix in (
                (divergence, ("code", "paper"), "divergence", "use 'code' (the authors' code)."),
                (initial_memory, ("uniform", "authors"), "initial_memory", "use 'uniform' (a distribution)."),
                (initial_selection, ("random", "all"), "initial_selection", "use 'random' ('all': the authors')."),
                (threshold_rule, ("count", "authors"), "threshold_rule", "use 'count' (select round(ratio * N))."),
                (criterion, ("tcs", "random"), "criterion", "use 'tcs' (LP-A3's; 'random' is its ablation).")):
            check_choice(value, choices, name, fix)
        self.num_samples, self.num_classes = num_samples, num_classes
        self.ratio, self.gamma = check_ratio(ratio), float(gamma)
        self.divergence, self.initial_memory = divergence, initial_memory
        self.initial_selection, self.threshold_rule, self.criterion = initial_selection, threshold_rule, criterion
        self.seed, self.storage_dtype = int(seed), storage_dtype_of(storage_dtype)
        self._random_share: tuple[int, Tensor] | None = None  # (epoch, mask over all samples)
        device = torch.device(device)
        # one row more than the data set everywhere: the rows an update does not apply go to it (the
        # scratch row), so the update selects what it writes with torch.where, however indices repeat
        self._rows = torch.full((self._stored_rows() + 1, num_classes), self.initial_value, device=device,
                                dtype=self.storage_dtype)
        self._scores = torch.zeros(num_samples + 1, device=device)
        self._seen = torch.zeros(num_samples + 1, dtype=torch.bool, device=device)
        self._last_update = torch.full((num_samples + 1,), -1, dtype=torch.long, device=device)
        self.threshold = torch.tensor(float("nan"), device=device)  # nan: no pass finished yet
        self.nonfinite_rows = torch.zeros((), dtype=torch.long, device=device)  # refused since last read
        self.rows_recorded = 0  # rows every update received

    def _stored_rows(self) -> int:
        return self.num_samples  # (a shard: its own, its layout checked here)

    @property
    def initial_value(self) -> float:
        """Every entry of a stored prediction before its first update."""
        return 1.0 / self.num_classes if self.initial_memory == "uniform" else AUTHORS_INITIAL_MEMORY

    memory = _samples_of("_rows", "``(N, C)`` the stored prediction of every sample (row ``i`` = dataset index ``i``).")
    scores = _samples_of("_scores", "``(N,)`` the TCS scores (higher = more consistent).")
    seen = _samples_of("_seen", "``(N,)`` whether each sample was updated at least once.")
    last_update_epoch = _samples_of("_last_update", "``(N,)`` the epoch of each sample's last update (-1: never).")

    @property
    def threshold(self) -> Tensor:
        """The selection threshold (0-dim; NaN until the first pass finished)."""
        return self._threshold

    @threshold.setter
    def threshold(self, value: Tensor) -> None:
        self._threshold = value
        self.has_threshold = not bool(torch.isnan(value))  # read once, when it changes

    @property
    def device(self) -> torch.device:
        return self._scores.device

    def update(self, indices: Tensor, probs: Tensor, targets: Tensor | None = None, *, epoch: int | None = None,
               abort: bool = False) -> Tensor:
        """Score and store one step's predictions of every process (a collective in a process group: every
        process calls it once a step, with no rows if need be). A row is applied when its index comes first
        among the step's rows, its probabilities are finite and, with ``epoch``, its sample was not updated
        in that epoch yet.

        Args:
            indices: ``(B,)`` dataset indices of this process's rows.
            probs: ``(B, C)`` their predicted probabilities.
            targets: optional ``(B,)`` labels (``divergence="paper"`` only; every process passes them, or none).
            epoch: the training epoch, for the once-an-epoch rule; None applies every first row.
            abort: this process withdraws (its own error follows): every other one raises ``PeerAborted``.

        Returns:
            ``(R,)`` the divergences of every process's rows (zero where not applied).
        """
        check_dataset_indices(indices[:0], self.num_samples)  # the type and shape here, the values once gathered
        indices = indices.detach().to(self.device)
        if probs.dim() != 2 or probs.shape != (indices.numel(), self.num_classes):
            raise ValueError(f"`probs` must have shape ({indices.numel()}, {self.num_classes}), got "
                             f"{tuple(probs.shape)}. Fix: one probability row per index, with as many classes as the "
                             f"memory was built for ({self.num_classes}).")
        probs = probs.detach().to(self.device, torch.float32)
        targets = None if targets is None else targets.detach().to(self.device, torch.long)
        every = self._gather(indices.long(), probs, targets, abort)
        if every is None:  # withdrawn
            return probs.new_zeros(0)
        self.rows_recorded += every.indices.numel()
        check_dataset_indices(every.indices, self.num_samples)
        first = deduplicate_first(every.indices)
        self.nonfinite_rows = self.nonfinite_rows + (first & ~every.finite).sum()
        keep = first & every.finite
        if epoch is not None:
            keep = keep & (self._last_update[every.indices] != epoch)
        divergence = self._score_rows(every, keep)
        target = torch.where(keep, every.indices, self.num_samples)  # rows not applied: the scratch row
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
        own = [indices, finite.long()] + ([] if targets is None else [targets])
        every = gather_padded(own + [probs] if self._gathers_probs else own, sizes)
        return StepRows(every[0], every[1].bool(), None if targets is None else every[2],
                        every[-1] if self._gathers_probs else probs, sizes)

    def _score_rows(self, every: StepRows, keep: Tensor) -> Tensor:
        """The divergences of the kept rows (zero elsewhere), their predictions stored."""
        target = torch.where(keep, every.indices, self.num_samples)
        divergence = tcs_divergence(self._rows[target].float(), every.probs, every.targets, self.divergence)
        self._rows[target] = every.probs.to(self.storage_dtype)
        return torch.where(keep, divergence, torch.zeros_like(divergence))

    def refresh_threshold(self) -> None:
        """Recompute the threshold from the scores of every sample seen so far (end of a pass)."""
        valid = self.seen & torch.isfinite(self.scores)  # a non-finite score must not set the threshold
        if bool(valid.any()):
            self.threshold = selection_threshold(self.scores[valid], self.ratio, self.threshold_rule)

    def select(self, indices: Tensor, epoch: int = 0) -> Tensor:
        """Boolean mask over ``indices``: a sample with a score when it is below the last pass's threshold, one
        without by ``initial_selection`` (``criterion="random"``: every sample by the random share of ``epoch``)."""
        check_dataset_indices(indices, self.num_samples)
        indices = indices.to(self.device, torch.long)
        if self.initial_selection == "all" and self.criterion == "tcs":
            initial = torch.ones_like(indices, dtype=torch.bool)
        else:
            if self._random_share is None or self._random_share[0] != epoch:  # drawn once an epoch
                share = random_selection(self.num_samples, self.ratio, self.seed, epoch)
                self._random_share = (epoch, share.to(self.device))
            initial = self._random_share[1][indices]
        if not self.has_threshold or self.criterion == "random":
            return initial
        return torch.where(self._seen[indices], self._scores[indices] < self.threshold, initial)

    def full_memory(self) -> Tensor | None:
        """Every sample's stored prediction, ``(N, C)`` on the CPU in the storage dtype."""
        return self.memory.cpu()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (CPU tensors; the memory in its storage dtype)."""
        return self._state(self.full_memory())

    def _state(self, memory: Tensor | None) -> dict[str, Any]:
        if memory is not None and memory.data_ptr() == self._rows.data_ptr():  # (a CPU memory: no copy made)
            memory = memory.clone()
        return {"version": _STATE_VERSION, "num_samples": self.num_samples, "num_classes": self.num_classes,
                "ratio": self.ratio, "storage_dtype": str(self.storage_dtype).removeprefix("torch."),
                "memory": memory, "scores": self.scores.cpu().clone(), "seen": self.seen.cpu().clone(),
                "last_update_epoch": self.last_update_epoch.cpu().clone(), "threshold": self.threshold.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of any storage dtype and layout (replicated or sharded, any world size);
        ValueError for another version, data set size or number of classes, or no stored predictions."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"This TCS state is of version {state.get('version')!r}; this package reads version "
                             f"{_STATE_VERSION}. Fix: resume with the lpa3-lightning version that wrote it, or start a "
                             "new run.")
        if state.get("num_samples") != self.num_samples or state.get("num_classes") != self.num_classes:
            raise ValueError(f"The checkpointed TCS memory is for {state.get('num_samples')} samples x "
                             f"{state.get('num_classes')} classes, but this training set has {self.num_samples} x "
                             f"{self.num_classes}. Fix: resume with the same training data, or start a new run "
                             "(drop `ckpt_path`) if the data set changed on purpose.")
        if state.get("memory") is None:
            raise ValueError("This TCS state has no stored predictions: it was taken on a process other than global "
                             "rank 0 of a run with a sharded memory (only rank 0 assembles them; its state is the one "
                             "a checkpoint holds). Fix: load the checkpoint file that rank 0 wrote, or rank 0's "
                             "state_dict().")
        self._load_rows(state["memory"])
        for buffer, key, dtype in ((self._scores, "scores", torch.float32), (self._seen, "seen", torch.bool),
                                   (self._last_update, "last_update_epoch", torch.long)):
            buffer[: self.num_samples] = state[key].to(self.device, dtype)
        self.threshold = state["threshold"].to(self.device, torch.float32).clone()

    def _load_rows(self, memory: Tensor) -> None:
        self._rows[: self.num_samples] = memory.to(self.device, self.storage_dtype)

