"""lpa3_attack: shapes, the label-preserving promise, invariants, refusals, any modality."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lpa3_lightning.core.solver import lpa3_attack
from lpa3_lightning.core.dual_bn import convert_dual_bn
from lpa3_lightning.core.features import PerceptualFeatures
from lpa3_lightning.core.input_box import resolve_input_range
from tests.helpers import confident_batch, confident_cnn, dispatched_ops, independent_logp_drop, small_cnn, snapshot


def _batch(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_output_shape_dtype_device_and_detached():
    torch.manual_seed(0)
    net = small_cnn()
    x, y = _batch()
    x.requires_grad_(True)
    x_adv = lpa3_attack(net, x, y)
    assert x_adv.shape == x.shape and x_adv.dtype == x.dtype and x_adv.device == x.device
    assert not x_adv.requires_grad and x_adv.grad_fn is None
    assert not torch.equal(x_adv, x.detach())


def test_float64_inputs_keep_their_dtype():
    torch.manual_seed(0)
    net = small_cnn().double()
    x, y = _batch()
    assert lpa3_attack(net, x.double(), y, steps=2).dtype == torch.float64


def test_generator_makes_it_reproducible():
    torch.manual_seed(0)
    net = small_cnn()
    x, y = _batch()
    a = lpa3_attack(net, x, y, generator=torch.Generator().manual_seed(3))
    b = lpa3_attack(net, x, y, generator=torch.Generator().manual_seed(3))
    c = lpa3_attack(net, x, y, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def _logp(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(net(x), dim=1).gather(1, y[:, None]).squeeze(1)


@pytest.mark.parametrize("sigma", [0.002, 0.02])
def test_default_keeps_constraint_on_every_sample_of_a_confident_model(sigma):
    net = confident_cnn()
    x, y = confident_batch()
    x_adv, stats = lpa3_attack(net, x, y, sigma=sigma, return_stats=True, generator=torch.Generator().manual_seed(0))
    drop = _logp(net, x, y) - _logp(net, x_adv, y)
    assert bool((drop <= sigma + 1e-6).all()), drop.max()
    assert bool(stats.preserved.all())
    torch.testing.assert_close(stats.logp_drop, drop, atol=1e-5, rtol=0)
    assert float(stats.l2.mean()) > 0


def test_authors_loop_breaks_the_constraint_where_the_default_keeps_it():
    """The defect named in docs/method.md: with no input box the step explodes on a confident model."""
    net = confident_cnn()
    x, y = confident_batch()
    gen = torch.Generator().manual_seed(0)
    x_raw, raw = lpa3_attack(net, x, y, project=False, max_step=None, return_stats=True, generator=gen)
    gen = torch.Generator().manual_seed(0)
    x_proj, proj = lpa3_attack(net, x, y, project=True, max_step=None, return_stats=True, generator=gen)
    # re-measured with a forward of our own, not the solver's flags
    raw_drop = independent_logp_drop(net, x, x_raw, y)
    broken = raw_drop > 0.02 + 1e-5
    assert bool(broken.any())
    assert bool((independent_logp_drop(net, x, x_proj, y) <= 0.02 + 1e-5).all())
    # the bisection only touches violating samples: the others are the authors' x' exactly
    keep = raw_drop <= 0.02 - 1e-5  # clearly kept (a margin for rounding at the boundary)
    torch.testing.assert_close(x_proj[keep], x_raw[keep])
    assert bool(proj.projected[broken].all()) and not bool(proj.projected[keep].any())


@pytest.mark.parametrize("model", ["untrained", "confident"])
def test_hard_positive_is_farther_in_feature_space_than_random_noise_of_same_size(model):
    if model == "confident":  # where the default bisection pulls samples back
        net = confident_cnn()
        x, y = confident_batch(16)
    else:
        torch.manual_seed(0)
        net = small_cnn()
        net.eval()
        x, y = _batch(16)
    x_adv, stats = lpa3_attack(net, x, y, sigma=0.02, input_range=(-3.0, 3.0), max_step=None, return_stats=True,
                               generator=torch.Generator().manual_seed(0))
    if model == "confident":
        assert bool(stats.projected.any())
    delta = x_adv - x
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    noise = noise / noise.flatten(1).norm(dim=1).view(-1, 1, 1, 1) * delta.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    feats = PerceptualFeatures(net)
    with torch.no_grad():
        _, phi = feats(x)
        _, phi_adv = feats(x_adv)
        _, phi_rand = feats(x + noise)
    d_adv = (phi_adv - phi).norm(dim=1)
    d_rand = (phi_rand - phi).norm(dim=1)
    moved = delta.flatten(1).norm(dim=1) > 0
    assert bool((d_adv[moved] > d_rand[moved]).all())
    assert float(d_adv.mean()) > 1.2 * float(d_rand.mean())


def test_input_range_bounds_are_respected_per_channel():
    torch.manual_seed(0)
    net = small_cnn(in_channels=3)
    x = torch.rand(4, 3, 28, 28)
    y = torch.tensor([0, 1, 2, 0])
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    xn = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    x_adv = lpa3_attack(net, xn, y, sigma=1.0, input_range={"mean": mean, "std": std})
    back = x_adv * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    assert float(back.min()) >= -1e-5 and float(back.max()) <= 1 + 1e-5
    x_box = lpa3_attack(net, x, y, sigma=1.0, input_range=(0.0, 1.0))
    assert float(x_box.min()) >= 0.0 and float(x_box.max()) <= 1.0


def test_no_input_range_means_no_clamping():
    torch.manual_seed(0)
    net = small_cnn()
    x = torch.zeros(4, 1, 28, 28)
    y = torch.tensor([0, 1, 2, 0])
    x_adv = lpa3_attack(net, x, y, sigma=1.0)
    assert float(x_adv.min()) < 0.0 < float(x_adv.max())


def test_resolve_input_range_refusals():
    x = torch.zeros(2, 3, 4, 4)
    with pytest.raises(ValueError, match="channels"):
        resolve_input_range(([0, 0], [1, 1]), x)
    with pytest.raises(ValueError, match="low <= high"):
        resolve_input_range((1.0, 0.0), x)
    with pytest.raises(ValueError, match="low < high somewhere"):
        resolve_input_range((0.5, 0.5), x)
    with pytest.raises(ValueError, match="'mean' and 'std'"):
        resolve_input_range({"mean": 0.5}, x)
    with pytest.raises(ValueError, match="input_range"):
        resolve_input_range("0..1", x)


def test_works_on_a_1d_signal_model_and_a_tabular_mlp():
    """The method is domain-agnostic: no image assumption, no clamping by default."""
    torch.manual_seed(0)
    signal_net = nn.Sequential(nn.Conv1d(2, 8, 5, padding=2), nn.BatchNorm1d(8), nn.ReLU(),
                               nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 4))
    x_sig = torch.randn(6, 2, 100)
    y_sig = torch.randint(0, 4, (6,))
    x_adv, stats = lpa3_attack(signal_net, x_sig, y_sig, return_stats=True)
    assert x_adv.shape == x_sig.shape
    assert bool((independent_logp_drop(signal_net, x_sig, x_adv, y_sig) <= 0.02 + 1e-6).all())
    assert float(stats.perceptual_distance.mean()) > 0

    tab_net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))
    x_tab = torch.randn(5, 10)
    y_tab = torch.randint(0, 3, (5,))
    x_adv, stats = lpa3_attack(tab_net, x_tab, y_tab, return_stats=True)
    assert x_adv.shape == x_tab.shape
    assert bool((independent_logp_drop(tab_net, x_tab, x_adv, y_tab) <= 0.02 + 1e-6).all())
    assert float((x_adv - x_tab).abs().max()) > 0


@pytest.mark.parametrize("train_mode", [True, False])
@pytest.mark.parametrize("twin", [False, True])
def test_invariants_parameters_grads_bn_stats_and_modes(train_mode, twin):
    torch.manual_seed(0)
    net = small_cnn()
    if twin:
        convert_dual_bn(net)
    # give some parameters an existing .grad that must survive untouched
    net[0].weight.grad = torch.full_like(net[0].weight, 0.5)
    net.train(train_mode)
    net[9].eval()  # a mixed-mode model: dropout already in eval
    modes = {name: m.training for name, m in net.named_modules()}
    before = snapshot(net)
    x, y = _batch()
    lpa3_attack(net, x, y, bn_mode="twin" if twin else "eval")
    after = snapshot(net)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert {name: m.training for name, m in net.named_modules()} == modes
    assert torch.equal(net[0].weight.grad, torch.full_like(net[0].weight, 0.5))
    assert all(p.grad is None for name, p in net.named_parameters() if name != "0.weight")


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("fail_on_forward", [1, 3, 6])
def test_invariants_hold_when_the_call_raises(twin, fail_on_forward):
    """A model that raises on its k-th forward: before the loop, inside it, in the checks."""

    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = small_cnn()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == fail_on_forward:
                raise RuntimeError("boom")
            return self.body(x)

    torch.manual_seed(0)
    net = Flaky()
    if twin:
        convert_dual_bn(net)
    net.train()
    net.body[0].weight.grad = torch.full_like(net.body[0].weight, 0.25)
    modes = {name: m.training for name, m in net.named_modules()}
    before = snapshot(net)
    x, y = _batch()
    with pytest.raises(RuntimeError, match="boom"):
        lpa3_attack(net, x, y, bn_mode="twin" if twin else "eval")
    assert {name: m.training for name, m in net.named_modules()} == modes
    after = snapshot(net)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not m._forward_hooks for m in net.modules())
    assert torch.equal(net.body[0].weight.grad, torch.full_like(net.body[0].weight, 0.25))
    for layer in net.modules():
        assert "forward" not in layer.__dict__  # no frozen-statistics forward left behind
        if hasattr(layer, "_route_twin"):
            assert layer._route_twin is False


def test_label_out_of_range_is_refused_and_leaves_the_model_as_found():
    torch.manual_seed(0)
    net = small_cnn()
    net.train()
    before = snapshot(net)
    x, _ = _batch()
    with pytest.raises(ValueError, match="class indices"):
        lpa3_attack(net, x, torch.full((x.shape[0],), 7))
    assert net.training and all(torch.equal(before[k], v) for k, v in snapshot(net).items())


@pytest.mark.parametrize("sigma", [0.002, 0.02])
def test_twin_mode_keeps_the_constraint_per_sample_and_moves_no_statistic(sigma):
    from lpa3_lightning.core.forward_modes import attack_mode, label_logp

    net = convert_dual_bn(confident_cnn())
    net.train()
    before = snapshot(net)
    x, y = confident_batch()
    x_adv, stats = lpa3_attack(net, x, y, sigma=sigma, bn_mode="twin", return_stats=True,
                               generator=torch.Generator().manual_seed(0))
    after = snapshot(net)
    assert all(torch.equal(before[k], after[k]) for k in before)  # twin buffers included
    # an independent re-measurement in the same forward (twin, clean-batch statistics)
    with attack_mode(net, "twin"), torch.no_grad():
        drop = label_logp(net(x), y, 1.0) - label_logp(net(x_adv), y, 1.0)
    assert bool((drop <= sigma + 1e-6).all())
    assert bool(stats.preserved.all())
    torch.testing.assert_close(stats.logp_drop, drop, atol=1e-5, rtol=0)


def test_gradients_are_taken_with_respect_to_the_input_only():
    torch.manual_seed(0)
    net = small_cnn()
    for p in net.parameters():
        p.register_hook(lambda g: pytest.fail("a parameter gradient was computed"))
    x, y = _batch(4)
    lpa3_attack(net, x, y)


def test_empty_batch_returns_empty():
    net = small_cnn()
    x_adv, stats = lpa3_attack(net, torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long), return_stats=True)
    assert x_adv.shape == (0, 1, 28, 28) and stats.preserved.numel() == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sigma": 0.0}, "sigma"),
        ({"sigma": float("nan")}, "sigma"),
        ({"steps": 0}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"lam": -1.0}, "lam"),
        ({"temperature": 0.0}, "temperature"),
        ({"bn_mode": "train"}, "bn_mode"),
        ({"bn_mode": "twin"}, "convert_dual_bn"),
        ({"bisection_steps": 0}, "bisection_steps"),
        ({"layers": ["nope*"]}, "matches no module"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(kwargs, match):
    net = small_cnn()
    x, y = _batch(2)
    with pytest.raises(ValueError, match=match):
        lpa3_attack(net, x, y, **kwargs)


def test_bad_inputs_are_refused():
    net = small_cnn()
    x, y = _batch(2)
    with pytest.raises(ValueError, match="`y` must be an integer tensor of shape"):
        lpa3_attack(net, x, y.float())
    with pytest.raises(ValueError, match="`y` must be an integer tensor of shape"):
        lpa3_attack(net, x, y[:1])
    with pytest.raises(ValueError, match="floating tensor"):
        lpa3_attack(net, x.long(), y)
    x_nan = x.clone()
    x_nan[1, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or Inf in samples \[1\]"):
        lpa3_attack(net, x_nan, y)
    with pytest.raises(TypeError, match="nn.Module"):
        lpa3_attack(lambda v: v, x, y)


def test_dict_output_needs_logits_fn():
    class DictNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = small_cnn()

        def forward(self, x):
            return {"logits": self.body(x)}

    net = DictNet()
    x, y = _batch(2)
    with pytest.raises(TypeError, match="logits_fn"):
        lpa3_attack(net, x, y)
    assert lpa3_attack(net, x, y, logits_fn=lambda out: out["logits"]).shape == x.shape


def test_autocast_does_not_change_the_solver():
    """The solver computes in float32 with autocast off, so bf16 autocast around it changes nothing."""
    torch.manual_seed(0)
    net = small_cnn()
    x, y = _batch()
    plain = lpa3_attack(net, x, y, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast, stats = lpa3_attack(net, x, y, generator=torch.Generator().manual_seed(0), return_stats=True)
    assert torch.equal(plain, under_autocast)
    assert stats.logp_drop.dtype == torch.float32
    assert bool((independent_logp_drop(net, x, under_autocast, y) <= 0.02 + 1e-6).all())


def test_low_precision_inputs_are_attacked_in_the_model_dtype_and_returned_in_theirs():
    net = confident_cnn()
    x, y = confident_batch(16)
    x_adv, stats = lpa3_attack(net, x.bfloat16(), y, return_stats=True, generator=torch.Generator().manual_seed(0))
    assert x_adv.dtype == torch.bfloat16
    assert bool(torch.isfinite(x_adv.float()).all())
    # the solver checked x' in float32; rounding x' to bfloat16 may move log p by more than
    # float noise, so the returned tensor is re-measured as returned (what trains on it)
    drop = independent_logp_drop(net, x.bfloat16(), x_adv, y)
    assert bool((drop <= 0.02 + 1e-6).all()), drop.max()


def test_a_compiled_model_is_attacked_through_its_eager_original():
    torch.manual_seed(0)
    net = small_cnn()
    compiled = torch.compile(net)
    x, y = _batch(4)
    eager = lpa3_attack(net, x, y, steps=2, generator=torch.Generator().manual_seed(0))
    through_compiled = lpa3_attack(compiled, x, y, steps=2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(eager, through_compiled)


@pytest.mark.parametrize("sigma", [0.002, 0.02])
def test_fast_mode_keeps_the_constraint_and_moves_away_from_x(sigma):
    net = confident_cnn()
    x, y = confident_batch()
    x_adv, stats = lpa3_attack(net, x, y, sigma=sigma, fast=True, return_stats=True,
                               generator=torch.Generator().manual_seed(0))
    drop = _logp(net, x, y) - _logp(net, x_adv, y)
    assert bool((drop <= sigma + 1e-6).all()) and bool(stats.preserved.all())
    assert float(stats.perceptual_distance.mean()) > 0.1


# ------------------------------------------------------------------ max_step (not the authors')
def test_max_step_bounds_the_distance_where_the_authors_step_jumps():
    """On a saturated model the slope is ~0 and the authors' step sigma/slope is huge; max_step caps it."""
    net = confident_cnn()
    x, y = confident_batch()
    free, free_stats = lpa3_attack(net, x, y, max_step=None, return_stats=True,
                                   generator=torch.Generator().manual_seed(0))
    capped, stats = lpa3_attack(net, x, y, max_step=0.5, return_stats=True, generator=torch.Generator().manual_seed(0))
    # start noise (+-0.01 per value) plus 5 steps of at most 0.5; a bisection only shortens
    bound = 0.01 * x[0].numel() ** 0.5 + 5 * 0.5
    assert float(stats.l2.max()) <= bound + 1e-4
    assert float(free_stats.l2.max()) > 2 * bound  # what the cap prevents on this model
    assert bool((independent_logp_drop(net, x, capped, y) <= 0.02 + 1e-6).all())
    assert float(stats.perceptual_distance.mean()) > 0


