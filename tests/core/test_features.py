"""Tests for lpa3_lightning.core.features: layer choice, LPIPS-style normalisation, hook capture."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torchvision
from torch import nn

from lpa3_lightning.core.feature_layers import default_feature_layers, resolve_layers
from lpa3_lightning.core.features import FEATURE_EPS, PerceptualFeatures, normalize_activation
from lpa3_lightning.core.checks import output_to_logits

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


# --------------------------------------------------------------------------- models no one here wrote


class _TransformerClassifier(nn.Module):
    """Token embedding, nn.TransformerEncoder, mean pooling, linear head (inputs (N, L, F))."""

    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(4, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.encoder(h)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(dim=1))


class _RecurrentClassifier(nn.Module):
    """nn.LSTM / nn.GRU over (N, L, F) sequences, linear head on the last time step."""

    def __init__(self, kind: type[nn.RNNBase] = nn.LSTM, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn = kind(4, 8, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out[:, -1])


def _convs(net: nn.Module) -> list[str]:
    return [name for name, m in net.named_modules() if isinstance(m, nn.Conv2d)]


def _foreign(kind: str) -> tuple[nn.Module, torch.Tensor, list[str]]:
    """(model in eval mode, a batch of 4 inputs, the expected default layers)."""
    torch.manual_seed(0)
    image = torch.randn(4, 3, 32, 32)
    sequence = torch.randn(4, 6, 4)
    if kind == "mobilenet_v3_small":
        net = torchvision.models.mobilenet_v3_small(num_classes=3)
        return net.eval(), image, _convs(net)
    if kind == "efficientnet_b0":
        net = torchvision.models.efficientnet_b0(num_classes=3)
        return net.eval(), image, _convs(net)
    if kind == "vit":
        net = torchvision.models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=3
        )
        return net.eval(), image, ["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"]
    if kind == "transformer_encoder":
        return _TransformerClassifier().eval(), sequence, ["encoder.layers.0", "encoder.layers.1"]
    if kind == "lstm":
        return _RecurrentClassifier(nn.LSTM).eval(), sequence, ["rnn"]
    if kind == "gru":
        return _RecurrentClassifier(nn.GRU, batch_first=False).eval(), sequence, ["rnn"]
    raise AssertionError(kind)


FOREIGN = ["mobilenet_v3_small", "efficientnet_b0", "vit", "transformer_encoder", "lstm", "gru"]


def _fired(net: nn.Module, names: list[str], x: torch.Tensor, grad: bool) -> set[str]:
    modules = dict(net.named_modules())
    fired: set[str] = set()
    handles = [modules[n].register_forward_hook(lambda *_, n=n: fired.add(n)) for n in names]
    try:
        if grad:
            net(x.clone().requires_grad_(True))
        else:
            with torch.no_grad():
                net(x)
    finally:
        for handle in handles:
            handle.remove()
    return fired


@pytest.mark.parametrize("kind", FOREIGN)
def test_default_layers_of_foreign_models_fire_under_no_grad_and_with_grad(kind: str) -> None:
    net, x, expected = _foreign(kind)
    assert default_feature_layers(net, example_input=x) == expected
    assert default_feature_layers(net) == expected  # the structural rules agree (no probe)
    assert resolve_layers(net, None, example_input=x) == expected
    assert _fired(net, expected, x, grad=False) == set(expected)
    assert _fired(net, expected, x, grad=True) == set(expected)


@pytest.mark.parametrize("kind", FOREIGN)
def test_default_features_of_foreign_models_give_a_finite_distance(kind: str) -> None:
    net, x, expected = _foreign(kind)
    feats = PerceptualFeatures(net)
    with torch.no_grad():
        logits, phi = feats(x)
        _, phi_same = feats(x)
        _, phi_moved = feats(x + 0.1 * torch.randn_like(x))
    assert feats.layer_names == expected
    assert logits.shape == (4, 3)
    assert torch.isfinite(phi).all()
    assert torch.equal((phi_same - phi).norm(dim=1), torch.zeros(4))
    moved = (phi_moved - phi).norm(dim=1)
    assert torch.isfinite(moved).all() and bool((moved > 0).all())
    # with grad (the solver's later forwards) the features are those of the no-grad forward
    _, phi_grad = feats(x.clone().requires_grad_(True))
    torch.testing.assert_close(phi_grad.detach(), phi, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", FOREIGN)
def test_lpa3_attack_runs_on_foreign_models_with_default_layers(kind: str) -> None:
    from lpa3_lightning.core.solver import lpa3_attack

    net, x, _ = _foreign(kind)
    y = torch.tensor([0, 1, 2, 0])
    x_adv, stats = lpa3_attack(net, x, y, return_stats=True, generator=torch.Generator().manual_seed(0))
    assert x_adv.shape == x.shape and bool(torch.isfinite(x_adv).all())
    assert float((x_adv - x).abs().max()) > 0 and bool((stats.perceptual_distance > 0).any())
    # the constraint, re-measured with a forward of our own (the model is in eval mode)
    with torch.no_grad():
        drop = (net(x).log_softmax(1) - net(x_adv).log_softmax(1)).gather(1, y[:, None]).flatten()
    assert bool((drop <= 0.02 + 1e-5).all()), drop
    assert not net.training  # flags restored (the model came in eval mode)


def test_transformer_encoder_default_is_the_encoder_layers_not_the_unused_out_proj() -> None:
    """nn.MultiheadAttention uses out_proj's weights directly: a hook there never fires."""
    net, x, _ = _foreign("transformer_encoder")
    out_proj = "encoder.layers.0.self_attn.out_proj"
    assert _fired(net, [out_proj], x, grad=False) == set()
    assert _fired(net, [out_proj], x, grad=True) == set()
    assert out_proj not in default_feature_layers(net, example_input=x)
    with pytest.raises(RuntimeError, match="did not run"):
        PerceptualFeatures(net, layers=out_proj)(x)


