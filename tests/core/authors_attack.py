"""The LP-A3 authors' attack loop, transcribed step by step as an independent reference.

Written here from a reading of ``get_attack`` in CausalLearning/LPA3 at commit 7059ca3
(FixMatch/fixmatch_LPA3.py, lines 85-139) and its feature normalisation
(FixMatch/utils/misc.py, lines 15-30); the line of each step is given beside it. It keeps the
authors' arithmetic where it differs in form from the package's (``log(softmax)`` instead of
``log_softmax``, the clamp of the perturbation instead of the clamp of ``x + delta``), so a test
comparing the two checks the package against their loop, not against itself. A model without
BatchNorm or dropout makes their train-mode forwards and the package's eval-mode ones the same.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _flat_features(features: list[Tensor]) -> Tensor:
    """misc.py L15-30: each layer over its per-position channel norm (+1e-10) and sqrt(H*W), concatenated."""
    parts = []
    for f in features:
        norm = f.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10
        parts.append((f / (norm * math.sqrt(f.shape[2] * f.shape[3]))).reshape(f.shape[0], -1))
    return torch.cat(parts, dim=1)


def authors_attack(stages: list[nn.Module], head: nn.Module, x: Tensor, y: Tensor, initial: Tensor, *, bound: float,
                   lam: float, iterations: int, lower: float, upper: float, temperature: float = 1.0) -> Tensor:
    """x' of the authors' loop; ``initial`` is their U(-0.01, 0.01) draw (L96-97), given so both sides share it.

    ``stages`` are the feature layers in order and ``head`` maps the last one to logits.
    """

    def forward(inputs: Tensor) -> tuple[Tensor, list[Tensor]]:
        features, h = [], inputs
        for stage in stages:
            h = stage(h)
            features.append(h)
        return head(h), features

    def label_log_prob(logits: Tensor) -> Tensor:  # L113-114 and L441-442: log of the gathered softmax
        return torch.log(torch.gather(F.softmax(logits / temperature, dim=1), 1, y[:, None]).squeeze(1))

    with torch.no_grad():  # L437-442: the clean forward, outside the attack
        logits, features = forward(x)
        y_ori, flat_ori = label_log_prob(logits), _flat_features(features)
    perturbation = torch.clamp(initial, lower - x, upper - x)  # L98: x + delta stays in the box
    for i in range(iterations):  # L100
        step_size = bound * 0.1 ** (i / iterations)  # L102-103
        lam_i = lam * 0.1 ** (1 - i / iterations)  # L104-105
        perturbation = perturbation.detach().requires_grad_(True)
        logits_adv, features_adv = forward(x + perturbation)  # L110-112
        y_adv = label_log_prob(logits_adv)
        pip = (_flat_features(features_adv) - flat_ori).norm(dim=1).mean()  # L116-117
        loss = -pip + lam_i * F.relu(y_ori - y_adv - bound).mean()  # L118-119
        (grad,) = torch.autograd.grad(loss, perturbation)  # L120-122 (theirs: backward, then .grad)
        with torch.no_grad():
            grad_normed = grad / (grad.reshape(grad.shape[0], -1).norm(dim=1)[:, None, None, None] + 1e-8)  # L123-125
            y_after = label_log_prob(forward(x + perturbation - grad_normed * 0.1)[0])  # L126-130
            slope = torch.abs(y_adv - y_after) / 0.1  # L131
            norm = step_size / (slope + 1e-4)  # L132
            update = -grad_normed * norm[:, None, None, None]  # L133
            perturbation = torch.clamp(perturbation + update, lower - x, upper - x)  # L135-136
    return (x + perturbation).detach()  # L138-139