def test_a_max_step_longer_than_any_step_changes_nothing_and_a_short_one_does():
    torch.manual_seed(0)
    net = small_cnn()
    x, y = _batch()

    def attack(**kwargs):
        return lpa3_attack(net, x, y, generator=torch.Generator().manual_seed(0), **kwargs)

    default = attack(max_step=None)
    assert torch.equal(attack(max_step=1e30), default)
    assert not torch.equal(attack(max_step=1e-3), default)


@pytest.mark.parametrize("box", [(-1.0, 1.0), None])
def test_auto_max_step_is_the_default_and_bounds_the_move(box):
    """Out of the box no x' becomes clipped noise: five steps of at most 2% of the box diagonal."""
    net = confident_cnn()
    x, y = confident_batch()
    if box is not None:
        x = x.clamp(*box)  # samples inside their box: any move is the solver's, not the clamp's
    gen = torch.Generator
    default, stats = lpa3_attack(net, x, y, input_range=box, return_stats=True, generator=gen().manual_seed(0))
    assert torch.equal(default, lpa3_attack(net, x, y, input_range=box, max_step="auto", generator=gen().manual_seed(0)))
    if box is not None:
        diagonal = (box[1] - box[0]) * x[0].numel() ** 0.5  # computed here, not by auto_max_step
    else:
        diagonal = 4.0 * float(x.flatten(1).var(dim=0, unbiased=False).sum().sqrt())
    bound = 0.01 * x[0].numel() ** 0.5 + 5 * 0.02 * diagonal
    l2 = (default - x).flatten(1).norm(dim=1)
    assert float(l2.max()) <= bound + 1e-4
    free = lpa3_attack(net, x, y, input_range=box, max_step=None, generator=gen().manual_seed(0))
    assert float((free - x).flatten(1).norm(dim=1).max()) > bound  # what the default prevents here
    drop = _logp(net, x, y) - _logp(net, default, y)
    assert bool((drop <= 0.02 + 1e-6).all())
    assert float(stats.perceptual_distance.mean()) > 0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_max_step_is_validated(bad):
    net = small_cnn()
    x, y = _batch(2)
    with pytest.raises(ValueError, match="max_step"):
        lpa3_attack(net, x, y, max_step=bad)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_allow_tf32_is_validated(bad):
    net = small_cnn()
    x, y = _batch(2)
    with pytest.raises(ValueError, match="allow_tf32"):
        lpa3_attack(net, x, y, allow_tf32=bad)


