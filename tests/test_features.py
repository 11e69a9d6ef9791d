"""Tests for lpa3_lightning.features: layer choice, LPIPS-style normalisation, hook capture."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torchvision
from torch import nn

from lpa3_lightning.features import (
    FEATURE_EPS,
    PerceptualFeatures,
    default_feature_layers,
    normalize_activation,
    output_to_logits,
    resolve_layers,
)

# --------------------------------------------------------------------------- helpers


def _reference_normalize(activation: torch.Tensor, eps: float = FEATURE_EPS) -> torch.Tensor:
    """LPIPS normalisation by hand: per sample and spatial position, divide the channel vector
    by (its L2 norm + eps) and by sqrt(#positions); flatten in (C, *spatial) order."""
    n, c = activation.shape[:2]
    spatial = activation.shape[2:]
    positions = 1
    for s in spatial:
        positions *= s
    flat = activation.reshape(n, c, positions)
    out = torch.empty_like(flat)
    for i in range(n):
        for p in range(positions):
            vec = flat[i, :, p]
            norm = math.sqrt(sum(float(v) ** 2 for v in vec))
            out[i, :, p] = vec / ((norm + eps) * math.sqrt(positions))
    return out.reshape(n, -1)


class _WRNLike(nn.Module):
    """Wide-ResNet-like layout: stem conv, block1..block3 stages, bn, head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.block1 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.ReLU())
        self.block3 = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU())
        self.bn1 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block3(self.block2(self.block1(self.conv1(x))))
        return self.fc(self.bn1(x).mean(dim=(2, 3)))


def _plain_cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU()),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    )


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3))


class _TupleBlock(nn.Module):
    """A block returning (activation, aux) like some research code does."""

    def __init__(self, first_is_tensor: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.first_is_tensor = first_is_tensor

    def forward(self, x: torch.Tensor):
        out = self.conv(x)
        if self.first_is_tensor:
            return out, out * 7.0 + 1.0
        return "aux-info", out, out * 7.0 + 1.0


class _TupleNet(nn.Module):
    def __init__(self, first_is_tensor: bool = True) -> None:
        super().__init__()
        self.block = _TupleBlock(first_is_tensor)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.block(x)
        out = next(r for r in result if isinstance(r, torch.Tensor))
        return self.head(out.mean(dim=(2, 3)))


class _DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": self.head(self.conv(x).mean(dim=(2, 3))), "aux": x.sum()}


class _RaisingNet(nn.Module):
    """Runs the hooked conv, then fails."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.conv(x)
        raise RuntimeError("boom in forward")


class _UnusedLayerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.unused = nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean(dim=(2, 3)))


# --------------------------------------------------------------------------- default layers


def test_default_layers_torchvision_resnet18_are_residual_stages() -> None:
    net = torchvision.models.resnet18(num_classes=3)
    assert default_feature_layers(net) == ["layer1", "layer2", "layer3", "layer4"]


def test_default_layers_wrn_like_are_blocks() -> None:
    assert default_feature_layers(_WRNLike()) == ["block1", "block2", "block3"]


def test_default_layers_plain_cnn_are_all_convolutions_including_nested() -> None:
    net = _plain_cnn()
    expected = [name for name, m in net.named_modules() if isinstance(m, nn.Conv2d)]
    assert expected == ["0", "2.0"]  # guards the fixture itself
    assert default_feature_layers(net) == expected


def test_default_layers_conv1d_network() -> None:
    net = nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Conv1d(3, 3, 3), nn.Flatten(), nn.LazyLinear(2))
    assert default_feature_layers(net) == ["0", "2"]


def test_default_layers_mlp_are_linears_except_last() -> None:
    assert default_feature_layers(_mlp()) == ["0", "2"]


def test_default_layers_child_named_layers_is_not_a_stage() -> None:
    # `layers` (no digit) must not be taken as a residual stage; fall back to convolutions.
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))

    assert default_feature_layers(Net()) == ["layers.0", "layers.2"]


def test_default_layers_single_linear_is_empty_and_features_refuse() -> None:
    net = nn.Sequential(nn.Linear(4, 2))
    assert default_feature_layers(net) == []
    with pytest.raises(ValueError, match=r"No default feature layer.*Available names: \['0'\]"):
        resolve_layers(net, None)
    with pytest.raises(ValueError, match="No default feature layer"):
        PerceptualFeatures(net)


# --------------------------------------------------------------------------- resolve_layers


def test_resolve_layers_glob_selects_only_matching_stages() -> None:
    net = torchvision.models.resnet18(num_classes=3)
    assert resolve_layers(net, "layer[12]") == ["layer1", "layer2"]
    assert resolve_layers(net, ["layer[34]"]) == ["layer3", "layer4"]