def test_sequence_first_layers_are_transposed_and_normalised_per_token() -> None:
    """A batch_first=False GRU gives the features of the same GRU with batch_first=True, and
    those are each time step's output divided by its L2 norm and by sqrt(L)."""
    torch.manual_seed(0)
    seq_first = _RecurrentClassifier(nn.GRU, batch_first=False).eval()
    batch_first = _RecurrentClassifier(nn.GRU, batch_first=True).eval()
    batch_first.load_state_dict(seq_first.state_dict())
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    seq_first.double()
    batch_first.double()
    with torch.no_grad():
        _, phi_sf = PerceptualFeatures(seq_first)(x)
        _, phi_bf = PerceptualFeatures(batch_first)(x)
        out, _ = batch_first.rnn(x)  # (N, L, H)
    expected = out / (out.norm(dim=2, keepdim=True) + FEATURE_EPS) / math.sqrt(5)
    torch.testing.assert_close(phi_bf, expected.reshape(3, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(phi_sf, phi_bf, rtol=1e-12, atol=1e-12)
    # each of the L tokens is a unit vector / sqrt(L): squared total 1 per layer
    torch.testing.assert_close(phi_bf.pow(2).sum(1), torch.ones(3, dtype=torch.float64))


def test_normalize_activation_channels_last_matches_channel_first_reference() -> None:
    torch.manual_seed(4)
    act = torch.randn(2, 5, 7, dtype=torch.float64)  # (N, L, D)
    out = normalize_activation(act, channels_last=True)
    reference = _reference_normalize(act.transpose(1, 2)).reshape(2, 7, 5).transpose(1, 2).reshape(2, -1)
    assert out.shape == (2, 5 * 7)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    # 2-D activations are the same in both layouts
    vec = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(normalize_activation(vec, channels_last=True), normalize_activation(vec))


def test_vit_token_features_are_normalised_over_the_hidden_dim() -> None:
    net, x, _ = _foreign("vit")
    feats = PerceptualFeatures(net)
    with torch.no_grad():
        _, phi = feats(x)
        # the first block's input: class token + patch embeddings + positions (dropout is off)
        patches = net._process_input(x)
        tokens = torch.cat([net.class_token.expand(4, -1, -1), patches], dim=1) + net.encoder.pos_embedding
        tokens = net.encoder.layers.encoder_layer_0(tokens)
    # 16 patches + class token = 17 tokens of 32 dims per layer, 2 layers, squared norm 1 each
    assert phi.shape == (4, 2 * 17 * 32)
    torch.testing.assert_close(phi.pow(2).sum(1), torch.full((4,), 2.0), rtol=1e-5, atol=1e-5)
    first = tokens / (tokens.norm(dim=2, keepdim=True) + FEATURE_EPS) / math.sqrt(17)
    torch.testing.assert_close(phi[:, : 17 * 32], first.reshape(4, -1), rtol=1e-5, atol=1e-6)


class _OddNet(nn.Module):
    """No stage, block, attention, recurrence or hidden linear that runs: a conv kept for old
    checkpoints is never called, so only the generic fallback finds features."""

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        self.legacy = nn.Conv2d(3, 4, 3)
        self.norm = nn.LayerNorm(8)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)
        self.temperature = temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.act(self.norm(x)))) / self.temperature


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_probe_skips_modules_that_never_run_and_falls_back_to_the_deepest_modules(temperature: float) -> None:
    # temperature 2: the head's output is not the model output, the shape rule finds the head
    net = _OddNet(temperature).eval()
    x = torch.randn(4, 8)
    assert default_feature_layers(net) == ["legacy"]  # structure alone: the conv
    # probed: the conv never runs; dropout (identity in eval) and the head are left out
    assert default_feature_layers(net, example_input=x) == ["norm", "act"]
    feats = PerceptualFeatures(net)
    assert feats.layer_names == ["legacy"]  # structural until the first call
    _, phi = feats(x)
    assert feats.layer_names == ["norm", "act"]
    assert phi.shape == (4, 16)