def _precision_state() -> tuple:
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        try:  # torch itself refuses this read after some mixes of its old and new settings
            generic = torch.get_float32_matmul_precision()
        except RuntimeError:
            generic = "unreadable"
        return conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision, generic
    return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("setting", ["default", "medium", "new_api", "legacy"])
def test_tf32_switch_restores_every_way_of_setting_precision(setting):
    """The CUDA branch only flips flags, so it runs on a CPU build too (no kernel is launched)."""
    from lpa3_lightning.core.forward_modes import full_float32

    conv = getattr(torch.backends.cudnn, "conv", None)
    has_new_api = conv is not None and hasattr(conv, "fp32_precision")
    if setting in ("new_api",) and not has_new_api:
        pytest.skip("this torch has no fp32_precision settings")
    before_test = _precision_state()
    try:
        if setting == "medium":
            torch.set_float32_matmul_precision("medium")
        elif setting == "new_api":
            conv.fp32_precision = torch.backends.cuda.matmul.fp32_precision = "tf32"
        elif setting == "legacy":
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
        before = _precision_state()
        with pytest.raises(KeyError), full_float32(torch.device("cuda")):
            if has_new_api:
                assert (conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision) == ("ieee", "ieee")
            else:
                assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
            raise KeyError("restored on the way out too")
        assert _precision_state() == before  # also: as readable as before
        with full_float32(torch.device("cpu")):
            assert _precision_state() == before  # nothing to do on the CPU
    finally:
        torch.set_float32_matmul_precision("highest")
        if has_new_api:
            conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = before_test[:2]
        assert _precision_state() == before_test


