"""Small models and data shared by the tests (fast on 2 CPU cores)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from lpa3_lightning.data import IndexedDataset


def small_cnn(in_channels: int = 1, num_classes: int = 3, width: int = 8) -> nn.Module:
    """A plain CNN with BatchNorm and dropout, 28x28 inputs."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(2 * width, num_classes),
    )


def confident_cnn(seed: int = 0, steps: int = 150) -> nn.Module:
    """A small CNN trained to saturation on :func:`indexed_images` (p(y|x) close to 1), in eval mode."""
    torch.manual_seed(seed)
    net = small_cnn()
    data = indexed_images(96, seed=seed)
    x = torch.stack([data[i][0] for i in range(len(data))])
    y = torch.stack([data[i][1] for i in range(len(data))])
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    net.eval()
    return net


def confident_batch(n: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh samples of the distribution :func:`confident_cnn` was trained on."""
    data = indexed_images(n, seed=seed)
    return torch.stack([data[i][0] for i in range(n)]), torch.stack([data[i][1] for i in range(n)])


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, cloned."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def indexed_images(n: int = 48, num_classes: int = 3, seed: int = 0) -> IndexedDataset:
    """Synthetic 1x28x28 images whose class sets the mean brightness (learnable fast)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % num_classes
    x = torch.randn(n, 1, 28, 28, generator=g) * 0.5 + (y.float() - 1.0)[:, None, None, None]
    return IndexedDataset(TensorDataset(x, y))