class _GradOnlyPathNet(nn.Module):
    """Like a fused fast path: without grad one conv does the work, with grad two convs do."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = nn.Conv2d(3, 4, 3, padding=1)
        self.slow = nn.Conv2d(3, 4, 3, padding=1)
        self.both = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.slow(x) if torch.is_grad_enabled() else self.fused(x)
        return self.head(self.both(h).mean(dim=(2, 3)))


def test_probe_keeps_only_layers_that_fire_both_under_no_grad_and_with_grad() -> None:
    net = _GradOnlyPathNet().eval()
    x = torch.randn(4, 3, 5, 5)
    assert default_feature_layers(net) == ["fused", "slow", "both"]
    assert default_feature_layers(net, example_input=x) == ["both"]
    feats = PerceptualFeatures(net)
    with torch.no_grad():  # the solver's first call
        feats(x)
    _, phi = feats(x.clone().requires_grad_(True))  # and its later ones
    assert feats.layer_names == ["both"]
    assert phi.shape == (4, 4 * 5 * 5)


def test_no_default_layer_that_fires_raises_value_error_naming_layers() -> None:
    class HeadOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.legacy = nn.Conv2d(3, 4, 3)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x)

    net = HeadOnly()
    x = torch.randn(4, 8)
    assert default_feature_layers(net, example_input=x) == []
    message = r"No default feature layer.*`layers=`.*Available names: \['legacy', 'head'\]"
    with pytest.raises(ValueError, match=message):
        resolve_layers(net, None, example_input=x)
    feats = PerceptualFeatures(net)  # the structure offers the conv: refused only by the probe
    with pytest.raises(ValueError, match=message):
        feats(x)
    assert all(len(m._forward_hooks) == 0 for m in net.modules())


class _BNDropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.drop(self.bn(self.conv(x))))
        return self.head(h.mean(dim=(2, 3)))


def test_probe_leaves_parameters_buffers_flags_grads_and_rng_unchanged() -> None:
    torch.manual_seed(0)
    net = _BNDropoutNet()
    net.train()
    net.block[1].eval()  # mixed flags must come back as they were
    flags = [m.training for m in net.modules()]
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(5, 3, 6, 6)
    rng = torch.get_rng_state()

    assert default_feature_layers(net, example_input=x) == ["conv", "block.0"]
    assert resolve_layers(net, None, example_input=x) == ["conv", "block.0"]

    assert [m.training for m in net.modules()] == flags
    for key, value in net.state_dict().items():  # parameters and BN running statistics
        assert torch.equal(value, state[key]), key
    assert all(p.grad is None for p in net.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(len(m._forward_hooks) == 0 for m in net.modules())
    # the check is meaningful: a train-mode forward would move the statistics
    net(x)
    assert not torch.equal(net.bn.running_mean, state["bn.running_mean"])


def test_probe_keeps_the_twin_statistics_capture_for_the_first_real_forward() -> None:
    from lpa3_lightning.core.forward_modes import frozen_batch_statistics
    from lpa3_lightning.core.dual_bn import convert_dual_bn

    torch.manual_seed(0)
    net = convert_dual_bn(_BNDropoutNet()).eval()
    x = torch.randn(8, 3, 6, 6)
    with frozen_batch_statistics(net, "twin") as reference:
        net(x)
    with frozen_batch_statistics(net, "twin") as captured:
        PerceptualFeatures(net)(x)  # probes with x[:2] first, then the real forward
    assert len(captured) == len(reference) == 2
    for (mean, var), (ref_mean, ref_var) in zip(captured.values, reference.values):
        torch.testing.assert_close(mean, ref_mean)
        torch.testing.assert_close(var, ref_var)


def test_lazy_default_probes_once_with_the_first_two_samples() -> None:
    net, x, expected = _foreign("transformer_encoder")
    batch_sizes: list[int] = []
    net.register_forward_pre_hook(lambda _m, args: batch_sizes.append(args[0].shape[0]))
    feats = PerceptualFeatures(net)
    assert batch_sizes == []  # nothing runs at construction
    feats(x)
    assert batch_sizes == [2, 2, 4]  # no-grad probe, grad probe, the call itself
    feats(x[:3])
    assert batch_sizes == [2, 2, 4, 3]  # cached: no second probe
    assert feats.layer_names == expected


def test_explicit_layers_resolve_at_construction_without_a_probe() -> None:
    net, x, _ = _foreign("lstm")
    batch_sizes: list[int] = []
    net.register_forward_pre_hook(lambda _m, args: batch_sizes.append(args[0].shape[0]))
    feats = PerceptualFeatures(net, layers="rnn")
    assert feats.layer_names == ["rnn"]
    feats(x)
    assert batch_sizes == [4]
    with pytest.raises(ValueError, match=re.escape("['rnn', 'head']")):
        PerceptualFeatures(net, layers="lstm")


def test_eval_mode_restores_each_modules_own_flag_even_on_error():
    from lpa3_lightning.core.checks import eval_mode

    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.BatchNorm1d(2))
    net.train()
    net[2].eval()  # the user froze this BN
    with pytest.raises(RuntimeError, match="inside"):
        with eval_mode(net):
            assert not any(m.training for m in net.modules())
            raise RuntimeError("inside")
    assert [m.training for m in net.modules()] == [True, True, True, False]


def test_a_position_whose_channels_are_all_zero_has_a_finite_gradient() -> None:
    """After a ReLU every channel of a position can be 0 (common in mobilenet_v3_small's small
    maps); the norm's square root has an infinite derivative there, and the gradient reaching
    the input became NaN, so the solver returned NaN x' (the training then diverged)."""
    activation = torch.randn(2, 4, 3, 3)
    activation[0, :, 1, 1] = 0.0  # one position with every channel at 0
    activation.requires_grad_(True)
    normalize_activation(activation).pow(2).sum().backward()
    assert torch.isfinite(activation.grad).all()
    # the value is the authors' formula: norm (sqrt of the channel sum of squares) + eps
    plain = activation.detach()
    expected = plain / ((plain.pow(2).sum(1, keepdim=True).sqrt() + FEATURE_EPS) * 3)
    torch.testing.assert_close(normalize_activation(plain), expected.flatten(1), rtol=0, atol=0)


class _Excite(nn.Module):
    """A squeeze-and-excitation gate as in mobilenet_v3: the map times a gate made from its mean."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.sigmoid(h.mean(dim=(2, 3), keepdim=True))


def test_x_prime_stay_finite_when_a_feature_position_is_all_zero() -> None:
    """mobilenet_v3_small's failure, small: a ReLU map zero at some positions, then a gate
    (squeeze-and-excitation) whose output is a feature layer. The norm's square root has an
    infinite derivative at those positions; the gate's backward multiplies it by 0 (NaN) and
    spreads it to every pixel through the mean, so the solver returned NaN x'."""
    from lpa3_lightning.core.solver import lpa3_attack

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 1), nn.ReLU(), _Excite(), nn.Flatten(), nn.Linear(4 * 16, 3))
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[0].bias.zero_()
    x = torch.rand(6, 1, 4, 4) + 0.5
    x[:, :, :2] = -1.0  # half of every image: all four channels 0 after the ReLU, noise or not
    x_adv = lpa3_attack(net, x, torch.randint(0, 3, (6,)), sigma=0.5, steps=3, layers=["2"])
    assert torch.isfinite(x_adv).all()
    assert float((x_adv - x).abs().max()) > 1e-3