def test_the_authors_mode_follows_a_transcription_of_the_authors_loop_in_float64():
    """``project=False, max_step=None`` is the authors' loop: against ``tests/core/authors_attack.py``
    (their ``get_attack`` transcribed) on the same initial noise, five steps, in float64 (sigma 0.002: their CIFAR-10 bound; at 0.02 the
    unbounded 1/slope step amplifies float64 rounding past 1e-9 by the fifth step)."""
    from tests.core.authors_attack import authors_attack

    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU()),
              nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, stride=2), nn.ReLU())]
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    model = nn.Sequential(*stages, head).double()
    x = torch.rand(6, 1, 12, 12, dtype=torch.float64) * 2 - 1
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    generator = torch.Generator().manual_seed(3)
    ours = lpa3_attack(model, x, y, sigma=0.002, steps=5, lam=1.0, layers=["0", "1"], input_range=(-1.0, 1.0),
                       generator=generator, project=False, max_step=None)
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    theirs = authors_attack(list(model[:2]), model[2], x, y, (2 * noise - 1) * 0.01, bound=0.002, lam=1.0,
                            iterations=5, lower=-1.0, upper=1.0)
    assert ours.dtype == torch.float64
    assert float((theirs - x).flatten(1).norm(dim=1).min()) > 0.1  # the loop moved every sample
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9)


