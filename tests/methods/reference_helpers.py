"""What the transcription tests of PES, DivideMix and FixMatch share (``tests/methods/test_pes_reference.py``,
``tests/methods/test_dividemix_reference.py``, ``tests/methods/test_fixmatch_reference.py``): a small
network with BatchNorm, the same layout with twin BatchNorms of the transcription's own
(:class:`AuthorsTwinNet`), a two-view batch, a recorder of the random draws a step of the package makes
(so that the transcription of the reference uses the same mixup ``l`` and the same permutations), and
the comparisons of losses, gradients and BatchNorm buffers.

Nothing here computes a loss: the transcriptions are in the test files, next to the line numbers of
their references.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lpa3_lightning.methods import mixmatch

NUM_CLASSES = 4
SIDE = 12  # 12x12 grey images: two convolutions, a pooling and a strided convolution leave 3x3

#: float tolerance of every comparison: the two sides run the same operators on the same shapes, in
#: an order that differs only in sums (a class-weighted sum against a sum of means); measured
#: differences are below 1e-6 (most are exactly 0)
RTOL, ATOL = 1e-5, 1e-6


def small_net(seed: int, scale: float = 4.0) -> nn.Sequential:
    """Two convolutions with BatchNorm and a linear head, scaled so that untrained predictions differ by row."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(6, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Flatten(), nn.Linear(8 * 3 * 3, NUM_CLASSES))
    with torch.no_grad():
        net[-1].weight.mul_(scale)
    settle_statistics(net, seed)
    return net


def settle_statistics(net: nn.Module, seed: int) -> None:
    """A few train-mode forwards, so that the running statistics are away from (0, 1) and an eval-mode
    forward differs from a train-mode one."""
    g = torch.Generator().manual_seed(100 + seed)
    was_training = net.training
    net.train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(16, 1, SIDE, SIDE, generator=g) * 1.5 + 0.4)
    net.train(was_training)


