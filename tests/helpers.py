"""Small models and data shared by the tests (fast on 2 CPU cores)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
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


#: (seed, steps) -> (trained weights, global RNG state after training): trained once a session
_CONFIDENT: dict[tuple[int, int], tuple[dict[str, torch.Tensor], torch.Tensor]] = {}


def confident_cnn(seed: int = 0, steps: int = 150) -> nn.Module:
    """A small CNN trained to saturation on :func:`indexed_images` (p(y|x) close to 1), in eval mode.

    Trained once per ``(seed, steps)`` in a session (the training is deterministic); later calls
    get a fresh copy of those weights and leave the global random state as the training did, so a
    test draws the same numbers after it either way.
    """
    key = (seed, steps)
    if key not in _CONFIDENT:
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
        _CONFIDENT[key] = (copy.deepcopy(net.state_dict()), torch.get_rng_state())
    weights, rng_state = _CONFIDENT[key]
    net = small_cnn()
    net.load_state_dict(weights)
    torch.set_rng_state(rng_state)
    net.eval()
    return net


def confident_batch(n: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh samples of the distribution :func:`confident_cnn` was trained on."""
    data = indexed_images(n, seed=seed)
    return torch.stack([data[i][0] for i in range(n)]), torch.stack([data[i][1] for i in range(n)])


