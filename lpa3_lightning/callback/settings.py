"""LPA3Callback's settings in groups: each a frozen dataclass that validates itself.

The callback takes the few settings a user tunes (``ratio``, ``sigma``, ``steps``,
``warmup_epochs``, ``seed``, and ``layers`` / ``input_range`` where they cannot be inferred)
directly, and the rest in five groups: :class:`SolverSettings`, :class:`SelectionSettings`,
:class:`CacheSettings`, :class:`RuntimeSettings` and :class:`LoggingSettings`. LightningCLI fills
a group from nested YAML keys::

    - class_path: lpa3_lightning.LPA3Callback
      init_args:
        ratio: 0.9
        sigma: 0.002
        cache:
          regenerate_every_n_epochs: 10

``preset="authors"`` gives the LP-A3 authors' behaviour in every group at once (the switches of
``docs/method.md`` section 7); a group given explicitly replaces its preset.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from lpa3_lightning.core.cache import DEFAULT_MAX_BYTES
from lpa3_lightning.core.checks import check_bool_setting as _check_bool
from lpa3_lightning.core.checks import check_int_setting as _check_int
from lpa3_lightning.core.input_box import MaxStep, check_max_step
from lpa3_lightning.core.selection import check_initial_selection, check_threshold_rule
from lpa3_lightning.core.tcs import STORAGE_DTYPES

__all__ = ["CacheSettings", "LoggingSettings", "PRESETS", "RuntimeSettings", "SelectionSettings", "SolverSettings",
           "moved_setting", "preset_groups"]


@dataclass(frozen=True)
class SolverSettings:
    """How each hard positive is solved (:func:`~lpa3_lightning.core.attack.lpa3_attack`).

    Attributes:
        lam: the Lagrange multiplier's scale (the authors: 1).
        temperature: softmax temperature of ``log p`` and of the TCS predictions.
        project: keep the label-preserving constraint on every sample by bisection (True) or run
            the authors' unconstrained loop (False).
        max_step: largest L2 length of one solver step: ``"auto"`` (2% of the input box's
            diagonal), None (the authors' unbounded step) or a number.
        fast: the cheaper solver (one finite-difference forward; the farthest feasible iterate).
        attack_bn: ``"auto"`` (through the twin BatchNorms when the model has them, else eval
            mode), ``"twin"`` or ``"eval"``.
        allow_tf32: let the solver use TF32 on CUDA (off: full float32).
    """

    lam: float = 1.0
    temperature: float = 1.0
    project: bool = True
    max_step: MaxStep = "auto"
    fast: bool = False
    attack_bn: Literal["auto", "eval", "twin"] = "auto"
    allow_tf32: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.lam, (int, float)) and not isinstance(self.lam, bool) and math.isfinite(self.lam)
                and self.lam >= 0):
            raise ValueError(f"`solver.lam` must be a finite float >= 0, got {self.lam!r}. Fix: use 1.0 (the authors').")
        if not (isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
                and self.temperature > 0):
            raise ValueError(f"`solver.temperature` must be > 0, got {self.temperature!r}. Fix: use 1.0.")
        try:
            check_max_step(self.max_step)
        except ValueError as exc:
            raise ValueError(f"`solver.{str(exc)[1:]}") from None
        if self.attack_bn not in ("auto", "eval", "twin"):
            raise ValueError(f"`solver.attack_bn` must be 'auto', 'eval' or 'twin', got {self.attack_bn!r}. "
                             "Fix: use 'auto'.")
        for name in ("project", "fast", "allow_tf32"):
            _check_bool("solver", name, getattr(self, name), "use the default.")


@dataclass(frozen=True)
class SelectionSettings:
    """Which samples get a hard positive (:class:`~lpa3_lightning.core.tcs.TimeConsistency`).

    Attributes:
        num_samples: the training set's size (the TCS memory's rows); None infers it from the
            module's ``lpa3_num_samples`` or the train dataloader's dataset.
        divergence: the TCS divergence, ``"code"`` (the authors' code) or ``"paper"``.
        initial_memory: ``"uniform"`` (a distribution) or ``"authors"`` (1.01 for every class).
        initial_selection: before the first threshold, ``"random"`` (a seeded ``ratio`` share) or
            ``"all"`` (the authors').
        threshold_rule: ``"count"`` (exactly ``round(ratio * N)``) or ``"authors"`` (one fewer).
        memory_layout: where the stored predictions live under data parallelism: ``"auto"``
            (sharded with more than one process), ``"sharded"`` (each process keeps ``1/world_size``
            of them, :class:`~lpa3_lightning.core.tcs_shards.ShardedTimeConsistency`) or
            ``"replicated"`` (every process keeps all). The selections are the same either way
            (bit for bit on the CPU; on a GPU a score can differ in its last bit).
        memory_dtype: ``"float32"``, or ``"bfloat16"`` / ``"float16"`` to halve the stored
            predictions (the selections can then differ slightly: docs/multinode.md measures it).
    """

    num_samples: int | None = None
    divergence: Literal["code", "paper"] = "code"
    initial_memory: Literal["uniform", "authors"] = "uniform"
    initial_selection: Literal["random", "all"] = "random"
    threshold_rule: Literal["count", "authors"] = "count"
    memory_layout: Literal["auto", "sharded", "replicated"] = "auto"
    memory_dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    def __post_init__(self) -> None:
        if self.memory_layout not in ("auto", "sharded", "replicated"):
            raise ValueError(f"`selection.memory_layout` must be 'auto', 'sharded' or 'replicated', got "
                             f"{self.memory_layout!r}. Fix: use 'auto'.")
        if self.memory_dtype not in STORAGE_DTYPES:
            raise ValueError(f"`selection.memory_dtype` must be one of {sorted(STORAGE_DTYPES)}, got "
                             f"{self.memory_dtype!r}. Fix: use 'float32' (or 'bfloat16' to halve the memory).")
        if self.num_samples is not None:
            _check_int("selection", "num_samples", self.num_samples, 1,
                       "use None to infer it from the module or the train dataloader's dataset.")
        if self.divergence not in ("code", "paper"):
            raise ValueError(f"`selection.divergence` must be 'code' or 'paper', got {self.divergence!r}. "
                             "Fix: use 'code'.")
        if self.initial_memory not in ("uniform", "authors"):
            raise ValueError(f"`selection.initial_memory` must be 'uniform' or 'authors', got "
                             f"{self.initial_memory!r}. Fix: use 'uniform'.")
        check_initial_selection(self.initial_selection)
        check_threshold_rule(self.threshold_rule)


@dataclass(frozen=True)
class CacheSettings:
    """Reusing hard positives for K epochs (the paper's appendix).

    Attributes:
        regenerate_every_n_epochs: ``K``: a sample's ``x'`` is reused for K epochs (1: no cache).
        attack_new_selections: with K > 1, solve a selected sample without a cached ``x'`` in any
            epoch (True) or only in the regeneration epochs (False: the solver runs once every K
            epochs).
        max_bytes: the largest in-memory cache; beyond it a memory-mapped file.
        dir: the file's folder; None: ``<trainer.default_root_dir>/lpa3_cache``.
        on_device: keep an in-memory cache beside the model (GPU memory on a GPU).
        in_checkpoint: save the in-memory cache in checkpoints (False: a resumed run regenerates).
    """

    regenerate_every_n_epochs: int = 1
    attack_new_selections: bool = True
    max_bytes: int = DEFAULT_MAX_BYTES
    dir: str | None = None
    on_device: bool = True
    in_checkpoint: bool = False

    def __post_init__(self) -> None:
        _check_int("cache", "regenerate_every_n_epochs", self.regenerate_every_n_epochs, 1,
                   "use 1 (no reuse) or e.g. 10 (the paper's appendix).")
        _check_int("cache", "max_bytes", self.max_bytes, 0, "use e.g. 2**30 (1 GiB).")
        if isinstance(self.dir, os.PathLike):
            object.__setattr__(self, "dir", os.fspath(self.dir))  # a Path is kept as its string
        if self.dir is not None and not isinstance(self.dir, str):
            raise ValueError(f"`cache.dir` must be a folder path or None, got {self.dir!r}.")
        for name in ("attack_new_selections", "on_device", "in_checkpoint"):
            _check_bool("cache", name, getattr(self, name), "use the default.")


@dataclass(frozen=True)
class RuntimeSettings:
    """How the per-batch path runs on the hardware.

    Attributes:
        sync_free: the per-batch path without host reads of device values: ``"auto"`` (on an
            accelerator, not on the CPU), True or False.
        cuda_graphs: on the sync-free path, run the solver as a CUDA graph captured once per
            padded number of selected rows (off by default: it pays in long runs).
        restore_rng: save torch's global random state with the callback's state and restore it
            on resume (one process only).
    """

    sync_free: bool | Literal["auto"] = "auto"
    cuda_graphs: bool = False
    restore_rng: bool = True

    def __post_init__(self) -> None:
        if self.sync_free not in (True, False, "auto"):
            raise ValueError(f"`runtime.sync_free` must be True, False or 'auto', got {self.sync_free!r}. Fix: use "
                             "'auto' (no host reads on an accelerator, the default path on the CPU).")
        _check_bool("runtime", "cuda_graphs", self.cuda_graphs, "use False.")
        _check_bool("runtime", "restore_rng", self.restore_rng, "use True.")
        if self.cuda_graphs and self.sync_free is False:
            raise ValueError("`runtime.cuda_graphs=True` needs the sync-free path, but `runtime.sync_free=False`. Fix: "
                             "use sync_free='auto' (on a GPU) or True, or cuda_graphs=False.")


@dataclass(frozen=True)
class LoggingSettings:
    """What the callback logs beside its per-step and per-epoch statistics.

    Attributes:
        images_every_n_epochs: every N epochs (0: never) a grid of the first ``num_images``
            training images, their ``x'`` and ``|x' - x|`` to the Trainer's logger.
        num_images: images in the grid.
        eval_preservation: log ``lpa3/label_preserved_eval`` (one extra no-grad forward of the
            selected ``x`` and ``x'`` per step).
    """

    images_every_n_epochs: int = 0
    num_images: int = 8
    eval_preservation: bool = True

    def __post_init__(self) -> None:
        _check_int("logging", "images_every_n_epochs", self.images_every_n_epochs, 0, "use 0 (off) or e.g. 5.")
        _check_int("logging", "num_images", self.num_images, 1, "use e.g. 8.")
        _check_bool("logging", "eval_preservation", self.eval_preservation, "use True.")


#: The groups of each preset: this package's defaults, or the LP-A3 authors' behaviour where a
#: switch restores it (no projection, the unbounded step, TF32; every sample in the first pass,
#: one fewer selected, the stored prediction starting at 1.01).
PRESETS: dict[str, dict[str, Any]] = {
    "package": {},
    "authors": {"solver": SolverSettings(project=False, max_step=None, allow_tf32=True),
                "selection": SelectionSettings(initial_memory="authors", initial_selection="all",
                                               threshold_rule="authors")},
}
_GROUPS = {"solver": SolverSettings, "selection": SelectionSettings, "cache": CacheSettings,
           "runtime": RuntimeSettings, "logging": LoggingSettings}

#: Where each former keyword argument of LPA3Callback lives now: (group, field).
MOVED: dict[str, tuple[str, str]] = {
    **{name: ("solver", name) for name in ("lam", "temperature", "project", "max_step", "fast", "attack_bn",
                                           "allow_tf32")},
    "num_samples": ("selection", "num_samples"), "tcs_divergence": ("selection", "divergence"),
    "tcs_initial_memory": ("selection", "initial_memory"), "initial_selection": ("selection", "initial_selection"),
    "threshold_rule": ("selection", "threshold_rule"),
    "regenerate_every_n_epochs": ("cache", "regenerate_every_n_epochs"),
    "attack_new_selections": ("cache", "attack_new_selections"), "cache_max_bytes": ("cache", "max_bytes"),
    "cache_dir": ("cache", "dir"), "cache_on_device": ("cache", "on_device"),
    "checkpoint_cache": ("cache", "in_checkpoint"),
    **{name: ("runtime", name) for name in ("sync_free", "cuda_graphs", "restore_rng")},
    "log_images_every_n_epochs": ("logging", "images_every_n_epochs"),
    "num_logged_images": ("logging", "num_images"), "log_eval_preservation": ("logging", "eval_preservation"),
}


def moved_setting(name: str) -> str:
    """The message for a keyword argument that moved into a group (or does not exist)."""
    if name not in MOVED:
        return f"LPA3Callback has no setting `{name}`. Fix: see the groups in lpa3_lightning.callback.settings."
    group, field = MOVED[name]
    cls = _GROUPS[group].__name__
    return (f"LPA3Callback's `{name}` moved to the `{group}` group: pass `{group}={cls}({field}=...)` (or "
            f"`{group}={{'{field}': ...}}`); in a YAML config, `{group}:` with `{field}:` under it.")


def as_group(group: str, value: Any, preset: str) -> Any:
    """A group's settings from None (the preset's), a dataclass or a mapping (its fields), over the
    preset's: a mapping sets the keys it names, a dataclass the fields it changes from their defaults.

    Raises:
        ValueError: for another type or a mapping with a key the group does not have, naming it.
    """
    cls = _GROUPS[group]
    if value is None:
        return PRESETS[preset].get(group, cls())
    if isinstance(value, cls):
        # the fields it changes from the defaults, over the preset's (LightningCLI builds a group
        # from YAML as a dataclass: `preset: authors` with `solver: {max_step: 1.0}` keeps the
        # authors' other solver switches, as the same mapping does in Python)
        default = cls()
        changed = {f.name: getattr(value, f.name) for f in fields(cls)
                   if getattr(value, f.name) != getattr(default, f.name)}
        return replace(PRESETS[preset].get(group, default), **changed)
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"`{group}` has no setting {unknown}. Fix: use one of {sorted(known)}.")
        return replace(PRESETS[preset].get(group, cls()), **dict(value))
    raise ValueError(f"`{group}` must be a {cls.__name__}, a mapping of its fields or None, got "
                     f"{type(value).__name__}.")


def preset_groups(preset: str, **groups: Any) -> dict[str, Any]:
    """Every group, each from ``groups`` (a dataclass, a mapping or None) over the preset's.

    Raises:
        ValueError: for an unknown preset, naming the choices.
    """
    if preset not in PRESETS:
        raise ValueError(f"`preset` must be one of {sorted(PRESETS)}, got {preset!r}. Fix: use 'package' (default) "
                         "or 'authors' (the LP-A3 authors' behaviour where a switch restores it).")
    return {group: as_group(group, groups.get(group), preset) for group in _GROUPS}