def two_view_batch(n: int, seed: int = 0, num_samples: int | None = None) -> list[Tensor]:
    """``[x_view1, x_view2, noisy_label, index]`` of ``n`` rows (indices ``0..n-1`` of a set of
    ``num_samples``): each view the same image with its own noise, as two augmentations."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 1, SIDE, SIDE, generator=g)
    x1 = base + 0.3 * torch.randn(base.shape, generator=g)
    x2 = base + 0.3 * torch.randn(base.shape, generator=g) + 0.2
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return [x1, x2, y, torch.arange(n)]


class Draws:
    """Records the mixup ``l`` (with its ``alpha``) and every ``torch.randperm`` of a package step, in order.

    ``module_path`` is the module whose ``mixup_lambda`` name the step calls
    (``"lpa3_lightning.methods.pes"``); the permutations are recorded from ``torch.randperm`` itself
    (the step and :func:`~lpa3_lightning.methods.mixmatch.augmented_mixmatch_loss` call it there).
    """

    def __init__(self, monkeypatch, module_path: str) -> None:
        self.lams: list[tuple[float, float]] = []
        self.perms: list[Tensor] = []
        draw_lambda, draw_perm = mixmatch.mixup_lambda, torch.randperm

        def recorded_lambda(alpha: float) -> float:
            value = draw_lambda(alpha)
            self.lams.append((float(alpha), value))
            return value

        def recorded_perm(*args, **kwargs) -> Tensor:
            perm = draw_perm(*args, **kwargs)
            self.perms.append(perm.clone())
            return perm

        monkeypatch.setattr(f"{module_path}.mixup_lambda", recorded_lambda)
        monkeypatch.setattr(torch, "randperm", recorded_perm)


def bn_buffers(module: nn.Module) -> dict[str, Tensor]:
    """Every BatchNorm buffer (running mean and variance, batch count) by name, cloned."""
    return {name: buffer.detach().clone() for name, buffer in module.named_buffers()
            if name.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")}


def batchnorms(module: nn.Module) -> list[_BatchNorm]:
    return [m for m in module.modules() if isinstance(m, _BatchNorm)]


def assert_close(actual: Tensor, expected: Tensor, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_same_gradients(package: nn.Module, reference: nn.Module,
                          rename: Callable[[str], str] = lambda name: name, rtol: float = RTOL,
                          atol: float = ATOL) -> None:
    """Each parameter of ``package`` has a gradient equal to its counterpart's in ``reference``
    (``rename`` maps a package name to the reference's; ``rtol``, ``atol`` for a reference whose
    reductions run in another order), and at least one is not zero."""
    reference_params = dict(reference.named_parameters())
    nonzero = 0
    for name, param in package.named_parameters():
        other = reference_params[rename(name)]
        got = torch.zeros_like(param) if param.grad is None else param.grad
        want = torch.zeros_like(other) if other.grad is None else other.grad
        assert_close(got, want, f"gradient of {name}", rtol, atol)
        nonzero += int(bool(got.abs().sum() > 0))
    assert nonzero > 0


def assert_same_buffers(package: nn.Module, reference: nn.Module,
                        rename: Callable[[str], str] = lambda name: name, rtol: float = RTOL,
                        atol: float = ATOL) -> None:
    reference_buffers = bn_buffers(reference)
    for name, value in bn_buffers(package).items():
        assert_close(value.float(), reference_buffers[rename(name)].float(), f"BatchNorm buffer {name}", rtol, atol)


def clone(net: nn.Module) -> nn.Module:
    return copy.deepcopy(net)


class AuthorsTwinNet(nn.Module):
    """The test networks' layout (Conv-BN-ReLU-MaxPool, strided Conv-BN-ReLU, Linear: :func:`small_net`'s and
    ``test_fixmatch_reference._net``'s) in the form of the LP-A3 authors' networks built with
    ``bn_adv_flag=True``: every BatchNorm has an ``_adv`` copy that ``forward(x, adv=True)`` uses instead
    (CausalLearning/LPA3 at 7059ca3: ``FixMatch/models/wideresnet.py`` L50-58 and L68-74, L130-132 and
    L154-155; ``PES/networks/ResNet.py`` L47-80), with momentum 0.01 (``bn_adv_momentum=0.01``:
    ``FixMatch/fixmatch_LPA3.py`` L218-219, ``PES/PES_LPA3.py`` L162).

    Its BatchNorms are plain ``nn.BatchNorm2d`` of its own, routed by its own ``forward``: nothing of the
    package's twin routing (``convert_dual_bn``, ``use_twin_bn``) runs in it, so a package that sends the
    ``x'`` through its main BatchNorms (or the clean views through the twins) gives other gradients and
    buffers than this network. Built from a package network converted by ``convert_dual_bn``: the same
    weights, and the values of each layer's main BatchNorm and of its twin (affine parameters, running
    statistics, batch count); the momenta are set here (``main_momentum``: the test networks' own
    ``nn.BatchNorm2d`` default, 0.1), not read from the package's layers."""

    def __init__(self, net: nn.Sequential, main_momentum: float = 0.1, adv_momentum: float = 0.01) -> None:
        super().__init__()
        self.conv1, self.conv2, self.fc = clone(net[0]), clone(net[4]), clone(net[8])
        self.bn1, self.bn2 = self._plain(net[1], main_momentum), self._plain(net[5], main_momentum)
        self.bn1_adv, self.bn2_adv = self._plain(net[1].twin, adv_momentum), self._plain(net[5].twin, adv_momentum)

    @staticmethod
    def _plain(bn: nn.BatchNorm2d, momentum: float) -> nn.BatchNorm2d:
        plain = nn.BatchNorm2d(bn.num_features, eps=bn.eps, momentum=momentum)
        plain.load_state_dict({k: v.detach().clone() for k, v in bn.state_dict().items() if not k.startswith("twin.")})
        return plain

    def forward(self, x: Tensor, adv: bool = False) -> Tensor:
        bn1, bn2 = (self.bn1_adv, self.bn2_adv) if adv else (self.bn1, self.bn2)
        h = F.max_pool2d(F.relu(bn1(self.conv1(x))), 2)
        h = F.relu(bn2(self.conv2(h)))
        return self.fc(h.flatten(1))

    def forward_reference_rows(self, reference: Tensor, x: Tensor) -> Tensor:
        """The package's documented training forward of ``x'`` (docs/method.md section 7, "forward that
        trains on x'"; not the authors'): ``cat([reference, x])`` through the ``adv`` BatchNorms, every row
        normalised with the reference rows' batch mean and (biased) variance, no running statistic moved;
        the ``x`` rows' logits."""

        def norm(bn: nn.BatchNorm2d, h: Tensor) -> Tensor:
            ref = h[: reference.shape[0]]
            mean = ref.mean((0, 2, 3), keepdim=True)
            var = ref.var((0, 2, 3), unbiased=False, keepdim=True)
            return (h - mean) / torch.sqrt(var + bn.eps) * bn.weight.view(1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)

        h = torch.cat([reference, x])
        h = F.max_pool2d(F.relu(norm(self.bn1_adv, self.conv1(h))), 2)
        h = F.relu(norm(self.bn2_adv, self.conv2(h)))
        return self.fc(h.flatten(1))[reference.shape[0]:]


def authors_name(name: str) -> str:
    """A parameter or buffer name of the package's twin network (``convert_dual_bn`` of the test layout)
    -> the :class:`AuthorsTwinNet`'s."""
    head, _, rest = name.partition(".")
    if rest.startswith("twin."):
        return {"1": "bn1_adv", "5": "bn2_adv"}[head] + "." + rest[len("twin."):]
    return {"0": "conv1", "1": "bn1", "4": "conv2", "5": "bn2", "8": "fc"}[head] + "." + rest