def test_resolve_layers_exact_names_keep_order_and_drop_duplicates() -> None:
    net = torchvision.models.resnet18(num_classes=3)
    assert resolve_layers(net, ["layer3", "layer1.0.conv1", "layer3"]) == ["layer3", "layer1.0.conv1"]
    assert resolve_layers(net, "layer2.1.bn2") == ["layer2.1.bn2"]


def test_resolve_layers_none_is_default() -> None:
    assert resolve_layers(_WRNLike(), None) == ["block1", "block2", "block3"]


def test_resolve_layers_no_match_lists_available_names() -> None:
    net = torchvision.models.resnet18(num_classes=3)
    with pytest.raises(ValueError, match=r"'stage9'.*" + re.escape("'layer1.0.conv1'")):
        resolve_layers(net, ["layer1", "stage9"])
    with pytest.raises(ValueError, match=re.escape("'block2'")):
        PerceptualFeatures(_WRNLike(), layers="nothing*")


def test_resolve_layers_empty_list_raises() -> None:
    with pytest.raises(ValueError, match="`layers` is empty"):
        resolve_layers(_plain_cnn(), [])


# --------------------------------------------------------------------------- normalisation


def test_normalize_activation_4d_matches_hand_reference() -> None:
    torch.manual_seed(0)
    act = torch.randn(3, 5, 4, 6, dtype=torch.float64)
    out = normalize_activation(act)
    assert out.shape == (3, 5 * 4 * 6)
    torch.testing.assert_close(out, _reference_normalize(act), rtol=1e-12, atol=1e-12)


def test_normalize_activation_4d_matches_einsum_reference() -> None:
    torch.manual_seed(1)
    act = torch.randn(2, 7, 3, 5)
    norm = torch.einsum("nchw,nchw->nhw", act, act).sqrt()[:, None] + FEATURE_EPS
    expected = (act / norm / math.sqrt(3 * 5)).reshape(2, -1)
    torch.testing.assert_close(normalize_activation(act), expected)
    # Each spatial position carries a unit vector scaled by 1/sqrt(HW): the squared total is 1.
    torch.testing.assert_close(normalize_activation(act).pow(2).sum(1), torch.ones(2))


def test_normalize_activation_2d_matches_hand_reference() -> None:
    torch.manual_seed(2)
    act = torch.randn(4, 9, dtype=torch.float64)
    out = normalize_activation(act)
    assert out.shape == (4, 9)
    torch.testing.assert_close(out, _reference_normalize(act), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(4, dtype=torch.float64))


def test_normalize_activation_3d_and_custom_eps() -> None:
    torch.manual_seed(3)
    act = torch.randn(2, 3, 5, dtype=torch.float64)
    torch.testing.assert_close(normalize_activation(act, eps=0.5), _reference_normalize(act, eps=0.5))


def test_normalize_activation_zero_activation_is_finite_zero() -> None:
    out = normalize_activation(torch.zeros(2, 3, 2, 2))
    assert torch.isfinite(out).all()
    assert torch.count_nonzero(out) == 0


def test_normalize_activation_rejects_1d() -> None:
    with pytest.raises(ValueError, match="batch and a channel"):
        normalize_activation(torch.randn(5))


def test_output_to_logits() -> None:
    t = torch.randn(2, 3)
    assert output_to_logits(t) is t
    with pytest.raises(TypeError, match="logits_fn"):
        output_to_logits((t,))


# --------------------------------------------------------------------------- PerceptualFeatures


def test_features_equal_manual_concatenation_for_sequential_cnn() -> None:
    torch.manual_seed(0)
    net = _plain_cnn()
    x = torch.randn(3, 3, 8, 8)
    logits, phi = PerceptualFeatures(net)(x)
    a0 = net[0](x)
    a1 = net[2][0](net[1](a0))
    expected = torch.cat([_reference_normalize(a0.detach()), _reference_normalize(a1.detach())], dim=1)
    torch.testing.assert_close(logits, net(x))
    assert phi.shape == (3, 4 * 8 * 8 + 6 * 4 * 4)
    torch.testing.assert_close(phi.detach(), expected, rtol=1e-5, atol=1e-6)


