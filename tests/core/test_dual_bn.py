"""Tests for lpa3_lightning.core.dual_bn: conversion, checkpoints, routing through the twin BN."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lpa3_lightning.core.dual_bn import (
    TWIN_MOMENTUM,
    DualBatchNorm1d,
    DualBatchNorm2d,
    DualBatchNorm3d,
    convert_dual_bn,
    has_dual_bn,
    use_twin_bn,
)


def _randomize_bn(model: nn.Module, seed: int = 0) -> None:
    """Give every BN non-default affine params and running stats (so equality tests bite)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                if m.affine:
                    m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                    m.bias.copy_(torch.randn(m.num_features, generator=g))
                if m.track_running_stats:
                    m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                    m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                    m.num_batches_tracked.fill_(17)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.fc = nn.Linear(4, 6)
        self.bn1d = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(F.relu(self.bn(self.conv(x))))
        return self.head(self.bn1d(self.fc(x.mean(dim=(2, 3)))))


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    net = _Net()
    _randomize_bn(net, seed)
    return net


def _all_bn_net() -> nn.Module:
    return nn.ModuleDict(
        {
            "b1": nn.BatchNorm1d(3),
            "b2": nn.BatchNorm2d(4),
            "b3": nn.BatchNorm3d(5),
            "nested": nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, affine=False)),
        }
    )


# --------------------------------------------------------------------------- conversion


def test_convert_replaces_bn1d_2d_3d_and_keeps_main_state() -> None:
    model = _all_bn_net()
    _randomize_bn(model)
    plain_state = copy.deepcopy(model.state_dict())
    assert not has_dual_bn(model)
    out = convert_dual_bn(model)
    assert out is model
    assert has_dual_bn(model)
    assert type(model["b1"]) is DualBatchNorm1d
    assert type(model["b2"]) is DualBatchNorm2d
    assert type(model["b3"]) is DualBatchNorm3d
    assert type(model["nested"][1]) is DualBatchNorm2d
    assert model["nested"][1].affine is False
    state = model.state_dict()
    for key, value in plain_state.items():
        assert torch.equal(state[key], value), key
    # the twins start as copies of the main BN, with the twin momentum
    for name in ("b1", "b2", "b3"):
        bn = model[name]
        assert type(bn.twin) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
        assert bn.twin.momentum == TWIN_MOMENTUM
        assert bn.momentum == 0.1
        assert torch.equal(bn.twin.weight, bn.weight) and bn.twin.weight is not bn.weight
        assert torch.equal(bn.twin.running_mean, bn.running_mean)
        assert bn.twin.running_mean.data_ptr() != bn.running_mean.data_ptr()


def test_convert_keeps_eps_momentum_training_flag_and_dtype() -> None:
    bn = nn.BatchNorm2d(3, eps=1e-3, momentum=0.001).double().eval()
    model = nn.Sequential(bn)
    convert_dual_bn(model, twin_momentum=0.05)
    dual = model[0]
    assert isinstance(dual, DualBatchNorm2d)
    assert dual.eps == 1e-3 and dual.momentum == 0.001
    assert dual.twin.momentum == 0.05 and dual.twin.eps == 1e-3
    assert not dual.training and not dual.twin.training
    assert dual.weight.dtype == torch.float64 and dual.twin.running_var.dtype == torch.float64


def test_convert_root_batchnorm_returns_new_module() -> None:
    bn = nn.BatchNorm1d(3)
    dual = convert_dual_bn(bn)
    assert isinstance(dual, DualBatchNorm1d)
    assert has_dual_bn(dual)


def test_convert_gives_syncbatchnorm_a_twin_and_leaves_other_subclasses_alone() -> None:
    class MyBN(nn.BatchNorm2d):
        pass

    model = nn.Sequential(nn.SyncBatchNorm(3), MyBN(3))
    convert_dual_bn(model)
    assert type(model[0]).__name__ == "DualSyncBatchNorm" and type(model[1]) is MyBN
    assert has_dual_bn(model)


