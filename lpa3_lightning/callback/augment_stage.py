"""Stage 3 of a batch: the hard positives of the selected rows, solved or taken from the cache.

One path for every solver: the rows are gathered by position (the count is known on the host, so
no boolean indexing reads one back), the clean selected rows give the reference ``log p(y|x)``
and the twin statistics, the rows the module will train are solved (eagerly, sync-free, or as a
CUDA graph: a setting of the solver), and cached ``x'`` fill in the rest.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lpa3_lightning.callback.selection_stage import Selection
from lpa3_lightning.callback.settings import RunSettings
from lpa3_lightning.core.attack import lpa3_attack
from lpa3_lightning.core.augmented import AugmentedBatch, LPA3Request, selected_positions
from lpa3_lightning.core.augmented_forward import running_statistics
from lpa3_lightning.core.batch_plan import assemble_inputs, plan_rows
from lpa3_lightning.core.batch_statistics import resolve_bn_mode
from lpa3_lightning.core.cache import AugmentationCache
from lpa3_lightning.core.feature_layers import resolve_layers
from lpa3_lightning.core.input_box import InputRange, resolve_input_range
from lpa3_lightning.core.model_outputs import eval_mode, unwrap_compiled
from lpa3_lightning.core.solver_forward import label_log_prob, parameter_dtype
from lpa3_lightning.core.solver_graphs import SolverGraphs

__all__ = ["Augmenter", "NewRows", "batch_noise_seed", "check_logits", "noise_in_box", "warn_outside_box"]

#: (dataset indices, x', labels) of the rows solved in this batch, for the cache
NewRows = tuple[Tensor, Tensor, Tensor]


def batch_noise_seed(seed: int, rank: int, epoch: int, batch_idx: int) -> int:
    """The seed of one batch's solver noise on one process: a hash of the four numbers.

    Derived, not carried: a resumed run (from any checkpoint, on any number of processes) draws
    on every rank the noise that an uninterrupted run draws there, and no generator state has to
    be saved per rank.

    Example:
        >>> batch_noise_seed(0, 0, 3, 7) == batch_noise_seed(0, 0, 3, 7) != batch_noise_seed(0, 1, 3, 7)
        True
    """
    digest = hashlib.blake2b(f"{seed}/{rank}/{epoch}/{batch_idx}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _drop_selected(mask: Tensor, drop: Tensor) -> Tensor:
    """A copy of the batch mask ``mask`` without the selected rows flagged in ``drop`` (one flag per selected row)."""
    mask = mask.clone()
    mask[mask.nonzero().flatten()[drop]] = False
    return mask


class Augmenter:
    """One network's solver with the fit's settings, and what the last batch left for the steps
    after it (the reference ``log p`` of the trained rows, the eval-mode check, the time).

    Args:
        settings: the fit's resolved settings.
        seed_offset: added to the base seed (a module's second network draws other noise);
            each batch's noise is seeded by (seed, rank, epoch, batch index).
    """

    def __init__(self, settings: RunSettings, seed_offset: int = 0) -> None:
        self.settings, self.seed = settings, settings.seed + seed_offset
        self.graphs: SolverGraphs | None = SolverGraphs() if settings.runtime.cuda_graphs else None
        self.layer_names: list[str] | None = None  # resolved once a fit, by a probe forward for the default
        self.batch_key = (0, 0)  # (epoch, batch index): the noise seed of the batch being augmented
        self._generator: torch.Generator | None = None
        self._solver_range: tuple[tuple[Any, ...], InputRange] | None = None
        self._range_checked = False
        # what the last batch left for the steps after it
        self.pending: tuple[Tensor, Tensor] | None = None  # (clean log p(y|x), y) of the x' to be trained
        self.eval_preserved: Tensor | None = None
        self.solver_seconds: float | None = None
        self.input_distance: Tensor | None = None  # mean ||x' - x||_2 of a measured batch

    # ------------------------------------------------------------------ the batch
    def augment(self, module: Any, request: LPA3Request, selection: Selection, cache: AugmentationCache | None,
                epoch: int, solver_runs: bool, measure: bool) -> tuple[AugmentedBatch, NewRows | None]:
        """This rank's hard positives (no collective) and, with a cache, its newly solved rows.

        ``solver_runs``: with a cache, whether the solver runs in this epoch for rows without a
        fresh cached ``x'`` (without a cache it always does). ``measure``: whether this step's
        diagnostics are measured (the eval-mode check, the solver's time).
        """
        mask = selection.mask
        rows = selected_positions(mask, selection.count)
        x, y, idx = (t.index_select(0, rows.to(t.device)) for t in (request.inputs, request.targets, request.indices))
        reuse = solve = None  # per selected row, with a cache: taken from it / solved now
        if cache is not None:
            # a cached x' is reused only for the label it was solved for (pseudo-labels change)
            plan = plan_rows(cache.fresh(idx, epoch, y), solver_runs)
            if not bool(plan.keep.all()):
                mask = _drop_selected(mask, ~plan.keep)
                x, y, idx = x[plan.keep], y[plan.keep], idx[plan.keep]
            reuse, solve = plan.reuse[plan.keep], plan.solve[plan.keep]
        # The clean selected rows set the batch statistics (and the training forward's), whether or
        # not the module trains their x'; the rows it will not train (request.train_mask) are not
        # solved. With a cache every selected row is solved: a row skipped now could not be reused
        # in a later epoch where the module trains it, which would change that epoch's loss.
        reference_x, reference_y, skipped, trained = x, y, 0, None
        if cache is None and selection.num_trained < selection.count:
            skipped = selection.count - selection.num_trained
            in_mask = request.train_mask.to(mask.device)  # type: ignore[union-attr]
            trained = selected_positions(in_mask.index_select(0, rows), selection.num_trained)
            mask = mask & in_mask
            x, y, idx = (t.index_select(0, trained.to(t.device)) for t in (x, y, idx))
        model, bn_mode = self.attack_model(module, reference_x)
        if bn_mode == "batch":
            # The model's own BatchNorms normalise x' with the statistics of the clean batch it trains on
            # (every finite row), as they normalise its clean rows: a handful of selected rows would make
            # degenerate statistics (two rows: a variance from two values), on which log p turns so steep
            # that the bisection pulls nearly every x' back to x.
            finite_rows = selected_positions(selection.finite, request.inputs.shape[0] - selection.nonfinite)
            reference_x = request.inputs.index_select(0, finite_rows.to(request.inputs.device))
            reference_y = request.targets.index_select(0, finite_rows.to(request.targets.device))
        stats, bn_statistics, self.pending, self.eval_preserved = None, None, None, None
        self.solver_seconds = self.input_distance = None
        x_out, new_rows = x.detach().clone(), None
        if x.shape[0] and self.settings.augment != "lpa3":
            # a control: the same rows, labels and training forward, x' made without the solver (the
            # reference forward only on a measured step, for lpa3/label_preserved)
            if measure:
                _, bn_statistics = self.reference_forward(module, model, reference_x, reference_y, bn_mode,
                                                          trained, x, y)
            elif bn_mode == "eval":
                bn_statistics = running_statistics(model)
            x_out = self.control_inputs(x)
            if measure and self.settings.logging.eval_preservation:
                self.eval_preserved = self.preserved_in_eval_mode(module, model, x, x_out, y)
        elif x.shape[0]:
            frozen, bn_statistics = self.reference_forward(module, model, reference_x, reference_y, bn_mode,
                                                           trained, x, y)
            to_solve = x if solve is None else x[solve]
            solved = to_solve
            if to_solve.shape[0]:
                solved, stats = self._timed_solve(module, model, to_solve, y if solve is None else y[solve], bn_mode,
                                                  frozen, timed=measure and not self.settings.sync_free)
            if cache is None:
                x_out = solved
            else:
                from_cache = cache.get(idx[reuse]) if bool(reuse.any()) else None  # type: ignore[union-attr]
                x_out = assemble_inputs(x, solve, solved, reuse, from_cache)
                new_rows = (idx[solve], solved.detach(), y[solve])
            if measure and self.settings.logging.eval_preservation:
                self.eval_preserved = self.preserved_in_eval_mode(module, model, x, x_out, y)
        elif cache is not None:
            new_rows = (idx[:0], x[:0].detach(), y[:0])
        if measure and x.shape[0]:
            self.input_distance = (x_out.detach() - x).flatten(1).float().norm(dim=1).mean()
        augmented = AugmentedBatch(
            inputs=x_out, targets=y, indices=idx, mask=mask, stats=stats,
            reused=0 if reuse is None else int(reuse.sum()), bn_mode=bn_mode, bn_statistics=bn_statistics,
            allow_tf32=self.settings.solver.allow_tf32,
            reference_inputs=reference_x.detach() if bn_mode != "eval" and x.shape[0] else None, skipped=skipped,
            from_cache=reuse)
        return augmented, new_rows

    # ------------------------------------------------------------------ its parts
    def control_inputs(self, x: Tensor) -> Tensor:
        """The ``x'`` of a control (``augment``): ``"null"``, the rows unchanged; ``"noise"``, each row
        moved along a Gaussian direction (drawn from this batch's solver generator) until, clamped
        into the input box, it lies ``noise_norm`` from ``x`` in L2 (or as far as the box allows).
        Detached, like the solver's."""
        x = x.detach()
        if self.settings.augment == "null":
            return x.clone()
        direction = torch.randn(x.shape, generator=self.generator_for(x), device=x.device, dtype=x.dtype)
        direction = direction / direction.flatten(1).norm(dim=1).clamp_min(torch.finfo(x.dtype).tiny).view(
            -1, *[1] * (x.dim() - 1))
        return noise_in_box(x, direction, float(self.settings.noise_norm), self._range_for(x, x.dtype))

    def attack_model(self, module: Any, x: Tensor) -> tuple[nn.Module, str]:
        """The network the solver attacks and its BatchNorm mode; the default feature layers are
        those whose hooks fire in the solver's forwards, probed once with the first selected rows."""
        model = unwrap_compiled(module.lpa3_model())
        if self.layer_names is None and x.shape[0]:
            check_logits(module, model, x)
            self.layer_names = resolve_layers(model, self.settings.layers, example_input=x)
        return model, resolve_bn_mode(model, self.settings.solver.attack_bn)

    def reference_forward(self, module: Any, model: nn.Module, x: Tensor, y: Tensor, bn_mode: str,
                          trained: Tensor | None = None, x_trained: Tensor | None = None,
                          y_trained: Tensor | None = None) -> tuple[Any, Any]:
        """The clean ``log p(y|x)`` of the reference rows ``x`` under the normalisation that the
        solver checks and the training forward of x' uses, and their frozen batch statistics (None
        in ``"eval"`` mode) with the statistics x' is trained under. The reference of the rows to
        be trained (at the positions ``trained`` of ``x``, or ``x_trained`` in ``"batch"`` mode, whose
        reference rows are the whole clean batch) is kept to measure ``lpa3/label_preserved``."""
        solver = self.settings.solver
        options = dict(logits_fn=module.lpa3_logits, temperature=solver.temperature, allow_tf32=solver.allow_tf32)
        reference, frozen = label_log_prob(model, x, y, bn_mode=bn_mode, **options)
        if bn_mode == "batch":  # the trained rows' log p under the whole batch's statistics
            reference, _ = label_log_prob(model, x_trained, y_trained, bn_mode=bn_mode, statistics=frozen, **options)
            self.pending = (reference, y_trained)
        else:
            self.pending = (reference, y) if trained is None else \
                (reference.index_select(0, trained.to(reference.device)), y.index_select(0, trained.to(y.device)))
        return frozen, frozen if bn_mode != "eval" else running_statistics(model)

    def preserved_in_eval_mode(self, module: Any, model: nn.Module, x: Tensor, x_adv: Tensor, y: Tensor) -> Tensor:
        """Whether each x' keeps the constraint in the deployed model (eval mode, main BN)."""
        solver = self.settings.solver
        logp, _ = label_log_prob(model, torch.cat([x, x_adv]), torch.cat([y, y]), bn_mode="eval",
                                 logits_fn=module.lpa3_logits, temperature=solver.temperature,
                                 allow_tf32=solver.allow_tf32)
        clean, adv = logp.chunk(2)
        return adv >= clean - self.settings.sigma

    def _timed_solve(self, module: Any, model: nn.Module, x: Tensor, y: Tensor, bn_mode: str, frozen: Any,
                     timed: bool) -> tuple[Tensor, Any]:
        start = time.perf_counter()
        x_adv, stats = self.solve(module, model, x, y, self.generator_for(x), bn_mode, frozen)
        if timed:  # (timing needs a synchronisation: not on the sync-free path)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            self.solver_seconds = time.perf_counter() - start
        return x_adv, stats

    def solve(self, module: Any, model: nn.Module, x: Tensor, y: Tensor, generator: torch.Generator | None,
              bn_mode: str, frozen: Any = None, graphs: bool = True) -> tuple[Tensor, Any]:
        """The solver with this fit's settings (training batches and logged grids alike;
        ``graphs=False``: never through a CUDA graph, for a one-off solve such as a grid)."""
        s, solver = self.settings, self.settings.solver
        return lpa3_attack(
            model, x, y, sigma=s.sigma, steps=s.steps, lam=solver.lam,
            layers=self.layer_names if self.layer_names is not None else s.layers,
            input_range=self._range_for(x, parameter_dtype(model, x.dtype)), temperature=solver.temperature,
            generator=generator, project=solver.project, bn_mode=bn_mode, logits_fn=module.lpa3_logits,
            fast=solver.fast, max_step=solver.max_step, allow_tf32=solver.allow_tf32, bn_statistics=frozen,
            return_stats=True, sync_free=s.sync_free, graphs=self.graphs if graphs else None)

    def _range_for(self, x: Tensor, dtype: torch.dtype) -> InputRange:
        """The input range as ``(low, high)`` tensors on ``x``'s device in the solver's ``dtype``,
        resolved (its values checked on the host) once per device, dtype and input shape instead
        of at every solve: building them from Python numbers is a host-to-device copy. The first
        resolution also checks that the inputs lie in the box (one host read a fit)."""
        if self.settings.input_range is None:
            return None
        key = (x.device, dtype, tuple(x.shape[1:]))
        if self._solver_range is None or self._solver_range[0] != key:
            self._solver_range = (key, resolve_input_range(self.settings.input_range, x[:1].to(dtype)))
            if not self._range_checked:
                self._range_checked = True
                warn_outside_box(x, self._solver_range[1], self.settings.input_range)
        return self._solver_range[1]

    def generator_for(self, x: Tensor) -> torch.Generator:
        """The solver's generator for this batch, seeded by (seed, rank, epoch, batch index)."""
        if self._generator is None or self._generator.device != x.device:
            self._generator = torch.Generator(device=x.device)
        self._generator.manual_seed(batch_noise_seed(self.seed, self.settings.rank, *self.batch_key))
        return self._generator


def noise_in_box(x: Tensor, direction: Tensor, norm: float, box: tuple[Tensor, Tensor] | None) -> Tensor:
    """``x + s * direction`` clamped into ``box``, each row's scale ``s`` set so that the clamped row
    lies ``norm`` from ``x`` (L2): the clamp shortens a move that leaves the box, so the scale is
    found by bisection (the distance grows with it). A row whose box is too small for ``norm`` goes
    as far as 2^20 times ``norm`` takes it. ``direction``: unit rows.

    Example:
        >>> x = torch.zeros(1, 3)
        >>> moved = noise_in_box(x, torch.tensor([[0.8, 0.6, 0.0]]), 0.7, (torch.tensor(-0.5), torch.tensor(0.5)))
        >>> [round(v, 4) for v in moved[0].tolist()], round(float((moved - x).norm()), 4)
        ([0.5, 0.4899, 0.0], 0.7)
    """
    shape = (-1, *[1] * (x.dim() - 1))
    if box is None:
        return x + direction * norm

    def moved(scale: Tensor) -> Tensor:
        return torch.maximum(torch.minimum(x + direction * scale.view(shape), box[1]), box[0])

    def distance(scale: Tensor) -> Tensor:
        return (moved(scale) - x).flatten(1).norm(dim=1)

    low = torch.zeros(x.shape[0], device=x.device, dtype=x.dtype)
    high = torch.full_like(low, norm)
    for _ in range(20):  # grow the bracket where the clamp keeps the row short of the norm
        high = torch.where(distance(high) < norm, 2 * high, high)
    for _ in range(40):
        middle = (low + high) / 2
        short = distance(middle) < norm
        low, high = torch.where(short, middle, low), torch.where(short, high, middle)
    return moved(high)


def check_logits(module: Any, model: nn.Module, x: Tensor) -> None:
    """Once a fit, before the first solve: the logits must be ``(N, lpa3_num_classes)`` (narrower
    ones would fail deep inside the solver's gather; wider ones would size the TCS memory wrongly).
    One no-grad forward of one row in eval mode, flags restored.

    Raises:
        ValueError: naming ``lpa3_logits`` / ``lpa3_num_classes`` and the fix.
    """
    with torch.no_grad(), eval_mode(model):
        logits = module.lpa3_logits(model(x[:1]))
    if logits.dim() != 2:
        raise ValueError(
            f"{type(module).__name__}.lpa3_logits gives logits of shape {tuple(logits.shape)} for one input; LP-A3 "
            "needs (N, classes). Fix: make `lpa3_logits(output)` return the (N, classes) logits of the model's output "
            "(e.g. `return output.flatten(1)` or `return output[0]`)."
        )
    expected = module.lpa3_num_classes
    if logits.shape[-1] != expected:
        raise ValueError(
            f"{type(module).__name__}'s model gives logits of {logits.shape[-1]} classes but lpa3_num_classes is "
            f"{expected}. Fix: set `self.lpa3_num_classes` to the width of the model's logits (the number of classes), "
            "or make `lpa3_logits` return one column per class."
        )


#: A box is taken to exclude the data when more than this share of the input values lies outside it.
OUTSIDE_BOX_SHARE = 0.01


def warn_outside_box(x: Tensor, bounds: tuple[Tensor, Tensor] | None, input_range: Any) -> None:
    """Warn (once a fit, on the first rows solved) when more than 1% of the input values lie
    outside the solver's box: the clamp would then move ``x'`` far from ``x`` by itself."""
    if bounds is None or not x.numel():
        return
    low, high = bounds
    slack = 1e-4 * (high - low)
    outside = float(((x < low - slack) | (x > high + slack)).float().mean())
    if outside > OUTSIDE_BOX_SHARE:
        low_v, high_v = float(low.min()), float(high.max())
        rank_zero_warn(
            f"LPA3Callback: {100 * outside:.1f}% of the input values of the first selected rows lie outside the "
            f"solver's input box [{low_v:.3g}, {high_v:.3g}] (input_range={input_range!r}); the solver clamps x' "
            "into the box, so those x' jump to its edge instead of following the model's features. Fix: give "
            "input_range the range of the inputs as the model receives them: (low, high), or {'mean': [...], "
            "'std': [...]} of the normalisation applied to [0, 1] data, or None for unbounded inputs."
        )