def randomize_bn_statistics(model: nn.Module) -> None:
    """Running statistics away from (0, 1), so that a BatchNorm in eval mode is not the identity."""
    for m in model.modules():
        if isinstance(m, _BatchNorm) and m.running_mean is not None:
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, cloned."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def indexed_images(n: int = 48, num_classes: int = 3, seed: int = 0) -> IndexedDataset:
    """Synthetic 1x28x28 images whose class sets the mean brightness (learnable fast)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % num_classes
    x = torch.randn(n, 1, 28, 28, generator=g) * 0.5 + (y.float() - 1.0)[:, None, None, None]
    return IndexedDataset(TensorDataset(x, y))


def reference_model(model: nn.Module, x_clean: torch.Tensor, twin_bn: bool = False, mode: str | None = None
                    ) -> nn.Module:
    """An eval-mode copy normalising as the training forward of x' must.

    ``mode`` (or ``twin_bn=True`` for ``"twin"``): ``"twin"``: every twin is swapped in for its main
    BN; ``"batch"``: the main BatchNorms themselves; either way a train-mode forward of the clean
    selected samples with momentum 1 writes their batch statistics into the running buffers
    (unbiased variance, made biased again, as BatchNorm normalises with the biased one).
    ``"eval"`` (default without twins): the running statistics as they are.
    """
    mode = mode or ("twin" if twin_bn else "eval")
    ref = copy.deepcopy(model)
    if mode in ("twin", "batch"):
        for name, module in list(ref.named_modules()):
            for child_name, child in list(module.named_children()):
                source = getattr(child, "twin", None) if mode == "twin" else child
                if isinstance(source, _BatchNorm):
                    plain = copy.deepcopy(source)
                    if hasattr(plain, "twin"):  # (a dual layer of a model in "batch" mode: its main BN alone)
                        del plain.twin
                    plain.momentum = 1.0
                    setattr(module, child_name, plain)
        counts: dict[nn.Module, int] = {}

        def count(m: nn.Module, inputs: Any, _out: Any) -> None:
            counts[m] = inputs[0].numel() // inputs[0].shape[1]

        bns = [m for m in ref.modules() if isinstance(m, _BatchNorm)]
        handles = [m.register_forward_hook(count) for m in bns]
        ref.train()
        with torch.no_grad():
            ref(x_clean.float())
        for h in handles:
            h.remove()
        for m in bns:
            n = counts[m]
            m.running_var.mul_((n - 1) / n)
    return ref.eval()


def independent_logp_drop(model: nn.Module, x: torch.Tensor, x_adv: torch.Tensor, y: torch.Tensor,
                          twin_bn: bool = False) -> torch.Tensor:
    """``log p(y|x) - log p(y|x')`` per sample, measured without the package's forward code.

    The model of :func:`reference_model` (eval mode; with ``twin_bn`` the twins normalise by
    the clean batch ``x``'s statistics, as the solver's twin forward must), in float32.
    """
    ref = reference_model(model, x, twin_bn)
    with torch.no_grad():
        logp = F.log_softmax(ref(x.float()), dim=1).gather(1, y[:, None]).squeeze(1)
        logp_adv = F.log_softmax(ref(x_adv.float()), dim=1).gather(1, y[:, None]).squeeze(1)
    return logp - logp_adv


def dispatched_ops(fn) -> list[str]:
    """The aten operators ``fn`` dispatches, in order (an independent view of what it runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record() as record:
        fn()
    return record.ops


def lpa3_state(checkpoint: Any, network: str | None = None) -> dict:
    """One network's LPA3Callback state (``"tcs"``, ``"cache"``, ...) in a checkpoint (a path or a
    loaded dict) written with one LPA3Callback."""
    if not isinstance(checkpoint, dict):
        checkpoint = torch.load(checkpoint, weights_only=False)
    (state,) = [s for s in checkpoint["callbacks"].values() if isinstance(s, dict) and "networks" in s and "seed" in s]
    return state["networks"]["" if network is None else network]


class GlobalRandomState(Callback):
    """The user's part of a bitwise resume with dropout or random transforms in the main process:
    torch's global generator, which neither Lightning nor LPA3Callback checkpoints, saved with the
    checkpoint and restored when training starts again."""

    restore: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restore = state_dict["cpu"]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.restore is not None:
            torch.set_rng_state(self.restore)


# ---------------------------------------------------------------------------------------- host reads
# Counting host reads of tensor values in a block (where a GPU run would wait: .item(), bool()/int()/float() of a
# tensor, .tolist(), nonzero(), a boolean-mask index); on the CPU they happen at the same places. Copies between
# devices are not seen. (The package's own counter until 0.4.0, when the sync-free path it served was removed.)
import collections  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

#: The ``Tensor`` methods that read a value on the host.
HOST_READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero")


class HostReadCounter:
    """Counts host reads of tensor values while active (a context manager; not re-entrant).

    Attributes:
        counts: reads by kind (method name, or ``"boolean mask index"``).
        sites: reads by call site, the innermost frame inside ``package`` (else ``"(outside)"``).
    """

    def __init__(self, package: str = "lpa3_lightning") -> None:
        self.package = package
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}
        self._local = threading.local()

    @property
    def total(self) -> int:
        """All reads counted so far."""
        return sum(self.counts.values())

    def _record(self, kind: str) -> None:
        if getattr(self._local, "inside", False):
            return  # a read made by another counted read (e.g. __bool__ calling item)
        self._local.inside = True
        try:
            self.counts[kind] += 1
            site = "(outside)"
            for frame in reversed(traceback.extract_stack()[:-2]):
                if f"/{self.package}/" in frame.filename.replace("\\", "/"):
                    site = f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"
                    break
            self.sites[site] += 1
        finally:
            self._local.inside = False

    def _wrap(self, name: str, original: Any) -> Any:
        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._record(name)
            return original(tensor, *args, **kwargs)

        return wrapped

    def __enter__(self) -> HostReadCounter:
        if self._saved:
            raise RuntimeError("HostReadCounter is already active. Fix: use one `with` block at a time.")
        tensor = torch.Tensor
        for name in (*HOST_READS, "__getitem__", "__setitem__"):
            self._saved[name] = getattr(tensor, name)
        for name in HOST_READS:
            setattr(tensor, name, self._wrap(name, self._saved[name]))
        getitem, setitem = self._saved["__getitem__"], self._saved["__setitem__"]

        def is_mask(index: Any) -> bool:
            parts = index if isinstance(index, tuple) else (index,)
            return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)

        def masked_getitem(t: torch.Tensor, index: Any) -> Any:
            if is_mask(index):
                self._record("boolean mask index")
            return getitem(t, index)

        def masked_setitem(t: torch.Tensor, index: Any, value: Any) -> Any:
            # a scalar written through a mask is a masked_fill (no read); a tensor of values is not
            if is_mask(index) and isinstance(value, torch.Tensor) and value.dim() > 0:
                self._record("boolean mask index")
            return setitem(t, index, value)

        tensor.__getitem__ = masked_getitem  # type: ignore[method-assign]
        tensor.__setitem__ = masked_setitem  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}


def handed_over(module: Any, inputs: torch.Tensor, targets: torch.Tensor, indices: torch.Tensor, mask: torch.Tensor,
                *, bn_mode: str = "eval", statistics: Any = None, reference_inputs: torch.Tensor | None = None,
                network: str | None = None, skipped: int = 0) -> Any:
    """An AugmentedBatch as the callback hands it over (its verified forward attached: the network, BN mode,
    statistics and reference rows the solver would have used), built by hand for a module's loss."""
    from lpa3_lightning.callback.hard_positives import VerifiedForward
    from lpa3_lightning.methods.base import AugmentedBatch

    model = module.lpa3_model() if network is None else module.lpa3_model(network=network)
    batch = AugmentedBatch(inputs=inputs, targets=targets, indices=indices, mask=mask, skipped=skipped)
    batch.verified = VerifiedForward(model, module.lpa3_logits, bn_mode, statistics, reference_inputs, False)
    return batch