@pytest.mark.parametrize("momentum", [0.0, -0.1, 1.5])
def test_bad_twin_momentum_raises(momentum: float) -> None:
    with pytest.raises(ValueError, match=r"`twin_momentum` must be in \(0, 1\]"):
        convert_dual_bn(_net(), twin_momentum=momentum)


def test_convert_twice_keeps_dual_types() -> None:
    model = _net()
    convert_dual_bn(model)
    convert_dual_bn(model)
    assert type(model.bn) is DualBatchNorm2d
    assert type(model.bn1d) is DualBatchNorm1d


def test_convert_twice_is_idempotent() -> None:
    model = convert_dual_bn(_net())
    keys = list(model.state_dict())
    convert_dual_bn(model)
    assert list(model.state_dict()) == keys
    assert type(model.bn.twin) is nn.BatchNorm2d


# --------------------------------------------------------------------------- checkpoints


def test_state_dict_keys_superset_with_twin_keys() -> None:
    plain = _net()
    plain_keys = set(plain.state_dict())
    converted = convert_dual_bn(copy.deepcopy(plain))
    conv_keys = set(converted.state_dict())
    assert plain_keys <= conv_keys
    extra = conv_keys - plain_keys
    assert extra
    assert all(".twin." in k for k in extra)
    # every BN key has its twin counterpart, e.g. bn.weight -> bn.twin.weight
    for prefix in ("bn.", "block.1.", "bn1d."):
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert prefix + name in plain_keys
            assert prefix + "twin." + name in extra


