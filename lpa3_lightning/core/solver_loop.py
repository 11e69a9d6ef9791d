"""The solver's loop on a batch (the authors' Fast Lagrangian steps), the fast variant's best
feasible iterate, and the bisection that pulls an ``x'`` that broke the constraint back
towards ``x`` (docs/method.md, section 2)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lpa3_lightning.core.features import PerceptualFeatures
from lpa3_lightning.core.solver_forward import label_logp, per_sample

INIT_NOISE = 0.01  # half-width of the uniform initial perturbation (authors)
FD_STEP = 0.1  # finite-difference step h for the slope of log p (authors)
SLOPE_EPS = 1e-4  # added to the slope before dividing (authors)
GRAD_EPS = 1e-8  # added to the gradient norm before normalising (authors)


def feasibility_margin(sigma: float) -> float:
    """How far inside the constraint a projected ``x'`` is kept (not the authors'): the solver
    accepts ``log p(y|x') >= log p(y|x) - (sigma - margin)``, so that another forward of the same
    rows (the training forward of ``x'``: another batch composition, other kernels, float32) still
    finds them within sigma. Measured on a torchvision ResNet-18 in float32: the training forward's
    ``log p`` differed from the solver's by up to 3e-5, and one ``x'`` in 62 left at the boundary
    broke sigma by 2e-5 there. The margin: 1% of sigma, at least 1e-4 (and at most half of sigma).

    Example:
        >>> feasibility_margin(0.02), feasibility_margin(0.002)
        (0.0002, 0.0001)
    """
    return min(max(0.01 * sigma, 1e-4), 0.5 * sigma)


class SolveRows:
    """The solver's loop on a batch whose every input is a tensor (noise, bounds and step bound included).

    Called inside :func:`solver_context`. With ``sync_free=True`` it reads no device value on the
    host and dispatches the same operators whatever the data, so it can be captured as a CUDA
    graph (:class:`~lpa3_lightning.core.solver_graphs.SolverGraphs`) and replayed on new values.

    Returns:
        ``(x_adv, logp0, logp_final, dist_final, projected)``: ``x_adv`` in ``x``'s dtype, the
        others ``(N,)``.
    """

    def __init__(self, feats: PerceptualFeatures, *, sigma: float, steps: int, lam: float, temperature: float,
                 fast: bool, project: bool, bisection_steps: int, sync_free: bool) -> None:
        self.feats = feats
        self.sigma, self.steps, self.lam, self.temperature = sigma, steps, lam, temperature
        self.fast, self.project, self.bisection_steps, self.sync_free = fast, project, bisection_steps, sync_free

    def settings(self) -> tuple[Any, ...]:
        """The Python numbers the loop bakes into its operators (part of a captured graph's key)."""
        return (self.sigma, self.steps, self.lam, self.temperature, self.fast, self.project, self.bisection_steps)

    def __call__(self, x: Tensor, y: Tensor, noise: Tensor, bounds: tuple[Tensor, Tensor] | None,
                 step_bound: float | Tensor | None, row_weights: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Solve; ``row_weights`` (``(N,)``, 1/n on n real rows and 0 on padding) replaces the
        batch mean of the loss, so that padding rows change no real row's step."""
        feats, sigma, steps, temperature = self.feats, self.sigma, self.steps, self.temperature
        fast, project, sync_free = self.fast, self.project, self.sync_free
        # the feasibility test keeps a margin inside sigma (projected rows only); the loss is the authors'
        kept = sigma - feasibility_margin(sigma) if project else sigma

        def clamp(v: Tensor) -> Tensor:
            return v if bounds is None else torch.maximum(torch.minimum(v, bounds[1]), bounds[0])

        def batch_mean(v: Tensor) -> Tensor:
            # The authors' loss is a batch mean: each row's gradient is scaled by 1/N before its
            # normalisation adds GRAD_EPS, so N shows in the direction where the gradient is small.
            return v.mean() if row_weights is None else (v * row_weights).sum()

        with torch.no_grad():
            logits0, phi0 = feats(x)
            if logits0.dim() != 2:
                raise ValueError(f"The model's logits must have shape (N, classes), got {tuple(logits0.shape)}. "
                                 "Fix: pass `logits_fn` mapping the output to logits.")
            if not sync_free and (int(y.max()) >= logits0.shape[1] or int(y.min()) < 0):
                raise ValueError(
                    f"`y` must hold class indices in [0, {logits0.shape[1] - 1}] for logits of shape "
                    f"{tuple(logits0.shape)}, got values in [{int(y.min())}, {int(y.max())}]. Fix: pass labels as "
                    "class indices of this model's output."
                )
            logp0 = label_logp(logits0, y, temperature)
        delta = clamp(x + (2 * noise - 1) * INIT_NOISE) - x
        # fast mode: the best feasible iterate seen so far (farthest in feature space)
        best = _BestFeasible(delta, logp0) if fast and project else None
        for t in range(steps):
            step = sigma * 0.1 ** (t / steps)
            lam_t = self.lam * 0.1 ** (1 - t / steps)
            delta.requires_grad_(True)
            logits, phi = feats(x + delta)
            logp = label_logp(logits, y, temperature)
            dist = (phi - phi0).norm(dim=1)
            loss = -batch_mean(dist) + lam_t * batch_mean(F.relu(logp0 - logp - sigma))
            (grad,) = torch.autograd.grad(loss, delta)
            with torch.no_grad():
                delta, logp, dist = delta.detach(), logp.detach(), dist.detach()
                g_hat = grad / (per_sample(grad.flatten(1).norm(dim=1), x) + GRAD_EPS)
                if best is not None:
                    best.offer(delta, logp, dist, logp0 - kept)
                if not (fast and t > 0):  # the authors' finite difference along the new direction
                    logits_fd = feats.model(x + delta - FD_STEP * g_hat)
                    logp_fd = label_logp(feats.logits_fn(logits_fd), y, temperature)
                    slope = (logp - logp_fd).abs() / FD_STEP
                # fast: the first step's slope is reused (no extra forward after step 0)
                length = step / (slope + SLOPE_EPS)
                if step_bound is not None:
                    length = torch.clamp(length, max=step_bound)
                delta = clamp(x + delta - g_hat * per_sample(length, x).to(x.dtype)) - x

        with torch.no_grad():
            evaluate = _Evaluator(feats, x, y, phi0, temperature)
            alpha = torch.ones(x.shape[0], device=x.device)
            logp_final, dist_final = evaluate(delta, alpha)
            ok = logp_final >= logp0 - kept
            projected = torch.zeros_like(ok)
            if best is not None:
                best.offer(delta, logp_final, dist_final, logp0 - kept)
                projected = ~ok  # as in the default mode: the final iterate broke the constraint
                delta, logp_final, dist_final = best.delta, best.logp, best.dist
            elif project and sync_free:
                projected = ~ok
                alpha, logp_final, dist_final = _bisect_all_rows(evaluate, delta, ok, logp_final, dist_final, logp0,
                                                                 kept, self.bisection_steps)
            elif project and not bool(ok.all()):
                projected = ~ok
                alpha, logp_final, dist_final = _bisect(evaluate, delta, ok, logp_final, dist_final, logp0, kept,
                                                        self.bisection_steps)
            x_adv = (x + per_sample(alpha, x).to(x.dtype) * delta).detach()
            # a row the solver could not keep finite (a NaN gradient from the model's backward)
            # goes back to x: training on it would turn the weights to NaN. It counts as not moved.
            finite = torch.isfinite(x_adv.flatten(1)).all(dim=1)
            x_adv = torch.where(per_sample(finite, x), x_adv, x)
            dist_final = torch.where(finite, dist_final, torch.zeros_like(dist_final))
            logp_final = torch.where(finite, logp_final, logp0)
        return x_adv, logp0, logp_final, dist_final, projected


class _BestFeasible:
    """Per sample, the feasible iterate farthest from ``x`` in feature space (fast mode).

    Starts at ``delta = 0`` (``x`` itself: feasible by definition, distance 0).
    """

    def __init__(self, delta: Tensor, logp0: Tensor) -> None:
        self.delta = torch.zeros_like(delta)
        self.logp = logp0.clone()
        self.dist = torch.zeros_like(logp0)

    def offer(self, delta: Tensor, logp: Tensor, dist: Tensor, floor: Tensor) -> None:
        better = (logp >= floor) & (dist >= self.dist)  # selected with torch.where: no host read
        self.delta = torch.where(per_sample(better, delta), delta, self.delta)
        self.logp = torch.where(better, logp, self.logp)
        self.dist = torch.where(better, dist, self.dist)


class _Evaluator:
    """``log p(y|x + alpha * delta)`` and the perceptual distance, for a subset of samples.

    Valid because every sample's output depends on that sample alone in both BN modes.
    """

    def __init__(self, feats: PerceptualFeatures, x: Tensor, y: Tensor, phi0: Tensor, temperature: float) -> None:
        self.feats, self.x, self.y, self.phi0 = feats, x, y, phi0
        self.temperature = temperature

    def __call__(self, delta: Tensor, alpha: Tensor, which: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Evaluate the samples ``which`` (a boolean mask: a host read), or all of them (None)."""
        x, y, phi0 = self.x, self.y, self.phi0
        if which is not None:
            x, y, phi0, alpha, delta = x[which], y[which], phi0[which], alpha[which], delta[which]
        logits, phi = self.feats(x + per_sample(alpha, x).to(x.dtype) * delta)
        return label_logp(logits, y, self.temperature), (phi - phi0).norm(dim=1)


def _bisect(evaluate: _Evaluator, delta: Tensor, ok: Tensor, logp: Tensor, dist: Tensor, logp0: Tensor,
            sigma: float, steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """Largest feasible ``alpha`` in [0, 1] per violating sample (alpha = 0 is x, always feasible).

    Invariant: ``lo`` is feasible (its log p and distance are recorded), ``hi`` is not.
    """
    todo = ~ok
    lo = torch.where(ok, 1.0, 0.0)
    hi = torch.ones_like(lo)
    logp = torch.where(ok, logp, logp0)
    dist = torch.where(ok, dist, torch.zeros_like(dist))
    for _ in range(steps):
        mid = torch.where(todo, (lo + hi) / 2, lo)
        logp_mid, dist_mid = evaluate(delta, mid, todo)
        good = logp_mid >= logp0[todo] - sigma
        idx = todo.nonzero().flatten()
        up, down = idx[good], idx[~good]
        lo[up] = mid[up]
        logp[up] = logp_mid[good]
        dist[up] = dist_mid[good]
        hi[down] = mid[down]
    return lo, logp, dist


def _bisect_all_rows(evaluate: _Evaluator, delta: Tensor, ok: Tensor, logp: Tensor, dist: Tensor, logp0: Tensor,
                     sigma: float, steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_bisect` without a host read: every sample is evaluated in every iteration.

    A sample that keeps the constraint at ``alpha = 1`` is evaluated there again and keeps it
    (its rows only cost compute); the others halve ``[lo, hi]`` as in :func:`_bisect`, with the
    updates selected by ``torch.where`` instead of indexing the violating subset.
    """
    todo = ~ok
    lo = torch.where(ok, 1.0, 0.0)
    hi = torch.ones_like(lo)
    logp = torch.where(ok, logp, logp0)
    dist = torch.where(ok, dist, torch.zeros_like(dist))
    for _ in range(steps):
        mid = torch.where(todo, (lo + hi) / 2, lo)
        logp_mid, dist_mid = evaluate(delta, mid)
        good = logp_mid >= logp0 - sigma
        up, down = todo & good, todo & ~good
        lo = torch.where(up, mid, lo)
        logp = torch.where(up, logp_mid, logp)
        dist = torch.where(up, dist_mid, dist)
        hi = torch.where(down, mid, hi)
    return lo, logp, dist
