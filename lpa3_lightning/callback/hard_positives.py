"""One network's hard positives for one batch: the selected rows solved (or, with the controls, made without
the solver), cached ``x'`` filling in, and the forward the module trains them in; what the fit fixes for
them (:class:`FitPlan`: the network, its BatchNorm mode, feature layers, input box) resolved once.

The clean selected rows give the reference ``log p(y|x)`` and the twin statistics; the rows the module will
train (the request's ``train_mask``) are solved, the rest counted as skipped. What the step's later stages
need comes back in :class:`HardPositives`, the value the next stage receives.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lpa3_lightning.callback.settings import RunSettings
from lpa3_lightning.core.checks import eval_mode, unwrap_compiled
from lpa3_lightning.core.feature_layers import resolve_layers
from lpa3_lightning.core.features import PerceptualFeatures
from lpa3_lightning.core.cache import AugmentationCache, assemble_inputs, plan_rows
from lpa3_lightning.core.forward_modes import (
    BatchStatistics,
    augmented_logits,
    label_log_prob,
    parameter_dtype,
    resolve_bn_mode,
    running_statistics,
)
from lpa3_lightning.core.input_box import resolve_input_range
from lpa3_lightning.core.solver import AttackStats, auto_max_step, solve
from lpa3_lightning.methods.base import AugmentedBatch, LPA3Request, selected_positions

__all__ = ["FitPlan", "HardPositives", "VerifiedForward", "batch_noise_seed", "make_hard_positives", "noise_in_box"]

#: A box is taken to exclude the data when more than this share of the input values lies outside it.
OUTSIDE_BOX_SHARE = 0.01


class FitPlan:
    """One network's fit, resolved once: its model and BatchNorm mode (again only if the module replaces its
    network), its feature layers and a check of its logits (at the first solve: the default layers are those
    whose hooks fire, found by a probe forward), the input box and step bound (per input shape, device and
    dtype; the first resolution checks that the inputs lie in the box)."""

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self._model: nn.Module | None = None
        self.bn_mode = "eval"
        self.layer_names: list[str] | None = None
        self.features: PerceptualFeatures | None = None
        self._boxes: dict[tuple[Any, ...], tuple[tuple[Tensor, Tensor] | None, float | None]] = {}
        self._box_checked = False

    def model(self, module: Any) -> nn.Module:
        """The network the solver attacks (and its BatchNorm mode, :attr:`bn_mode`)."""
        model = unwrap_compiled(module.lpa3_model())
        if model is not self._model:
            self._model, self.features, self.layer_names = model, None, None
            self.bn_mode = resolve_bn_mode(model, self.settings.solver.attack_bn)
        return model

    def features_for(self, module: Any, x: Tensor) -> PerceptualFeatures:
        """The solver's features (layers resolved, logits checked, at the first call of the network)."""
        model = self.model(module)
        if self.features is None:
            check_logits(module, model, x)
            self.layer_names = resolve_layers(model, self.settings.layers, example_input=x)
            self.features = PerceptualFeatures(model, layers=self.layer_names, logits_fn=module.lpa3_logits)
        return self.features

    def box_for(self, x: Tensor) -> tuple[tuple[Tensor, Tensor] | None, float | None]:
        """``(bounds, step bound)`` for inputs like ``x`` (the box's tensors on its device and dtype)."""
        s = self.settings
        dtype = parameter_dtype(self._model, x.dtype) if self._model is not None else x.dtype
        key = (x.device, dtype, tuple(x.shape[1:]))
        if key not in self._boxes:
            bounds = resolve_input_range(s.input_range, x[:1].to(dtype))
            if bounds is not None and not self._box_checked:
                self._box_checked = True
                warn_outside_box(x, bounds, s.input_range)
            step = s.solver.max_step
            self._boxes[key] = (bounds, auto_max_step(x[:1].to(dtype), bounds) if step == "auto" and bounds is not None
                                else step)
        bounds, step = self._boxes[key]
        if step == "auto":  # without a box, auto measures each batch's spread
            return bounds, auto_max_step(x.to(dtype), None)
        return bounds, step