def test_plain_checkpoint_loads_strict_and_evaluates_identically() -> None:
    plain = _net(seed=0).eval()
    converted = convert_dual_bn(_net(seed=1)).eval()  # different weights before loading
    result = converted.load_state_dict(plain.state_dict(), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    x = torch.randn(4, 2, 6, 6)
    with torch.no_grad():
        assert torch.equal(converted(x), plain(x))


def test_twin_initialised_from_loaded_main_bn_when_checkpoint_has_no_twin_keys() -> None:
    plain = _net(seed=0)
    converted = convert_dual_bn(_net(seed=1))
    converted.load_state_dict(plain.state_dict())
    for name in ("bn", "block.1", "bn1d"):
        dual = converted.get_submodule(name)
        main = plain.get_submodule(name)
        for key, value in main.state_dict().items():
            twin_value = dual.twin.state_dict()[key]
            assert torch.equal(twin_value, value), (name, key)
            assert twin_value.data_ptr() != dual.state_dict()[key].data_ptr()
        assert dual.twin.momentum == TWIN_MOMENTUM


def test_converted_checkpoint_round_trip_keeps_twin_values() -> None:
    src = convert_dual_bn(_net(seed=0))
    with torch.no_grad():
        src.bn.twin.weight.fill_(3.0)
        src.bn.twin.running_mean.fill_(-2.0)
    dst = convert_dual_bn(_net(seed=1))
    dst.load_state_dict(src.state_dict(), strict=True)
    assert torch.equal(dst.bn.twin.weight, torch.full((4,), 3.0))
    assert torch.equal(dst.bn.twin.running_mean, torch.full((4,), -2.0))
    assert torch.equal(dst.bn.weight, src.bn.weight)
    assert not torch.equal(dst.bn.weight, dst.bn.twin.weight)


def test_plain_checkpoint_with_assign_keeps_twin_and_main_separate() -> None:
    plain = _net(seed=0)
    converted = convert_dual_bn(_net(seed=1)).train()
    converted.load_state_dict(plain.state_dict(), assign=True)
    before = converted.bn.running_mean.clone()
    with use_twin_bn(converted):
        converted(torch.randn(4, 2, 6, 6) + 3.0)
    assert torch.equal(converted.bn.running_mean, before)


# --------------------------------------------------------------------------- routing


def _single_bn() -> tuple[nn.Module, DualBatchNorm2d]:
    bn = nn.BatchNorm2d(3)
    _randomize_bn(nn.Sequential(bn), seed=3)
    model = convert_dual_bn(nn.Sequential(bn))
    return model, model[0]


def test_use_twin_bn_routes_through_twin_in_eval_mode() -> None:
    model, dual = _single_bn()
    model.eval()
    with torch.no_grad():
        dual.twin.weight.fill_(2.5)
        dual.twin.bias.fill_(-1.0)
        dual.twin.running_mean.fill_(0.3)
    x = torch.randn(4, 3, 5, 5)
    with torch.no_grad():
        main_out = model(x)
        with use_twin_bn(model):
            twin_out = model(x)
    expected_main = F.batch_norm(x, dual.running_mean, dual.running_var, dual.weight, dual.bias, False, 0.0, dual.eps)
    expected_twin = F.batch_norm(
        x, dual.twin.running_mean, dual.twin.running_var, dual.twin.weight, dual.twin.bias, False, 0.0, dual.eps
    )
    torch.testing.assert_close(main_out, expected_main)
    torch.testing.assert_close(twin_out, expected_twin)
    assert not torch.allclose(main_out, twin_out)


def test_use_twin_bn_train_mode_updates_only_twin_stats_with_momentum() -> None:
    model, dual = _single_bn()
    model.train()
    main_state = copy.deepcopy(dual.state_dict())
    main_state = {k: v for k, v in main_state.items() if not k.startswith("twin.")}
    twin_mean0 = dual.twin.running_mean.clone()
    twin_var0 = dual.twin.running_var.clone()
    x = torch.randn(6, 3, 4, 4) * 2.0 + 1.0
    with torch.no_grad(), use_twin_bn(model) as routed:
        assert routed is model
        out = model(x)
    # main BN untouched
    for k, v in main_state.items():
        assert torch.equal(dual.state_dict()[k], v), k
    # twin moved with momentum 0.01 (unbiased variance, as BatchNorm does)
    batch_mean = x.mean(dim=(0, 2, 3))
    batch_var = x.var(dim=(0, 2, 3), unbiased=True)
    torch.testing.assert_close(dual.twin.running_mean, 0.99 * twin_mean0 + 0.01 * batch_mean)
    torch.testing.assert_close(dual.twin.running_var, 0.99 * twin_var0 + 0.01 * batch_var)
    assert int(dual.twin.num_batches_tracked) == 18
    # output uses batch stats and the twin's affine params
    expected = F.batch_norm(x, None, None, dual.twin.weight, dual.twin.bias, True, 0.0, dual.eps)
    torch.testing.assert_close(out, expected)


def test_use_twin_bn_output_follows_twin_weight() -> None:
    model, dual = _single_bn()
    model.train()
    x = torch.randn(4, 3, 4, 4)
    with torch.no_grad():
        with use_twin_bn(model, track_running_stats=False):
            before = model(x)
        dual.twin.weight.mul_(3.0)
        with use_twin_bn(model, track_running_stats=False):
            after = model(x)
        main = model(x)
    assert not torch.allclose(before, after)
    # main path ignores the twin weight change
    expected_main = F.batch_norm(x, None, None, dual.weight, dual.bias, True, 0.0, dual.eps)
    torch.testing.assert_close(main, expected_main)


def test_main_path_in_train_mode_updates_main_not_twin() -> None:
    model, dual = _single_bn()
    model.train()
    twin_state = copy.deepcopy(dual.twin.state_dict())
    mean0 = dual.running_mean.clone()
    x = torch.randn(4, 3, 4, 4) + 2.0
    with torch.no_grad():
        model(x)
    for k, v in twin_state.items():
        assert torch.equal(dual.twin.state_dict()[k], v), k
    torch.testing.assert_close(dual.running_mean, 0.9 * mean0 + 0.1 * x.mean(dim=(0, 2, 3)))


def test_track_running_stats_false_leaves_twin_buffers_untouched() -> None:
    model, dual = _single_bn()
    model.train()
    state = copy.deepcopy(dual.state_dict())  # main and twin
    x = torch.randn(5, 3, 4, 4) * 3.0 - 1.0
    with torch.no_grad(), use_twin_bn(model, track_running_stats=False):
        out = model(x)
    for k, v in state.items():
        assert torch.equal(dual.state_dict()[k], v), k
    expected = F.batch_norm(x, None, None, dual.twin.weight, dual.twin.bias, True, 0.0, dual.eps)
    torch.testing.assert_close(out, expected)


def test_track_running_stats_false_rejects_wrong_input_dim() -> None:
    model, _ = _single_bn()
    model.train()
    with pytest.raises(ValueError, match="expected 4D input"), use_twin_bn(model, track_running_stats=False):
        model(torch.randn(4, 3))


def test_routing_restored_after_block_even_when_body_raises() -> None:
    model, dual = _single_bn()
    model.train()
    with pytest.raises(KeyError, match="inside"), use_twin_bn(model):
        raise KeyError("inside")
    twin_mean = dual.twin.running_mean.clone()
    main_mean = dual.running_mean.clone()
    x = torch.randn(4, 3, 4, 4) + 5.0
    with torch.no_grad():
        out = model(x)
    assert torch.equal(dual.twin.running_mean, twin_mean)  # twin not used any more
    assert not torch.equal(dual.running_mean, main_mean)  # main used
    torch.testing.assert_close(out, F.batch_norm(x, None, None, dual.weight, dual.bias, True, 0.0, dual.eps))


def test_nested_use_twin_bn_restores_outer_setting() -> None:
    model, dual = _single_bn()
    model.train()
    x = torch.randn(4, 3, 4, 4)
    with torch.no_grad(), use_twin_bn(model, track_running_stats=True):
        with use_twin_bn(model, track_running_stats=False):
            before = dual.twin.running_mean.clone()
            model(x)
            assert torch.equal(dual.twin.running_mean, before)
        model(x)  # back to tracking: twin stats move
        assert not torch.equal(dual.twin.running_mean, before)


def test_use_twin_bn_on_unconverted_model_raises() -> None:
    with pytest.raises(ValueError, match="convert_dual_bn"), use_twin_bn(_net()):
        pass


def test_use_twin_bn_1d_and_3d() -> None:
    model = convert_dual_bn(_all_bn_net()).train()
    with torch.no_grad():
        model["b1"].twin.bias.fill_(10.0)
        model["b3"].twin.bias.fill_(-10.0)
        with use_twin_bn(model):
            o1 = model["b1"](torch.randn(4, 3))
            o3 = model["b3"](torch.randn(2, 5, 2, 2, 2))
    torch.testing.assert_close(o1.mean(0), torch.full((3,), 10.0), atol=1e-4, rtol=0)
    torch.testing.assert_close(o3.mean(dim=(0, 2, 3, 4)), torch.full((5,), -10.0), atol=1e-4, rtol=0)


def test_sync_batchnorm_gets_a_local_twin_and_trains_in_one_process():
    from lpa3_lightning.core.dual_bn import DualSyncBatchNorm, LocalBatchNorm

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    net(torch.randn(2, 1, 8, 8))
    plain_state = {k: v.clone() for k, v in net.state_dict().items()}
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    convert_dual_bn(net)
    assert isinstance(net[1], DualSyncBatchNorm) and isinstance(net[1].twin, LocalBatchNorm)
    net.load_state_dict(plain_state)  # a plain checkpoint still loads strictly
    net.train()
    main_before = net[1].running_mean.clone()
    with use_twin_bn(net):
        net(torch.randn(4, 1, 8, 8)).sum().backward()
    assert torch.equal(net[1].running_mean, main_before)  # only the twin moved
    assert net[1].twin.weight.grad is not None and net[1].weight.grad is None
    with pytest.raises(ValueError, match="at least 2D"):
        net[1].twin(torch.randn(4))
