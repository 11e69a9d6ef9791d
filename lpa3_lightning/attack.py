"""The label-preserving Fast Lagrangian solver of LP-A3 (input gradients only).

Solves, for each sample (Yang et al., NeurIPS 2022, eq. 6; solver: Fast Lagrangian
perceptual attack, Laidlaw et al., ICLR 2021, Alg. 3, as adapted in the authors' code)::

    x' = argmax ||phi(x') - phi(x)||_2   s.t.   log F(x')[y] >= log F(x)[y] - sigma

where ``phi`` are the model's own normalised activations (:mod:`lpa3_lightning.features`).
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

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lpa3_lightning.dual_bn import TwinStatistics, frozen_twin_bn, has_dual_bn
from lpa3_lightning.features import PerceptualFeatures, eval_mode, output_to_logits, unwrap_compiled
from lpa3_lightning.solver_graphs import SolverGraphs

__all__ = [
    "AttackStats", "InputRange", "MaxStep", "auto_max_step", "auto_max_step_tensor", "check_max_step", "check_solver_arguments", "full_float32",
    "label_log_prob", "lpa3_attack", "parameter_dtype", "resolve_input_range",
]

#: Bounds as ``(low, high)`` (floats or per-channel sequences) or a normalisation
#: ``{"mean": [...], "std": [...]}`` of inputs that lived in ``[0, 1]`` before it.
InputRange = Union[tuple[Any, Any], Mapping[str, Any], None]

INIT_NOISE = 0.01  # half-width of the uniform initial perturbation (authors)
FD_STEP = 0.1  # finite-difference step h for the slope of log p (authors)
SLOPE_EPS = 1e-4  # added to the slope before dividing (authors)
GRAD_EPS = 1e-8  # added to the gradient norm before normalising (authors)


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


def resolve_input_range(input_range: InputRange, x: Tensor, check_values: bool = True) -> tuple[Tensor, Tensor] | None:
    """Turn ``input_range`` into ``(low, high)`` tensors broadcastable to ``x``.

    Per-channel sequences apply along dim 1. A mapping ``{"mean", "std"}`` describes a
    normalisation ``(v - mean) / std`` of values that were in ``[0, 1]`` (override with a
    ``"pixel_range": (lo, hi)`` key). ``check_values=False`` skips the checks that read the
    values on the host (positive std, low < high): for a range checked once before.

    Raises:
        ValueError: on a malformed range, naming the argument and the fix.
    """
    if input_range is None:
        return None
    shape = [1] * x.dim()

    def as_tensor(value: Any, what: str) -> Tensor:
        t = torch.as_tensor(value, dtype=x.dtype, device=x.device).flatten()
        if t.numel() == 1:
            return t.reshape([1] * x.dim())
        if x.dim() < 2 or t.numel() != x.shape[1]:
            raise ValueError(
                f"`input_range` {what} has {t.numel()} values but the input has "
                f"{x.shape[1] if x.dim() > 1 else 'no'} channels (dim 1). Fix: give one value, or one per channel."
            )
        channel_shape = list(shape)
        channel_shape[1] = t.numel()
        return t.reshape(channel_shape)

    if isinstance(input_range, Mapping):
        if not {"mean", "std"} <= set(input_range):
            raise ValueError(
                "`input_range` as a mapping needs 'mean' and 'std' (the normalisation applied to [0, 1] "
                f"inputs), got keys {sorted(input_range)}. Fix: pass {{'mean': [...], 'std': [...]}} or (low, high)."
            )
        mean, std = as_tensor(input_range["mean"], "mean"), as_tensor(input_range["std"], "std")
        if check_values and bool((std <= 0).any()):
            raise ValueError("`input_range` std must be positive. Fix: pass the std of the normalisation.")
        lo, hi = input_range.get("pixel_range", (0.0, 1.0))
        low, high = (lo - mean) / std, (hi - mean) / std
    elif isinstance(input_range, Sequence) and len(input_range) == 2:
        low, high = as_tensor(input_range[0], "low"), as_tensor(input_range[1], "high")
    else:
        raise ValueError(
            f"`input_range` must be None, (low, high) or {{'mean': ..., 'std': ...}}, got {input_range!r}."
        )
    if check_values and bool((low >= high).any()):
        raise ValueError(f"`input_range` needs low < high everywhere, got low={low.flatten().tolist()}, "
                         f"high={high.flatten().tolist()}.")
    return low, high


def check_solver_arguments(sigma: float, steps: int, lam: float, temperature: float) -> None:
    """Refuse solver settings out of range, naming the argument and the fix.

    Raises:
        ValueError: if ``sigma`` is not positive and finite, ``steps`` not an int >= 1,
            ``lam`` negative or not finite, or ``temperature`` not positive.
    """
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"`sigma` must be a positive finite float, got {sigma!r}. Fix: use 0.002 to 0.02 (paper).")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps` must be an int >= 1, got {steps!r}. Fix: use 5 (the paper's T).")
    if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
        raise ValueError(f"`lam` must be a finite float >= 0, got {lam!r}. Fix: use 1.0 (the authors').")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"`temperature` must be > 0, got {temperature!r}. Fix: use 1.0 (plain softmax).")


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
    if bn_mode not in ("eval", "twin"):
        raise ValueError(f"`bn_mode` must be 'eval' or 'twin', got {bn_mode!r}. Fix: use 'eval' (or 'twin' with "
                         "convert_dual_bn).")
    if bn_mode == "twin" and not has_dual_bn(model):
        raise ValueError("`bn_mode='twin'` needs a model with twin BatchNorms. Fix: call `convert_dual_bn(model)` "
                         "or use bn_mode='eval'.")
    if torch.is_inference_mode_enabled():
        raise RuntimeError("lpa3_attack needs autograd but runs under torch.inference_mode(). Fix: call it outside.")


@contextlib.contextmanager
def _attack_mode(model: nn.Module, bn_mode: str,
                 twin_statistics: TwinStatistics | None = None) -> Iterator[TwinStatistics | None]:
    """Put ``model`` in the attack's forward mode and restore every module's flag afterwards.

    Yields the frozen twin statistics in twin mode (filled when the block exits if they were
    captured by its first forward), else None.
    """
    # eval: BN uses running statistics (nothing moves) and dropout is off, so each
    # sample's output depends on that sample only and the constraint is exact per sample.
    with eval_mode(model):
        if bn_mode == "twin":
            # The twins normalise with the batch statistics of the clean batch (given, or
            # captured by the first forward), frozen for the rest of the call: the authors'
            # twin-BN attack, but with samples that do not influence each other through the
            # statistics, and the same normalisation the training forward of x' uses
            # (lpa3_lightning.augmented_forward).
            with frozen_twin_bn(model, twin_statistics) as statistics:
                yield statistics
        else:
            yield None


def label_log_prob(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    bn_mode: Literal["eval", "twin"] = "eval",
    twin_statistics: TwinStatistics | None = None,
    logits_fn: Callable[[Any], Tensor] | None = None,
    temperature: float = 1.0,
    allow_tf32: bool = False,
) -> tuple[Tensor, TwinStatistics | None]:
    """``log p(y|x)`` under the solver's forward (no gradient, nothing updated).

    The reference the constraint is measured against: eval mode, autocast off, the
    parameters' dtype; ``bn_mode="twin"`` normalises with ``twin_statistics`` or, when None,
    captures the batch statistics of ``x`` and returns them; ``"eval"`` uses the main BN on
    its running statistics (the deployed model).

    Returns:
        ``((N,) log-probabilities in float32, the twin statistics used or None)``.
    """
    model = unwrap_compiled(model)
    to_logits = logits_fn or output_to_logits
    x = x.detach().to(parameter_dtype(model, x.dtype))
    with _attack_mode(model, bn_mode, twin_statistics) as statistics, torch.no_grad(), \
            torch.autocast(x.device.type, enabled=False), full_float32(x.device, enabled=not allow_tf32):
        logp = _label_logp(to_logits(model(x)), y.long(), temperature)
    return logp, statistics


def parameter_dtype(model: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype of the model's first floating parameter (``default`` when it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), default)


def _label_logp(logits: Tensor, y: Tensor, temperature: float) -> Tensor:
    return F.log_softmax(logits.float() / temperature, dim=1).gather(1, y[:, None]).squeeze(1)


def _per_sample(v: Tensor, x: Tensor) -> Tensor:
    return v.reshape([-1] + [1] * (x.dim() - 1))


@contextlib.contextmanager
def full_float32(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """TF32 off for cuDNN convolutions and cuBLAS matrix products on CUDA, restored after.

    Uses the precision settings a user is most likely to have touched: torch >= 2.9's
    ``fp32_precision`` (which refuses to be mixed with the older ``allow_tf32`` flags, and
    which ``torch.set_float32_matmul_precision`` also sets), else the ``allow_tf32`` flags.
    """
    if device.type != "cuda" or not enabled:
        yield
        return
    conv = getattr(torch.backends.cudnn, "conv", None)
    matmul = torch.backends.cuda.matmul
    if conv is not None and hasattr(conv, "fp32_precision") and hasattr(matmul, "fp32_precision"):
        saved = (conv.fp32_precision, matmul.fp32_precision)
        conv.fp32_precision = matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            conv.fp32_precision, matmul.fp32_precision = saved
        return
    saved_flags = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved_flags


#: ``max_step="auto"``: each step at most this fraction of the input box's L2 diagonal.
AUTO_MAX_STEP_FRACTION = 0.02
#: Without a box, the box is estimated as +-2 batch standard deviations per input element.
AUTO_BOX_STDS = 4.0

MaxStep = Union[float, Literal["auto"], None]


def check_max_step(max_step: MaxStep) -> None:
    """Raise a ValueError naming ``max_step`` unless it is None, ``"auto"`` or a positive finite number."""
    if max_step is None or max_step == "auto":
        return
    if isinstance(max_step, bool) or not isinstance(max_step, (int, float)) or not math.isfinite(max_step) \
            or max_step <= 0:
        raise ValueError(f"`max_step` must be 'auto' (default), None (unbounded, the authors' step) or a positive "
                         f"finite number, got {max_step!r}. Fix: use 'auto', or e.g. max_step=1.0.")


def auto_max_step(x: Tensor, bounds: tuple[Tensor, Tensor] | None) -> float:
    """The default step bound: 2% of the L2 diagonal of the valid input box.

    With a box ``(low, high)`` the diagonal is ``sqrt(sum over input elements of (high - low)^2)``
    (56 for 1x28x28 inputs in [-1, 1], so the bound is 1.12). Without one it is estimated from
    the batch as ``4 * sqrt(sum of per-element batch variances)`` (a box of +-2 standard
    deviations), falling back to the samples' mean L2 norm for a single or constant batch.
    Five steps then move ``x`` by at most about a tenth of the box diagonal: far enough for the
    solver to find hard positives, not enough to turn a saturated sample into noise.

    Example:
        >>> x = torch.zeros(2, 1, 28, 28)
        >>> round(auto_max_step(x, (torch.tensor(-1.0), torch.tensor(1.0))), 2)
        1.12
    """
    sample = x[:1]
    if bounds is not None:
        width = (bounds[1] - bounds[0]).expand_as(sample)
        diagonal = float(width.float().pow(2).sum().sqrt())
    else:
        flat = x.detach().float().flatten(1)
        diagonal = AUTO_BOX_STDS * float(flat.var(dim=0, unbiased=False).sum().sqrt()) if flat.shape[0] > 1 else 0.0
        if diagonal <= 0.0:
            diagonal = float(flat.norm(dim=1).mean())
        if diagonal <= 0.0:
            diagonal = math.sqrt(flat.shape[1])
    return AUTO_MAX_STEP_FRACTION * diagonal


def auto_max_step_tensor(x: Tensor, bounds: tuple[Tensor, Tensor] | None) -> Tensor:
    """:func:`auto_max_step` as a 0-dim tensor on ``x``'s device, computed without a host read.

    Example:
        >>> x = torch.zeros(2, 1, 28, 28)
        >>> round(float(auto_max_step_tensor(x, (torch.tensor(-1.0), torch.tensor(1.0)))), 2)
        1.12
    """
    sample = x[:1]
    if bounds is not None:
        width = (bounds[1] - bounds[0]).expand_as(sample)
        return AUTO_MAX_STEP_FRACTION * width.float().pow(2).sum().sqrt()
    flat = x.detach().float().flatten(1)
    spread = AUTO_BOX_STDS * flat.var(dim=0, unbiased=False).sum().sqrt() if flat.shape[0] > 1 \
        else flat.new_zeros(())
    # the same fallbacks as auto_max_step, chosen on the device
    norm = flat.norm(dim=1).mean()
    diagonal = torch.where(spread > 0, spread, torch.where(norm > 0, norm, torch.full_like(norm, math.sqrt(flat.shape[1]))))
    return AUTO_MAX_STEP_FRACTION * diagonal


def lpa3_attack(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    sigma: float = 0.02,
    steps: int = 5,
    lam: float = 1.0,
    layers: str | Sequence[str] | None = None,
    input_range: InputRange = None,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    project: bool = True,
    bisection_steps: int = 8,
    bn_mode: Literal["eval", "twin"] = "eval",
    logits_fn: Callable[[Any], Tensor] | None = None,
    fast: bool = False,
    max_step: MaxStep = "auto",
    allow_tf32: bool = False,
    twin_statistics: TwinStatistics | None = None,
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
            no clamping (non-image inputs).
        temperature: softmax temperature of ``log p``.
        generator: random generator for the initial noise (reproducibility).
        project: True (default) guarantees the constraint for every returned sample by a
            bisection towards ``x``; False is the authors' loop unchanged.
        bisection_steps: halvings of the bisection (resolution ``2**-bisection_steps`` of the
            perturbation).
        bn_mode: ``"eval"`` (default): the whole model in eval mode, BN on its running
            statistics, nothing updated. ``"twin"``: as the authors, through the twin
            BatchNorms (see :func:`convert_dual_bn`) with batch statistics, here those of the
            clean batch, frozen for the call (the authors recompute them at every forward,
            which couples the samples and breaks a per-sample guarantee). Either way no
            running statistic moves and each sample's constraint is checked exactly.
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
        twin_statistics: with ``bn_mode="twin"``, the frozen twin statistics to normalise
            with (:func:`~lpa3_lightning.dual_bn.frozen_twin_bn`); None captures those of
            ``x``. The callback captures them once per batch from all the selected clean
            samples and trains ``x'`` with the same ones.
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
        graphs: with ``sync_free=True``, a :class:`~lpa3_lightning.solver_graphs.SolverGraphs`
            that runs the solve as a CUDA graph captured once per padded batch size (on a CPU
            it solves the padded rows eagerly). The same ``x'`` up to float rounding; in twin
            mode without ``twin_statistics`` they are taken from ``x`` by one extra forward
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
        x = torch.where(_per_sample(finite, x), x, torch.zeros_like(x))
    bounds = resolve_input_range(input_range, x, check_values=not sync_free)
    feats = PerceptualFeatures(model, layers=layers, logits_fn=logits_fn)
    if max_step == "auto":
        step_bound: float | Tensor | None = auto_max_step_tensor(x, bounds) if sync_free else auto_max_step(x, bounds)
    else:
        step_bound = max_step

    # drawn before the solve (not inside it) so that a captured solve reads it from a buffer;
    # the clean forward draws no random numbers, so the stream is the one the loop always used
    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    rows = _SolveRows(feats, sigma=sigma, steps=steps, lam=lam, temperature=temperature, fast=fast, project=project,
                      bisection_steps=bisection_steps, sync_free=sync_free)
    if graphs is not None:
        if bn_mode == "twin" and twin_statistics is None:  # from the real rows, before any padding
            _, twin_statistics = label_log_prob(model, x, y, bn_mode="twin", logits_fn=logits_fn,
                                                temperature=temperature, allow_tf32=allow_tf32)
        x_adv, logp0, logp_final, dist_final, projected = graphs.solve(
            rows, x, y, noise, bounds, step_bound,
            lambda statistics: _solver_context(model, bn_mode, statistics, x.device, allow_tf32),
            twin_statistics if bn_mode == "twin" else None, model,
            key=(rows.settings(), bn_mode, layers if layers is None or isinstance(layers, str) else tuple(layers),
                 # the function itself, not its id: a bound method compares equal across accesses, and
                 # the key keeps it alive, so a new function cannot take a freed one's id
                 logits_fn, allow_tf32))
    else:
        with _solver_context(model, bn_mode, twin_statistics, x.device, allow_tf32):
            x_adv, logp0, logp_final, dist_final, projected = rows(x, y, noise, bounds, step_bound)
    with torch.no_grad():
        if sync_free:
            x_adv = torch.where(_per_sample(finite, x), x_adv, x_given)
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


@contextlib.contextmanager
def _solver_context(model: nn.Module, bn_mode: str, twin_statistics: TwinStatistics | None, device: torch.device,
                    allow_tf32: bool) -> Iterator[None]:
    """The forward mode every solver pass runs in: attack BN mode, gradients on, autocast off, full float32."""
    with _attack_mode(model, bn_mode, twin_statistics), torch.enable_grad(), torch.autocast(device.type, enabled=False), \
            full_float32(device, enabled=not allow_tf32):
        yield


class _SolveRows:
    """The solver's loop on a batch whose every input is a tensor (noise, bounds and step bound included).

    Called inside :func:`_solver_context`. With ``sync_free=True`` it reads no device value on the
    host and dispatches the same operators whatever the data, so it can be captured as a CUDA
    graph (:class:`~lpa3_lightning.solver_graphs.SolverGraphs`) and replayed on new values.

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
            logp0 = _label_logp(logits0, y, temperature)
        delta = clamp(x + (2 * noise - 1) * INIT_NOISE) - x
        # fast mode: the best feasible iterate seen so far (farthest in feature space)
        best = _BestFeasible(delta, logp0) if fast and project else None
        for t in range(steps):
            step = sigma * 0.1 ** (t / steps)
            lam_t = self.lam * 0.1 ** (1 - t / steps)
            delta.requires_grad_(True)
            logits, phi = feats(x + delta)
            logp = _label_logp(logits, y, temperature)
            dist = (phi - phi0).norm(dim=1)
            loss = -batch_mean(dist) + lam_t * batch_mean(F.relu(logp0 - logp - sigma))
            (grad,) = torch.autograd.grad(loss, delta)
            with torch.no_grad():
                delta, logp, dist = delta.detach(), logp.detach(), dist.detach()
                g_hat = grad / (_per_sample(grad.flatten(1).norm(dim=1), x) + GRAD_EPS)
                if best is not None:
                    best.offer(delta, logp, dist, logp0 - sigma)
                if not (fast and t > 0):  # the authors' finite difference along the new direction
                    logits_fd = feats.model(x + delta - FD_STEP * g_hat)
                    logp_fd = _label_logp(feats.logits_fn(logits_fd), y, temperature)
                    slope = (logp - logp_fd).abs() / FD_STEP
                # fast: the first step's slope is reused (no extra forward after step 0)
                length = step / (slope + SLOPE_EPS)
                if step_bound is not None:
                    length = torch.clamp(length, max=step_bound)
                delta = clamp(x + delta - g_hat * _per_sample(length, x).to(x.dtype)) - x

        with torch.no_grad():
            evaluate = _Evaluator(feats, x, y, phi0, temperature)
            alpha = torch.ones(x.shape[0], device=x.device)
            logp_final, dist_final = evaluate(delta, alpha)
            ok = logp_final >= logp0 - sigma
            projected = torch.zeros_like(ok)
            if best is not None:
                best.offer(delta, logp_final, dist_final, logp0 - sigma)
                projected = ~ok  # as in the default mode: the final iterate broke the constraint
                delta, logp_final, dist_final = best.delta, best.logp, best.dist
            elif project and sync_free:
                projected = ~ok
                alpha, logp_final, dist_final = _bisect_all_rows(evaluate, delta, ok, logp_final, dist_final, logp0,
                                                                 sigma, self.bisection_steps)
            elif project and not bool(ok.all()):
                projected = ~ok
                alpha, logp_final, dist_final = _bisect(evaluate, delta, ok, logp_final, dist_final, logp0, sigma,
                                                        self.bisection_steps)
            x_adv = (x + _per_sample(alpha, x).to(x.dtype) * delta).detach()
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
        self.delta = torch.where(_per_sample(better, delta), delta, self.delta)
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
        logits, phi = self.feats(x + _per_sample(alpha, x).to(x.dtype) * delta)
        return _label_logp(logits, y, self.temperature), (phi - phi0).norm(dim=1)


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