def check_logits(module: Any, model: nn.Module, x: Tensor) -> None:
    """Once a network, before its first solve: the logits must be ``(N, lpa3_num_classes)`` (one no-grad
    forward of one row in eval mode, flags restored).

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
    if logits.shape[-1] != module.lpa3_num_classes:
        raise ValueError(
            f"{type(module).__name__}'s model gives logits of {logits.shape[-1]} classes but lpa3_num_classes is "
            f"{module.lpa3_num_classes}. Fix: set `self.lpa3_num_classes` to the width of the model's logits (the "
            "number of classes), or make `lpa3_logits` return one column per class."
        )


def warn_outside_box(x: Tensor, bounds: tuple[Tensor, Tensor], input_range: Any) -> None:
    """Warn when more than 1% of the input values lie outside the solver's box (the clamp would then move
    ``x'`` far from ``x`` by itself)."""
    low, high = bounds
    slack = 1e-4 * (high - low)
    outside = float(((x < low - slack) | (x > high + slack)).float().mean())
    if outside > OUTSIDE_BOX_SHARE:
        rank_zero_warn(
            f"LPA3Callback: {100 * outside:.1f}% of the input values of the first selected rows lie outside the "
            f"solver's input box [{float(low.min()):.3g}, {float(high.max()):.3g}] (input_range={input_range!r}); the "
            "solver clamps x' into the box, so those x' jump to its edge instead of following the model's features. "
            "Fix: give input_range the range of the inputs as the model receives them: (low, high), or {'mean': "
            "[...], 'std': [...]} of the normalisation applied to [0, 1] data, or None for unbounded inputs."
        )