def test_a_box_that_pins_a_constant_feature_keeps_it_and_moves_the_others():
    """Tabular data often has a feature constant over the training set (its range a point, e.g.
    the border pixels of sklearn's digits): the box pins it, the other features still move."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.rand(8, 6)
    x[:, 0] = 0.0
    low, high = torch.zeros(6), torch.ones(6)
    high[0] = 0.0  # feature 0 never varies in the data
    x_adv = lpa3_attack(net, x, torch.randint(0, 3, (8,)), sigma=0.5, steps=3, input_range=(low, high))
    assert torch.equal(x_adv[:, 0], x[:, 0])
    assert float((x_adv[:, 1:] - x[:, 1:]).abs().max()) > 1e-3


class _NaNGradient(nn.Module):
    """The identity in the forward, NaN in the backward (0 times the infinite slope of sqrt at 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0 * (x - x.detach()).abs().sqrt()


def test_a_row_the_solver_cannot_keep_finite_comes_back_as_x() -> None:
    """Whatever a foreign model's backward does, no NaN x' reaches training (it would turn the
    weights to NaN): such a row is returned as its clean input, with distance 0."""
    torch.manual_seed(0)
    net = nn.Sequential(_NaNGradient(), nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    x_adv, stats = lpa3_attack(net, x, y, sigma=0.5, steps=2, layers=["2"], return_stats=True)
    assert torch.equal(x_adv, x)
    assert torch.equal(stats.perceptual_distance, torch.zeros(4))


def test_the_method_doc_names_the_dtype_the_constraint_is_compared_in():
    """docs/method.md's row on the constraint says in which float type ``log p`` is compared (the
    bisection and ``lpa3/label_preserved`` both take it from ``label_logp``): the type it returns
    for a float32 model, and float64 only for a float64 one."""
    import re
    from pathlib import Path

    from lpa3_lightning.core.forward_modes import label_logp

    row = next(line for line in (Path(__file__).resolve().parents[2] / "docs" / "method.md").read_text().splitlines()
               if line.startswith("| constraint |"))
    stated = re.search(r"`log p` is compared in (float\d+)", row)
    assert stated is not None, row
    y = torch.tensor([0, 1])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert label_logp(torch.zeros(2, 3, dtype=dtype), y, 1.0).dtype == getattr(torch, stated.group(1)), dtype
    assert label_logp(torch.zeros(2, 3, dtype=torch.float64), y, 1.0).dtype == torch.float64


def test_an_image_batch_without_an_input_range_is_warned_about_and_none_says_there_is_no_box():
    import warnings

    model = small_cnn().eval()
    x, y = torch.rand(4, 1, 28, 28) * 2 - 1, torch.tensor([0, 1, 2, 0])
    with pytest.warns(UserWarning, match=r"no `input_range` for an image batch.*Fix: pass the box"):
        lpa3_attack(model, x, y, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lpa3_attack(model, x, y, steps=1, input_range=None)  # said: no box
