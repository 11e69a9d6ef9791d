"""The label-preserving Fast Lagrangian solver of LP-A3 (input gradients only; no Lightning).

Solves, per sample (Yang et al., NeurIPS 2022, eq. 6; Laidlaw et al.'s Fast Lagrangian attack as adapted in
the authors' code)::

    x' = argmax ||phi(x') - phi(x)||_2   s.t.   log F(x')[y] >= log F(x)[y] - sigma

with ``phi`` the model's own normalised activations (:mod:`lpa3_lightning.core.features`). The authors' loop:
``delta ~ U(-0.01, 0.01)``; for ``t < T`` a step of ``sigma 0.1^(t/T) / slope`` along the per-sample normalised
gradient of ``-mean dist + lam 0.1^(1 - t/T) mean relu(logp(x) - logp(x + delta) - sigma)``, the slope of
``log p`` from a finite difference with ``h = 0.1``. Parameters, ``.grad``, main BatchNorm statistics and
train/eval flags stay as they were (also on an error).

Departures from the authors' code, each with a switch (:class:`SolverSettings`):

- an ``x'`` that broke the constraint is pulled back towards ``x`` by bisection, a margin inside sigma (``project``);
- each step is at most 2% of the input box's L2 diagonal (``max_step="auto"``; theirs unbounded).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.core.checks import check_choice, check_flag, check_int, check_number, unwrap_compiled
from lpa3_lightning.core.dual_bn import has_dual_bn
from lpa3_lightning.core.features import PerceptualFeatures
from lpa3_lightning.core.forward_modes import (
    BN_MODES, BatchStatistics, attack_mode, label_logp, parameter_dtype, per_sample, solver_precision,
)
from lpa3_lightning.core.input_box import InputRange, resolve_input_range

__all__ = ["AttackStats", "MaxStep", "SolverSettings", "auto_max_step", "check_max_step", "feasibility_margin", "lpa3_attack",
           "solve"]

INIT_NOISE = 0.01  # half-width of the uniform initial perturbation (authors)
FD_STEP = 0.1  # finite-difference step h for the slope of log p (authors)
SLOPE_EPS = 1e-4  # added to the slope before dividing (authors)
GRAD_EPS = 1e-8  # added to the gradient norm before normalising (authors)

AUTO_MAX_STEP_FRACTION = 0.02  # max_step="auto": each step at most this fraction of the box's L2 diagonal
AUTO_BOX_STDS = 4.0  # without a box, it is estimated as +-2 batch standard deviations per input element

MaxStep = Union[float, Literal["auto"], None]


def check_max_step(max_step: MaxStep, name: str = "max_step") -> None:
    """Raise a ValueError naming ``name`` unless ``max_step`` is None, ``"auto"`` or a positive finite number."""
    if max_step is None or max_step == "auto":
        return
    if isinstance(max_step, bool) or not isinstance(max_step, (int, float)) or not math.isfinite(max_step) \
            or max_step <= 0:
        raise ValueError(f"`{name}` must be 'auto' (default), None (unbounded, the authors' step) or a positive "
                         f"finite number, got {max_step!r}. Fix: use 'auto', or e.g. max_step=1.0.")


def auto_max_step(x: Tensor, bounds: tuple[Tensor, Tensor] | None) -> float:
    """The default step bound: 2% of the L2 diagonal of the input box ``bounds``, or without one of a box of
    +-2 batch standard deviations per element (else the samples' mean L2 norm, else ``sqrt(#elements)``)."""
    sample, dtype = x[:1], torch.promote_types(x.dtype, torch.float32)  # (a float64 solve stays float64)
    if bounds is not None:
        diagonal = float((bounds[1] - bounds[0]).expand_as(sample).to(dtype).pow(2).sum().sqrt())
    else:
        flat = x.detach().to(dtype).flatten(1)
        diagonal = AUTO_BOX_STDS * float(flat.var(dim=0, unbiased=False).sum().sqrt()) if flat.shape[0] > 1 else 0.0
        if diagonal <= 0.0:
            diagonal = float(flat.norm(dim=1).mean())
        if diagonal <= 0.0:
            diagonal = math.sqrt(flat.shape[1])
    return AUTO_MAX_STEP_FRACTION * diagonal


def _check_settings(prefix: str, lam: Any, temperature: Any, max_step: Any, flags: dict[str, Any],
                    bisection_steps: Any) -> None:
    """The solver's settings, each refused by the name it was given under (``prefix`` + field)."""
    check_number(lam, f"{prefix}lam", "use 1.0 (the authors').", minimum=0)
    check_number(temperature, f"{prefix}temperature", "use 1.0 (plain softmax).", above=0)
    check_max_step(max_step, f"{prefix}max_step")
    for name, value in flags.items():
        check_flag(value, f"{prefix}{name}", "use the default.")
    check_int(bisection_steps, f"{prefix}bisection_steps", 1, "use 8.")


@dataclass(frozen=True)
class SolverSettings:
    """How each hard positive is solved: the solver's settings besides ``sigma`` and ``steps``, in one place.

    Attributes:
        lam: the Lagrange multiplier's scale (the authors: 1).
        temperature: softmax temperature of ``log p`` (and of the TCS predictions).
        project: keep the constraint on every sample by bisection (True) or run the authors' loop (False).
        max_step: largest L2 length of a step: ``"auto"`` (2% of the box diagonal), None (unbounded) or a number.
        fast: the slope measured once, the farthest feasible iterate kept instead of a bisection (``T + 3`` forwards).
        attack_bn: ``"twin"``, ``"batch"``, ``"eval"`` or ``"auto"`` (``forward_modes.resolve_bn_mode``).
        allow_tf32: let the solver use TF32 on CUDA (off: full float32).
        bisection_steps: halvings of the bisection (resolution ``2**-bisection_steps``).
    """

    lam: float = 1.0
    temperature: float = 1.0
    project: bool = True
    max_step: MaxStep = "auto"
    fast: bool = False
    attack_bn: Literal["auto", "twin", "batch", "eval"] = "auto"
    allow_tf32: bool = False
    bisection_steps: int = 8

    def __post_init__(self) -> None:
        check_choice(self.attack_bn, ("auto", *BN_MODES), "solver.attack_bn", "use 'auto'.")
        _check_settings("solver.", self.lam, self.temperature, self.max_step,
                        {"project": self.project, "fast": self.fast, "allow_tf32": self.allow_tf32},
                        self.bisection_steps)


@dataclass
class AttackStats:
    """Per-sample diagnostics of one solve (all ``(N,)``, detached): ``perceptual_distance``
    (``||phi(x') - phi(x)||``), ``logp_drop`` (``log p(y|x) - log p(y|x')``), ``preserved`` (the constraint
    holds), ``projected`` (the final iterate broke it and the sample was pulled back) and ``l2``
    (``||x' - x||`` in input space)."""

    perceptual_distance: Tensor
    logp_drop: Tensor
    preserved: Tensor
    projected: Tensor
    l2: Tensor


def feasibility_margin(sigma: float) -> float:
    """How far inside sigma a projected ``x'`` is kept, so that another forward's float rounding cannot
    cross it: 1% of sigma, at least 1e-4, at most half of sigma."""
    return min(max(0.01 * sigma, 1e-4), 0.5 * sigma)


def solve(features: PerceptualFeatures, x: Tensor, y: Tensor, sigma: float, steps: int, settings: SolverSettings, *,
          bn_mode: str, bounds: tuple[Tensor, Tensor] | None, step_bound: float | None,
          bn_statistics: BatchStatistics | None = None, generator: torch.Generator | None = None
          ) -> tuple[Tensor, AttackStats]:
    """``(x', stats)`` on checked inputs: ``x`` in the parameters' dtype, ``y`` long, ``bounds`` resolved
    (:func:`resolve_input_range`), ``step_bound`` the L2 bound of one step (None: unbounded)."""
    with attack_mode(features.model, bn_mode, bn_statistics), torch.enable_grad(), \
            solver_precision(x.device, settings.allow_tf32):
        x_adv, logp0, logp_final, dist_final, projected = _loop(features, x, y, sigma, steps, settings, bounds,
                                                                 step_bound, generator)
    drop = (logp0 - logp_final).detach()
    return x_adv, AttackStats(dist_final.detach(), drop, drop <= sigma, projected, (x_adv - x).flatten(1).norm(dim=1))


def _loop(features: PerceptualFeatures, x: Tensor, y: Tensor, sigma: float, steps: int, s: SolverSettings,
          bounds: tuple[Tensor, Tensor] | None, step_bound: float | None, generator: torch.Generator | None
          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    temperature = s.temperature
    kept = sigma - feasibility_margin(sigma) if s.project else sigma  # projected rows keep a margin

    def clamp(v: Tensor) -> Tensor:
        return v if bounds is None else torch.maximum(torch.minimum(v, bounds[1]), bounds[0])

    def evaluate(delta: Tensor, alpha: Tensor, which: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # rows alone (``which``) are valid: in every BN mode a sample's output depends on that sample alone
        xs, ys, phis = (x, y, phi0) if which is None else (x[which], y[which], phi0[which])
        if which is not None:
            alpha, delta = alpha[which], delta[which]
        logits, phi = features(xs + per_sample(alpha, xs).to(xs.dtype) * delta)
        return label_logp(logits, ys, temperature), (phi - phis).norm(dim=1)

    with torch.no_grad():
        logits0, phi0 = features(x)
        if logits0.dim() != 2:
            raise ValueError(f"The model's logits must have shape (N, classes), got {tuple(logits0.shape)}. "
                             "Fix: pass `logits_fn` mapping the output to logits.")
        if int(y.max()) >= logits0.shape[1] or int(y.min()) < 0:
            raise ValueError(f"`y` must hold class indices in [0, {logits0.shape[1] - 1}] for logits of shape "
                             f"{tuple(logits0.shape)}, got values in [{int(y.min())}, {int(y.max())}]. Fix: pass labels "
                             "as class indices of this model's output.")
        logp0 = label_logp(logits0, y, temperature)
    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    delta = clamp(x + (2 * noise - 1) * INIT_NOISE) - x
    # fast: the farthest feasible iterate (delta, log p, distance), starting at x
    best = (torch.zeros_like(delta), logp0.clone(), torch.zeros_like(logp0)) if s.fast and s.project else None
    for t in range(steps):
        step, lam_t = sigma * 0.1 ** (t / steps), s.lam * 0.1 ** (1 - t / steps)
        delta.requires_grad_(True)
        logits, phi = features(x + delta)
        logp = label_logp(logits, y, temperature)
        dist = (phi - phi0).norm(dim=1)
        # the authors' batch means: each row's gradient scaled by 1/N before GRAD_EPS joins its norm
        loss = -dist.mean() + lam_t * F.relu(logp0 - logp - sigma).mean()
        (grad,) = torch.autograd.grad(loss, delta)
        with torch.no_grad():
            delta, logp, dist = delta.detach(), logp.detach(), dist.detach()
            g_hat = grad / (per_sample(grad.flatten(1).norm(dim=1), x) + GRAD_EPS)
            if best is not None:
                best = _farther(best, delta, logp, dist, logp0 - kept)
            if not (s.fast and t > 0):  # the authors' finite difference along the new direction (fast: once)
                logp_fd = label_logp(features.logits_fn(features.model(x + delta - FD_STEP * g_hat)), y, temperature)
                slope = (logp - logp_fd).abs() / FD_STEP
            length = step / (slope + SLOPE_EPS)
            if step_bound is not None:
                length = torch.clamp(length, max=step_bound)
            delta = clamp(x + delta - g_hat * per_sample(length, x).to(x.dtype)) - x
    with torch.no_grad():
        alpha = torch.ones(x.shape[0], device=x.device)
        logp_final, dist_final = evaluate(delta, alpha)
        ok = logp_final >= logp0 - kept
        projected = torch.zeros_like(ok)
        if best is not None:
            delta, logp_final, dist_final = _farther(best, delta, logp_final, dist_final, logp0 - kept)
            projected = ~ok
        elif s.project and not bool(ok.all()):
            projected = ~ok
            alpha, logp_final, dist_final = _bisect(evaluate, delta, ok, logp_final, dist_final, logp0, kept,
                                                    s.bisection_steps)
        x_adv = (x + per_sample(alpha, x).to(x.dtype) * delta).detach()
        # a row the solver could not keep finite (a NaN gradient from the model's backward) goes back to x
        finite = torch.isfinite(x_adv.flatten(1)).all(dim=1)
        x_adv = torch.where(per_sample(finite, x), x_adv, x)
        dist_final = torch.where(finite, dist_final, torch.zeros_like(dist_final))
        logp_final = torch.where(finite, logp_final, logp0)
    return x_adv, logp0, logp_final, dist_final, projected


def _farther(best: tuple[Tensor, Tensor, Tensor], delta: Tensor, logp: Tensor, dist: Tensor,
             floor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``best`` (delta, log p, distance per sample) with each feasible iterate at least as far taken over."""
    better = (logp >= floor) & (dist >= best[2])
    return (torch.where(per_sample(better, delta), delta, best[0]), torch.where(better, logp, best[1]),
            torch.where(better, dist, best[2]))


def _bisect(evaluate: Callable[..., tuple[Tensor, Tensor]], delta: Tensor, ok: Tensor, logp: Tensor, dist: Tensor,
            logp0: Tensor, sigma: float, steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """The largest feasible ``alpha`` in [0, 1] per violating sample (0 is ``x``, always feasible); invariant:
    ``lo`` is feasible (its log p and distance recorded), ``hi`` is not."""
    todo = ~ok
    lo, hi = torch.where(ok, 1.0, 0.0), torch.ones_like(logp)
    logp, dist = torch.where(ok, logp, logp0), torch.where(ok, dist, torch.zeros_like(dist))
    for _ in range(steps):
        mid = torch.where(todo, (lo + hi) / 2, lo)
        logp_mid, dist_mid = evaluate(delta, mid, todo)
        good = logp_mid >= logp0[todo] - sigma
        idx = todo.nonzero().flatten()
        up, down = idx[good], idx[~good]
        lo[up], logp[up], dist[up] = mid[up], logp_mid[good], dist_mid[good]
        hi[down] = mid[down]
    return lo, logp, dist


def lpa3_attack(model: nn.Module, x: Tensor, y: Tensor, *, sigma: float = 0.02, steps: int = 5, lam: float = 1.0,
                layers: str | Sequence[str] | None = None, input_range: InputRange | str = "unset",
                temperature: float = 1.0, generator: torch.Generator | None = None, project: bool = True,
                bisection_steps: int = 8, bn_mode: Literal["eval", "twin", "batch"] = "eval",
                logits_fn: Callable[[Any], Tensor] | None = None, fast: bool = False, max_step: MaxStep = "auto",
                allow_tf32: bool = False, bn_statistics: BatchStatistics | None = None, return_stats: bool = False
                ) -> Tensor | tuple[Tensor, AttackStats]:
    """Generate LP-A3 hard positives ``x'`` for a batch.

    Args:
        model: the classifier being trained (used as is; the features come from forward hooks).
        x: ``(N, ...)`` inputs in the space the model takes (normalised images, signals, tabular rows).
        y: ``(N,)`` labels to preserve (true labels or pseudo-labels).
        sigma: the margin on ``log p(y|x)`` and step scale (paper: 0.002 CIFAR-10/STL-10, 0.02 CIFAR-100/MedMNIST).
        steps: solver iterations ``T`` (paper: 5).
        lam, temperature, project, fast, max_step, allow_tf32, bisection_steps: :class:`SolverSettings`.
        layers: feature layers (names / glob patterns); None for the documented default.
        input_range: the valid input box (:func:`~lpa3_lightning.core.input_box.resolve_input_range`); None for
            no clamping. Left out: no clamping, with a warning for an image batch ``(N, 1 or 3, H, W)``.
        generator: the initial noise's generator.
        bn_mode: ``"eval"`` (the running statistics), ``"twin"`` (the twin BatchNorms) or ``"batch"`` (the
            model's own), the last two on frozen batch statistics: ``bn_statistics``, or those of ``x``.
        logits_fn: maps the model's output to logits (dict / tuple / dataclass outputs).
        bn_statistics: see ``bn_mode``.
        return_stats: also return :class:`AttackStats`.

    Returns:
        ``x'`` detached, with the shape, dtype and device of ``x`` (solved in the parameters' dtype, autocast
        off), and the stats if asked.

    Raises:
        ValueError: on a bad argument (naming it and the fix).
        TypeError: if the output is not a tensor and no ``logits_fn`` was given.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        >>> x_adv, stats = lpa3_attack(net, torch.randn(4, 8), torch.tensor([0, 1, 2, 0]), return_stats=True)
        >>> tuple(x_adv.shape), bool(stats.preserved.all())
        ((4, 8), True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be an nn.Module, got {type(model).__name__}. Fix: pass the network, not its "
                        "output or a LightningModule's checkpoint.")
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
        raise ValueError("`x` must be a floating tensor of shape (N, ...). Fix: pass a batch of inputs.")
    if not isinstance(y, Tensor) or y.shape != x.shape[:1] or y.is_floating_point():
        raise ValueError(f"`y` must be an integer tensor of shape ({x.shape[0]},) (one label per sample), got "
                         f"{tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__}. Fix: pass the class "
                         "indices as a long tensor.")
    check_number(sigma, "sigma", "use 0.002 to 0.02 (paper).", above=0)
    check_int(steps, "steps", 1, "use 5 (the paper's T).")
    _check_settings("", lam, temperature, max_step, {"project": project, "fast": fast, "allow_tf32": allow_tf32},
                    bisection_steps)
    settings = SolverSettings(lam=lam, temperature=temperature, project=project, max_step=max_step, fast=fast,
                              allow_tf32=allow_tf32, bisection_steps=bisection_steps)
    check_choice(bn_mode, BN_MODES, "bn_mode", "use 'eval' (running statistics), 'batch' (the clean batch's "
                 "statistics) or 'twin' (with convert_dual_bn).")
    if bn_mode == "twin" and not has_dual_bn(model):
        raise ValueError("`bn_mode='twin'` needs a model with twin BatchNorms. Fix: call `convert_dual_bn(model)` "
                         "or use bn_mode='eval'.")
    if torch.is_inference_mode_enabled():
        raise RuntimeError("lpa3_attack needs autograd but runs under torch.inference_mode(). Fix: call it outside.")
    if not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x.flatten(1))).any(1).nonzero().flatten().tolist()
        raise ValueError(f"`x` has NaN or Inf in samples {bad[:10]}. Fix: drop those samples before the attack.")
    if isinstance(input_range, str) and input_range == "unset":
        input_range = None
        if x.dim() == 4 and x.shape[1] in (1, 3):
            warnings.warn("lpa3_attack got no `input_range` for an image batch, so x' is not kept inside the pixels' "
                          "range (it may leave it, e.g. [-1.17, 1.01] on images in [-1, 1]). Fix: pass the box of the "
                          "inputs as the model receives them: input_range=(low, high), or {'mean': [...], 'std': [...]} "
                          "of the normalisation of [0, 1] pixels; input_range=None for unbounded inputs.", stacklevel=2)
    model = unwrap_compiled(model)  # a compiled graph would not call hooks registered after compilation
    if x.shape[0] == 0:
        empty = torch.zeros(0, device=x.device)
        stats = AttackStats(empty, empty, empty.bool(), empty.bool(), empty)
        return (x.detach().clone(), stats) if return_stats else x.detach().clone()
    out_dtype, x = x.dtype, x.detach().to(parameter_dtype(model, x.dtype))
    bounds = resolve_input_range(input_range, x)
    step_bound = auto_max_step(x, bounds) if max_step == "auto" else max_step
    x_adv, stats = solve(PerceptualFeatures(model, layers=layers, logits_fn=logits_fn), x, y.long(), sigma, steps,
                         settings, bn_mode=bn_mode, bounds=bounds, step_bound=step_bound, bn_statistics=bn_statistics,
                         generator=generator)
    return (x_adv.to(out_dtype), stats) if return_stats else x_adv.to(out_dtype)