def batch_noise_seed(seed: int, rank: int, epoch: int, batch_idx: int) -> int:
    """The seed of one batch's solver noise on one process, a hash of the four numbers: a resumed run (from any
    checkpoint, on any number of processes) draws on every rank what an uninterrupted run draws there.

    Example:
        >>> batch_noise_seed(0, 0, 3, 7) == batch_noise_seed(0, 0, 3, 7) != batch_noise_seed(0, 1, 3, 7)
        True
    """
    digest = hashlib.blake2b(f"{seed}/{rank}/{epoch}/{batch_idx}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def noise_in_box(x: Tensor, direction: Tensor, norm: float, box: tuple[Tensor, Tensor] | None) -> Tensor:
    """``x + s * direction`` clamped into ``box``, each row's scale ``s`` set (by bisection: the distance grows
    with it) so that the clamped row lies ``norm`` from ``x`` in L2; a box too small for ``norm`` is crossed as
    far as ``2^20 norm`` takes it. ``direction``: unit rows.

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


class VerifiedForward:
    """The forward the module trains one batch's ``x'`` in (:meth:`AugmentedBatch.forward`): the solver's
    normalisation, kept here rather than handed to the module; the logits of ``x'`` it last gave (detached)
    are where the callback measures ``lpa3/label_preserved``."""

    def __init__(self, model: nn.Module, logits_fn: Any, bn_mode: str, statistics: BatchStatistics | None,
                 reference_inputs: Tensor | None, allow_tf32: bool) -> None:
        self.model, self.logits_fn, self.bn_mode, self.allow_tf32 = model, logits_fn, bn_mode, allow_tf32
        self.statistics, self.reference_inputs = statistics, reference_inputs
        self.logits: Tensor | None = None

    def __call__(self, inputs: Tensor, train_forward: str, of_x_prime: bool = False) -> Tensor:
        logits = augmented_logits(self.model, inputs, bn_mode=self.bn_mode, bn_statistics=self.statistics,
                                  reference_inputs=self.reference_inputs, logits_fn=self.logits_fn,
                                  train_forward=train_forward, allow_tf32=self.allow_tf32)
        if of_x_prime:
            self.logits = logits.detach()
        return logits


@dataclass
class HardPositives:
    """What one network's batch made, for the hand-over, the logs, the cache and the memory step.

    Attributes:
        augmented: what the module receives.
        forward: the forward it trains them in (None without ``x'``).
        stats: the solver's diagnostics of the rows it solved (None when it solved none).
        reference: the clean ``log p(y|x)`` of the ``x'`` the module trains (for ``lpa3/label_preserved``), or None.
        new_rows: with a cache, ``(indices, x', labels)`` solved now.
        solver_seconds, input_distance, eval_preserved: measured on a measured step (else None).
    """

    augmented: AugmentedBatch
    forward: VerifiedForward | None = None
    stats: AttackStats | None = None
    reference: Tensor | None = None
    new_rows: tuple[Tensor, Tensor, Tensor] | None = None
    solver_seconds: float | None = None
    input_distance: Tensor | None = None
    eval_preserved: Tensor | None = None


def make_hard_positives(plan: FitPlan, s: RunSettings, module: Any, request: LPA3Request, mask: Tensor, count: int,
                        cache: AugmentationCache | None, epoch: int, solver_runs: bool, measure: bool,
                        generator: torch.Generator, finite: Tensor) -> HardPositives:
    """The hard positives of the ``count`` rows ``mask`` selects (``finite``: the rows with finite inputs)."""
    rows = selected_positions(mask, count)
    x, y, idx = (t.index_select(0, rows.to(t.device)) for t in (request.inputs, request.targets, request.indices))
    reuse = solve_rows = None  # per selected row, with a cache: taken from it / solved now
    if cache is not None:
        # a cached x' is reused only for the label it was solved for (pseudo-labels change)
        row_plan = plan_rows(cache.fresh(idx, epoch, y), solver_runs)
        if not bool(row_plan.keep.all()):
            mask = mask.clone()
            mask[mask.nonzero().flatten()[~row_plan.keep]] = False
            x, y, idx = x[row_plan.keep], y[row_plan.keep], idx[row_plan.keep]
        reuse, solve_rows = row_plan.reuse[row_plan.keep], row_plan.solve[row_plan.keep]
    # the clean selected rows set the statistics whether or not the module trains their x'; the rows it will not
    # train are not solved (with a cache every row is: a later epoch may reuse it where the module trains it)
    reference_x, reference_y, skipped, trained = x, y, 0, None
    if cache is None and request.train_mask is not None:
        in_mask = request.train_mask.to(mask.device)
        keep = in_mask.index_select(0, rows)
        num_trained = int(keep.sum())
        skipped = x.shape[0] - num_trained
        trained = selected_positions(keep, num_trained)
        mask = mask & in_mask
        x, y, idx = (t.index_select(0, trained.to(t.device)) for t in (x, y, idx))
    model = plan.model(module)
    bn_mode = plan.bn_mode
    if bn_mode == "batch":  # the model's own BatchNorms normalise x' as its clean batch: every finite row
        finite_rows = selected_positions(finite, int(finite.sum()))
        reference_x, reference_y = (t.index_select(0, finite_rows.to(t.device)) for t in (request.inputs,
                                                                                          request.targets))
    made = HardPositives(AugmentedBatch(x.detach().clone(), y, idx, mask, skipped=skipped,
                                        from_cache=None if reuse is None else reuse))
    if x.shape[0] == 0:
        if cache is not None:
            made.new_rows = (idx[:0], x[:0].detach(), y[:0])
        return made
    dtype = parameter_dtype(model, x.dtype)
    features = plan.features_for(module, x.to(dtype))
    bounds, step_bound = plan.box_for(x.to(dtype))
    options = dict(logits_fn=module.lpa3_logits, temperature=s.solver.temperature, allow_tf32=s.solver.allow_tf32)
    frozen = None
    if s.augment == "lpa3" or measure:  # the reference log p and statistics (a control needs them only to measure)
        reference, frozen = label_log_prob(model, reference_x, reference_y, bn_mode=bn_mode, **options)
        if bn_mode == "batch":  # the trained rows' log p under the whole batch's statistics
            reference, _ = label_log_prob(model, x, y, bn_mode=bn_mode, statistics=frozen, **options)
        elif trained is not None:
            reference = reference.index_select(0, trained.to(reference.device))
        made.reference = reference
    statistics = frozen if bn_mode != "eval" else running_statistics(model)
    if s.augment == "lpa3":
        to_solve = x if solve_rows is None else x[solve_rows]
        solved = to_solve
        if to_solve.shape[0]:
            start = time.perf_counter()
            solved, made.stats = solve(features, to_solve.detach().to(dtype), (y if solve_rows is None else
                                       y[solve_rows]).long(), s.sigma, s.steps, s.solver, bn_mode=bn_mode,
                                       bounds=bounds, step_bound=step_bound, bn_statistics=frozen, generator=generator)
            solved = solved.to(x.dtype)
            if measure:
                if x.is_cuda:
                    torch.cuda.synchronize(x.device)
                made.solver_seconds = time.perf_counter() - start
        x_out = solved if cache is None else assemble_inputs(x, solve_rows, solved, reuse,
                                                              cache.get(idx[reuse]) if bool(reuse.any()) else None)
        if cache is not None:
            made.new_rows = (idx[solve_rows], solved.detach(), y[solve_rows])
    elif s.augment == "null":  # a control: the same rows, labels and forward, x' = x
        x_out = x.detach().clone()
    else:  # "noise": each row moved along a random direction to noise_norm, inside the box
        direction = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        direction = direction / direction.flatten(1).norm(dim=1).clamp_min(torch.finfo(x.dtype).tiny).view(
            -1, *[1] * (x.dim() - 1))
        x_out = noise_in_box(x.detach(), direction, float(s.noise_norm), None if bounds is None else
                             tuple(b.to(x.dtype) for b in bounds))  # type: ignore[arg-type]
    made.augmented.inputs = x_out.detach()
    if measure:
        made.input_distance = (x_out.detach() - x).flatten(1).float().norm(dim=1).mean()
        if s.logging.eval_preservation:
            logp, _ = label_log_prob(model, torch.cat([x, x_out]), torch.cat([y, y]), bn_mode="eval", **options)
            clean, adv = logp.chunk(2)
            made.eval_preserved = adv >= clean - s.sigma
    made.forward = made.augmented.verified = VerifiedForward(model, module.lpa3_logits, bn_mode, statistics,
                                                             reference_x.detach() if bn_mode != "eval" else None,
                                                             s.solver.allow_tf32)
    return made
