"""The label-preserving Fast Lagrangian solver of LP-A3 (input gradients only).

Solves, for each sample (Yang et al., NeurIPS 2022, eq. 6; solver: Fast Lagrangian
perceptual attack, Laidlaw et al., ICLR 2021, Alg. 3, as adapted in the authors' code)::

    x' = argmax ||phi(x') - phi(x)||_2   s.t.   log F(x')[y] >= log F(x)[y] - sigma

where ``phi`` are the model's own normalised activations (:mod:`lpa3_lightning.core.features`).
The loop is the authors' code's (docs/method.md): ``delta ~ U(-0.01, 0.01)``; for ``t < T``:
``step_t = sigma * 0.1**(t/T)``, ``lambda_t = lam * 0.1**(1 - t/T)``, gradient of
``-mean dist + lambda_t * mean relu(logp(x) - logp(x+delta) - sigma)`` w.r.t. ``delta``,
normalised per sample, and a step of ``step_t / slope`` where the slope of ``log p`` along
the step comes from a finite difference with ``h = 0.1``.

Improvement over the authors' code (``project=True``, the default): their step divides by
the slope of ``log p``, which is near zero where the model is confident, so the step
explodes and the constraint is often violated (docs/method.md: kept on 27% to 79% of samples).
Here every returned ``x'`` that broke the constraint is pulled back towards ``x`` along
its own perturbation by bisection, so ``log p(y|x') >= log p(y|x) - sigma`` holds for every
sample under the forward the attack used. ``project=False`` returns the authors' loop as is.

Invariants: parameters, their ``.grad``, the main BatchNorm running statistics and every
module's train/eval flag are exactly as before the call (also when it raises); gradients
are taken with :func:`torch.autograd.grad` w.r.t. the perturbation only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lpa3_lightning.core.arguments import check_int, check_number
from lpa3_lightning.core.batch_statistics import BatchStatistics
from lpa3_lightning.core.dual_bn import has_dual_bn
from lpa3_lightning.core.features import PerceptualFeatures
from lpa3_lightning.core.input_box import (
    InputRange,
    MaxStep,
    auto_max_step,
    auto_max_step_tensor,
    check_max_step,
    resolve_input_range,
)
from lpa3_lightning.core.model_outputs import unwrap_compiled
from lpa3_lightning.core.solver_forward import BN_MODES, label_log_prob, parameter_dtype, per_sample, solver_context
from lpa3_lightning.core.solver_graphs import SolverGraphs
from lpa3_lightning.core.solver_loop import SolveRows

__all__ = ["AttackStats", "check_solver_arguments", "lpa3_attack"]


@dataclass
class AttackStats:
    """Per-sample diagnostics of one solver call (all ``(N,)``, detached).

    Attributes:
        perceptual_distance: ``||phi(x') - phi(x)||_2``.
        logp_drop: ``log p(y|x) - log p(y|x')`` (the constraint is ``<= sigma``).
        preserved: whether the constraint holds for the returned ``x'``.
        projected: whether the solver's final iterate broke the constraint and the sample was
            pulled back (bisection; in fast mode, an earlier feasible iterate).
        l2: ``||x' - x||_2`` in input space.
    """

    perceptual_distance: Tensor
    logp_drop: Tensor
    preserved: Tensor
    projected: Tensor
    l2: Tensor


def check_solver_arguments(sigma: float, steps: int, lam: float, temperature: float, prefix: str = "") -> None:
    """Refuse solver settings out of range, naming the argument (after ``prefix``, e.g. ``"solver."``) and the fix.

    Raises:
        ValueError: if ``sigma`` is not positive and finite, ``steps`` not an int >= 1,
            ``lam`` negative or not finite, or ``temperature`` not positive.
    """
    check_number(sigma, "sigma", "use 0.002 to 0.02 (paper).", above=0)
    check_int(steps, "steps", 1, "use 5 (the paper's T).")
    check_number(lam, f"{prefix}lam", "use 1.0 (the authors').", minimum=0)
    check_number(temperature, f"{prefix}temperature", "use 1.0 (plain softmax).", above=0)


def _check_arguments(model: nn.Module, x: Tensor, y: Tensor, sigma: float, steps: int, lam: float,
                     temperature: float, bn_mode: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be an nn.Module, got {type(model).__name__}.")
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
        raise ValueError("`x` must be a floating tensor of shape (N, ...). Fix: pass a batch of inputs.")
    if not isinstance(y, Tensor) or y.shape != x.shape[:1] or y.is_floating_point():
        raise ValueError(
            f"`y` must be an integer tensor of shape ({x.shape[0]},) (one label per sample), got "
            f"{tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__}."
        )
    check_solver_arguments(sigma, steps, lam, temperature)
    if bn_mode not in BN_MODES:
        raise ValueError(f"`bn_mode` must be one of {BN_MODES}, got {bn_mode!r}. Fix: use 'eval' (running statistics), "
                         "'batch' (the clean batch's statistics) or 'twin' (with convert_dual_bn).")
    if bn_mode == "twin" and not has_dual_bn(model):
        raise ValueError("`bn_mode='twin'` needs a model with twin BatchNorms. Fix: call `convert_dual_bn(model)` "
                         "or use bn_mode='eval'.")
    if torch.is_inference_mode_enabled():
        raise RuntimeError("lpa3_attack needs autograd but runs under torch.inference_mode(). Fix: call it outside.")


def lpa3_attack(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    sigma: float = 0.02,
    steps: int = 5,
    lam: float = 1.0,
    layers: str | Sequence[str] | None = None,
    input_range: InputRange | str = "unset",
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    project: bool = True,
    bisection_steps: int = 8,
    bn_mode: Literal["eval", "twin", "batch"] = "eval",
    logits_fn: Callable[[Any], Tensor] | None = None,
    fast: bool = False,
    max_step: MaxStep = "auto",
    allow_tf32: bool = False,
    bn_statistics: BatchStatistics | None = None,
    return_stats: bool = False,
    sync_free: bool = False,
    graphs: SolverGraphs | None = None,
) -> Tensor | tuple[Tensor, AttackStats]:
    """Generate LP-A3 hard positives ``x'`` for a batch.

    Args:
        model: the classifier being trained (used as is; features come from forward hooks).
        x: ``(N, ...)`` inputs, in whatever space the model takes (normalised images,
            signals, tabular rows).
        y: ``(N,)`` labels to preserve (true labels or pseudo-labels).
        sigma: label-preserving margin on ``log p(y|x)``, also the step scale (paper: 0.002
            for CIFAR-10/STL-10, 0.02 for CIFAR-100 and MedMNIST).
        steps: solver iterations ``T`` (paper: 5).
        lam: scale of the Lagrange multiplier schedule ``lam * 0.1**(1 - t/T)`` (authors: 1).
        layers: feature layers (names / glob patterns); None for the documented default.
        input_range: valid input bounds, ``(low, high)`` (scalars or per channel) or
            ``{"mean": ..., "std": ...}`` of a normalisation of ``[0, 1]`` data; None for
            no clamping (non-image inputs). Left out, no clamping either, with a warning when
            ``x`` is an image batch ``(N, 1 or 3, H, W)``: ``x'`` would leave the pixels' range
            without a word (pass None to say there is no box).
        temperature: softmax temperature of ``log p``.
        generator: random generator for the initial noise (reproducibility).
        project: True (default) guarantees the constraint for every returned sample by a
            bisection towards ``x``, with a margin inside sigma
            (:func:`~lpa3_lightning.core.solver_loop.feasibility_margin`: 1% of sigma, at least
            1e-4) that another forward's float rounding cannot cross; False is the authors' loop
            unchanged.
        bisection_steps: halvings of the bisection (resolution ``2**-bisection_steps`` of the
            perturbation).
        bn_mode: ``"eval"`` (default): the whole model in eval mode, BN on its running
            statistics, nothing updated. ``"twin"``: as the authors, through the twin
            BatchNorms (see :func:`convert_dual_bn`) with batch statistics, here those of the
            clean batch, frozen for the call (the authors recompute them at every forward,
            which couples the samples and breaks a per-sample guarantee). ``"batch"``: the
            model's own BatchNorms (those in train mode) on the clean batch's frozen statistics,
            for a model without twins (:mod:`lpa3_lightning.core.batch_statistics`). Either way
            no running statistic moves and each sample's constraint is checked exactly.
        logits_fn: maps the model's output to logits (dict / tuple / dataclass outputs).
        fast: cheaper solver (not the authors'): the finite-difference slope of ``log p`` is
            measured at the first step only and reused by the later ones (no extra forward
            after step 0), and with ``project=True`` the constraint is kept by returning, per
            sample, the farthest feasible iterate met (every step and the end; ``x`` itself
            if none is feasible) instead of a bisection: ``steps + 3`` forwards and ``steps``
            input-gradient backwards, against ``2 * steps + 1`` forwards and ``steps`` full
            backwards for the authors' loop.
        max_step: largest L2 length of one solver step in input space (not the authors').
            ``"auto"`` (default): :func:`auto_max_step`, 2% of the input box's L2 diagonal.
            The authors' step is ``sigma`` divided by the finite-difference slope of ``log p``;
            where the model is saturated the slope is ~0 and one step jumps to the edge of the
            input box (``x'`` becomes clipped noise that still keeps the label). ``None`` is
            their unbounded step; a number sets the bound.
        allow_tf32: let the solver's convolutions and matrix products use TF32 on CUDA (the
            precision the rest of the run uses). False (default): full float32 inside the
            solver, because TF32's ~3 significant digits are the scale of sigma itself.
        bn_statistics: with ``bn_mode="twin"`` or ``"batch"``, the frozen batch statistics to
            normalise with (:func:`~lpa3_lightning.core.batch_statistics.frozen_batch_statistics`);
            None captures those of ``x``. The callback captures them once per batch from all the
            selected clean samples and trains ``x'`` with the same ones.
        return_stats: also return :class:`AttackStats`.
        sync_free: never read a device value on the host (no GPU synchronisation inside the
            call): the bisection evaluates every sample in each of its ``bisection_steps``
            iterations (a sample that already keeps the constraint keeps ``alpha = 1``) instead
            of only the violating ones, and runs even when none violates; the step bound is a
            tensor; the value checks of ``x`` (finite), ``y`` (in range) and ``input_range``
            (:func:`resolve_input_range`) are left to the caller (:class:`~lpa3_lightning.LPA3Callback` makes them in its one host read per
            step): a non-finite sample comes back unchanged and ``preserved=False``. Same
            ``x'`` as the default path up to float rounding of the batched forwards; more
            compute (``bisection_steps`` forwards of the whole batch), so the default (False)
            suits the CPU. On a GPU give ``input_range`` as device tensors
            (:func:`resolve_input_range`): built from Python numbers at each call it is a
            host-to-device copy, which synchronises too.
        graphs: with ``sync_free=True``, a :class:`~lpa3_lightning.core.solver_graphs.SolverGraphs`
            that runs the solve as a CUDA graph captured once per padded batch size (on a CPU
            it solves the padded rows eagerly). The same ``x'`` up to float rounding; in twin
            and batch mode without ``bn_statistics`` they are taken from ``x`` by one extra forward
            (padding rows must not enter them). Not yet run on a GPU.

    Returns:
        ``x'`` detached, with the shape, dtype and device of ``x``; and the stats if asked.
        The solver itself runs in the model's parameter dtype with autocast off (float32
        under mixed precision) and, on CUDA, TF32 off (``allow_tf32``); a lower-precision ``x`` is cast back
        after the check. The constraint holds as the solver's forward computes it: another
        forward (other batch size, other kernels) can differ by float32 rounding (~1e-6).

    Raises:
        ValueError: on a bad argument (naming it and the fix).
        TypeError: if the model output is not a tensor and no ``logits_fn`` was given.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        >>> x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
        >>> x_adv, stats = lpa3_attack(net, x, y, return_stats=True)
        >>> x_adv.shape == x.shape, bool(stats.preserved.all())
        (True, True)
    """
    _check_arguments(model, x, y, sigma, steps, lam, temperature, bn_mode)
    # A torch.compile'd module: attack its eager original, whose submodules take forward
    # hooks (the compiled graph would not call hooks registered after compilation).
    model = unwrap_compiled(model)
    if isinstance(bisection_steps, bool) or not isinstance(bisection_steps, int) or bisection_steps < 1:
        raise ValueError(f"`bisection_steps` must be an int >= 1, got {bisection_steps!r}. Fix: use 8.")
    check_max_step(max_step)
    if not isinstance(allow_tf32, bool):
        raise ValueError(f"`allow_tf32` must be True or False, got {allow_tf32!r}. Fix: use False (full float32).")
    y = y.long()
    n = x.shape[0]
    if n == 0:
        empty = torch.zeros(0, device=x.device)
        stats = AttackStats(empty, empty, empty.bool(), empty.bool(), empty)
        return (x.detach().clone(), stats) if return_stats else x.detach().clone()
    if not isinstance(sync_free, bool):
        raise ValueError(f"`sync_free` must be True or False, got {sync_free!r}. Fix: use False on the CPU.")
    if graphs is not None and not (isinstance(graphs, SolverGraphs) and sync_free):
        raise ValueError(f"`graphs` must be a SolverGraphs used with sync_free=True, got {type(graphs).__name__} with "
                         f"sync_free={sync_free}. Fix: pass sync_free=True (a captured solve cannot read the host), "
                         "or graphs=None.")
    if not sync_free and not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x.flatten(1))).any(1).nonzero().flatten().tolist()
        raise ValueError(f"`x` has NaN or Inf in samples {bad[:10]}. Fix: drop those samples before the attack.")
    if isinstance(input_range, str) and input_range == "unset":
        input_range = None
        if x.dim() == 4 and x.shape[1] in (1, 3):
            warnings.warn("lpa3_attack got no `input_range` for an image batch, so x' is not kept inside the pixels' "
                          "range (it may leave it, e.g. [-1.17, 1.01] on images in [-1, 1]). Fix: pass the box of the "
                          "inputs as the model receives them: input_range=(low, high), or {'mean': [...], 'std': [...]} "
                          "of the normalisation of [0, 1] pixels; input_range=None for unbounded inputs.", stacklevel=2)
    out_dtype = x.dtype
    x_given = x.detach()
    # Precision: the solver runs with autocast off, in the dtype of the model's parameters
    # (float32 under "bf16-mixed" / "16-mixed"). The margin sigma (0.002 to 0.02 in log p)
    # and the finite-difference slope are below what bfloat16 resolves (~3 significant
    # digits), so a reduced-precision attack would make the constraint check meaningless.
    # For the same reason TF32 (on by default for cuDNN convolutions on NVIDIA GPUs, ~3 digits)
    # is off inside the solver: measured on an H200, with it a re-evaluation of x' broke the
    # constraint by more than float noise on 2 of 64 samples.
    x = x.detach().to(parameter_dtype(model, x.dtype))
    if sync_free:  # a non-finite sample is attacked as zeros and returned unchanged
        finite = torch.isfinite(x.flatten(1)).all(dim=1)
        x = torch.where(per_sample(finite, x), x, torch.zeros_like(x))
    bounds = resolve_input_range(input_range, x, check_values=not sync_free)
    feats = PerceptualFeatures(model, layers=layers, logits_fn=logits_fn)
    if max_step == "auto":
        step_bound: float | Tensor | None = auto_max_step_tensor(x, bounds) if sync_free else auto_max_step(x, bounds)
    else:
        step_bound = max_step

    # drawn before the solve (not inside it) so that a captured solve reads it from a buffer;
    # the clean forward draws no random numbers, so the stream is the one the loop always used
    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    rows = SolveRows(feats, sigma=sigma, steps=steps, lam=lam, temperature=temperature, fast=fast, project=project,
                      bisection_steps=bisection_steps, sync_free=sync_free)
    if graphs is not None:
        if bn_mode != "eval" and bn_statistics is None:  # from the real rows, before any padding
            _, bn_statistics = label_log_prob(model, x, y, bn_mode=bn_mode, logits_fn=logits_fn,
                                              temperature=temperature, allow_tf32=allow_tf32)
        x_adv, logp0, logp_final, dist_final, projected = graphs.solve(
            rows, x, y, noise, bounds, step_bound,
            lambda statistics: solver_context(model, bn_mode, statistics, x.device, allow_tf32),
            bn_statistics if bn_mode != "eval" else None, model,
            key=(rows.settings(), bn_mode, layers if layers is None or isinstance(layers, str) else tuple(layers),
                 # the function itself, not its id: a bound method compares equal across accesses, and
                 # the key keeps it alive, so a new function cannot take a freed one's id
                 logits_fn, allow_tf32))
    else:
        with solver_context(model, bn_mode, bn_statistics, x.device, allow_tf32):
            x_adv, logp0, logp_final, dist_final, projected = rows(x, y, noise, bounds, step_bound)
    with torch.no_grad():
        if sync_free:
            x_adv = torch.where(per_sample(finite, x), x_adv, x_given)
            logp_final = torch.where(finite, logp_final, torch.full_like(logp_final, float("nan")))
        x_adv = x_adv.to(out_dtype)

    if not return_stats:
        return x_adv
    drop = (logp0 - logp_final).detach()
    stats = AttackStats(
        perceptual_distance=dist_final.detach(),
        logp_drop=drop,
        preserved=drop <= sigma,
        projected=projected,
        l2=(x_adv.to(x.dtype) - x).flatten(1).norm(dim=1),
    )
    return x_adv, stats