def test_features_shape_torchvision_resnet18_28px() -> None:
    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=3).eval()
    feats = PerceptualFeatures(net)
    assert feats.layer_names == ["layer1", "layer2", "layer3", "layer4"]
    with torch.no_grad():
        logits, phi = feats(torch.randn(2, 3, 28, 28))
    # 28 -> conv1 s2 -> 14 -> maxpool -> 7 (layer1) -> 4 -> 2 -> 1
    assert logits.shape == (2, 3)
    assert phi.shape == (2, 64 * 7 * 7 + 128 * 4 * 4 + 256 * 2 * 2 + 512 * 1 * 1)
    # every layer contributes a block of squared norm 1 (unit vector per position / sqrt(HW))
    torch.testing.assert_close(phi.pow(2).sum(1), torch.full((2,), 4.0), rtol=1e-4, atol=1e-4)


def test_features_glob_layers_on_resnet_and_mlp_default() -> None:
    net = torchvision.models.resnet18(num_classes=3).eval()
    feats = PerceptualFeatures(net, layers="layer[12]")
    with torch.no_grad():
        _, phi = feats(torch.randn(2, 3, 28, 28))
    assert phi.shape == (2, 64 * 7 * 7 + 128 * 4 * 4)

    mlp = _mlp()
    x = torch.randn(4, 5)
    logits, phi = PerceptualFeatures(mlp)(x)
    h0 = mlp[0](x)
    h2 = mlp[2](mlp[1](h0))
    expected = torch.cat([_reference_normalize(h0.detach()), _reference_normalize(h2.detach())], 1)
    assert logits.shape == (4, 3)
    torch.testing.assert_close(phi.detach(), expected, rtol=1e-5, atol=1e-6)


def test_features_are_differentiable_wrt_input() -> None:
    net = _plain_cnn()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    _, phi = PerceptualFeatures(net)(x)
    (phi * torch.randn_like(phi)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_hooks_removed_after_call() -> None:
    net = torchvision.models.resnet18(num_classes=3).eval()
    feats = PerceptualFeatures(net, layers=["layer1", "layer4", "fc"])
    with torch.no_grad():
        feats(torch.randn(2, 3, 28, 28))
    for name, module in net.named_modules():
        assert len(module._forward_hooks) == 0, name


def test_hooks_removed_when_forward_raises() -> None:
    net = _RaisingNet()
    feats = PerceptualFeatures(net, layers="conv")
    with pytest.raises(RuntimeError, match="boom in forward"):
        feats(torch.randn(2, 3, 5, 5))
    assert len(net.conv._forward_hooks) == 0
    # and the object stays usable for the next call (no stale hooks accumulate)
    with pytest.raises(RuntimeError, match="boom in forward"):
        feats(torch.randn(2, 3, 5, 5))
    assert len(net.conv._forward_hooks) == 0


def test_tuple_output_uses_first_tensor() -> None:
    torch.manual_seed(0)
    net = _TupleNet()
    x = torch.randn(2, 3, 5, 5)
    _, phi = PerceptualFeatures(net, layers="block")(x)
    torch.testing.assert_close(phi.detach(), _reference_normalize(net.block.conv(x).detach()), rtol=1e-5, atol=1e-6)


def test_tuple_output_skips_leading_non_tensor() -> None:
    torch.manual_seed(0)
    net = _TupleNet(first_is_tensor=False)
    x = torch.randn(2, 3, 5, 5)
    _, phi = PerceptualFeatures(net, layers="block")(x)
    torch.testing.assert_close(phi.detach(), _reference_normalize(net.block.conv(x).detach()), rtol=1e-5, atol=1e-6)


def test_dict_output_requires_logits_fn() -> None:
    net = _DictNet()
    feats = PerceptualFeatures(net, layers="conv")
    with pytest.raises(TypeError, match="logits_fn"):
        feats(torch.randn(2, 3, 5, 5))
    assert len(net.conv._forward_hooks) == 0

    x = torch.randn(2, 3, 5, 5)
    logits, phi = PerceptualFeatures(net, layers="conv", logits_fn=lambda o: o["logits"])(x)
    torch.testing.assert_close(logits, net(x)["logits"])
    torch.testing.assert_close(phi.detach(), _reference_normalize(net.conv(x).detach()), rtol=1e-5, atol=1e-6)


def test_unused_layer_raises_runtime_error_and_removes_hooks() -> None:
    net = _UnusedLayerNet()
    feats = PerceptualFeatures(net, layers=["conv", "unused"])
    with pytest.raises(RuntimeError, match=r"\['unused'\] did not run"):
        feats(torch.randn(2, 3, 5, 5))
    assert len(net.conv._forward_hooks) == 0
    assert len(net.unused._forward_hooks) == 0


def test_default_layers_are_found_through_a_wrapper():
    """A LightningModule-like wrapper holding the network finds its stages, not every conv."""
    import torchvision

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torchvision.models.resnet18(num_classes=2)

    assert default_feature_layers(Wrapper()) == ["model.layer1", "model.layer2", "model.layer3", "model.layer4"]
