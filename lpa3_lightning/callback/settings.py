"""LPA3Callback's settings in groups: each a frozen dataclass that validates itself.

The callback takes the few settings a user tunes (``ratio``, ``sigma``, ``steps``,
``warmup_epochs``, ``seed``, and ``layers`` / ``input_range`` where they cannot be inferred)
directly, and the rest in four groups: :class:`SolverSettings`, :class:`SelectionSettings`,
:class:`CacheSettings` and :class:`LoggingSettings`. LightningCLI fills
a group from nested YAML keys::

    - class_path: lpa3_lightning.LPA3Callback
      init_args:
        ratio: 0.9
        sigma: 0.002
        cache:
          regenerate_every_n_epochs: 10

``preset="authors"`` gives the LP-A3 authors' behaviour in the groups it covers (the switches of
``docs/method.md`` section 7). A group given explicitly is used as given, field by field: its
unnamed fields take their documented defaults, never the preset's, so the settings that run are
the ones written (and the config LightningCLI saves rebuilds them).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, fields
from typing import Any, Literal

from lpa3_lightning.core.cache import DEFAULT_MAX_BYTES
from lpa3_lightning.core.checks import check_choice, check_flag, check_int, check_number, dataclass_from
from lpa3_lightning.core.solver import SolverSettings
from lpa3_lightning.core.tcs import storage_dtype_of

__all__ = ["AUGMENTS", "Augment", "CacheSettings", "LoggingSettings", "PRESETS", "SelectionSettings", "SolverSettings",
           "RunSettings", "SHARD_ABOVE_BYTES", "check_augment", "preset_groups",
           "unknown_argument"]

#: What the selected rows' ``x'`` are (``LPA3Callback(augment=...)``): the solver's hard positives,
#: the two controls (the rows unchanged, the rows plus noise of a given norm), or nothing at all.
Augment = Literal["lpa3", "null", "noise", "off"]
AUGMENTS: tuple[str, ...] = ("lpa3", "null", "noise", "off")


def check_augment(augment: Any, noise_norm: Any, regenerate_every_n_epochs: int = 1) -> tuple[str, float | None]:
    """``(augment, noise_norm)`` checked: ``noise_norm`` (a number > 0) with ``"noise"`` and only there; a control
    with a cache (``regenerate_every_n_epochs > 1``: the controls solve nothing to cache) refused.

    Raises:
        ValueError: naming the argument and the fix.

    Example:
        >>> check_augment("noise", 1.5)
        ('noise', 1.5)
    """
    check_choice(augment, AUGMENTS, "augment",
                 "use 'lpa3' (hard positives), 'null' or 'noise' (the controls) or 'off' (no LP-A3 at all).")
    if augment in ("null", "noise") and regenerate_every_n_epochs > 1:
        raise ValueError(f"`augment={augment!r}` makes its x' without the solver, so there is nothing to cache, but "
                         f"cache.regenerate_every_n_epochs={regenerate_every_n_epochs}. Fix: "
                         "cache.regenerate_every_n_epochs=1, or augment='lpa3'.")
    if augment == "noise":
        if noise_norm is None:
            raise ValueError("`augment='noise'` needs `noise_norm`, the L2 norm of each row's noise. Fix: e.g. the "
                             "mean `lpa3/input_distance` of an augment='lpa3' run of the same config.")
        return augment, check_number(noise_norm, "noise_norm", "use e.g. the mean lpa3/input_distance of an LP-A3 run.",
                                     above=0)
    if noise_norm is not None:
        raise ValueError(f"`noise_norm` is used by augment='noise' only, but augment={augment!r}. Fix: drop "
                         "noise_norm, or use augment='noise'.")
    return augment, None


#: ``memory_layout="auto"`` splits the stored predictions over the processes only above this many bytes
#: (``num_samples x num_classes`` in the storage dtype): below it every process keeps them all, so
#: ``callback.runner().tcs.memory`` is the whole memory and a state dict is no collective.
SHARD_ABOVE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class SelectionSettings:
    """Which samples get a hard positive (:class:`~lpa3_lightning.core.tcs.TimeConsistency`).

    Attributes:
        num_samples: the training set's size (the TCS memory's rows); None infers it from the
            module's ``lpa3_num_samples`` or the train dataloader's dataset.
        divergence: the TCS divergence, ``"code"`` (the authors' code) or ``"paper"``.
        initial_memory: ``"uniform"`` (a distribution) or ``"authors"`` (1.01 for every class).
        initial_selection: before a sample has a score (the first pass, or a sample an epoch of
            ``limit_train_batches`` never reached), ``"random"`` (a seeded ``ratio`` share) or
            ``"all"`` (the authors').
        threshold_rule: ``"count"`` (exactly ``round(ratio * N)``) or ``"authors"`` (one fewer).
        criterion: ``"tcs"`` (LP-A3: the lowest time-consistency scores) or ``"random"`` (the
            paper's ablation: a seeded random ``ratio`` share each epoch, the same count).
        memory_layout: where the stored predictions live under data parallelism: ``"auto"``
            (split over the processes when there are several and the predictions take more than
            :data:`SHARD_ABOVE_BYTES`, 256 MiB; else on every process), ``"sharded"`` (each process
            keeps ``1/world_size`` of them,
            :class:`~lpa3_lightning.core.tcs_shards.ShardedTimeConsistency`) or ``"replicated"``
            (every process keeps all). The selections are the same either way (bit for bit on
            the CPU; on a GPU a score can differ in its last bit). A split memory is assembled
            in Lightning's checkpoints, not by a ``state_dict()`` call on one process.
        memory_dtype: ``"float32"``, or ``"bfloat16"`` / ``"float16"`` to halve the stored
            predictions (the selections can then differ slightly: docs/multinode.md measures it).
    """

    num_samples: int | None = None
    divergence: Literal["code", "paper"] = "code"
    initial_memory: Literal["uniform", "authors"] = "uniform"
    initial_selection: Literal["random", "all"] = "random"
    threshold_rule: Literal["count", "authors"] = "count"
    criterion: Literal["tcs", "random"] = "tcs"
    memory_layout: Literal["auto", "sharded", "replicated"] = "auto"
    memory_dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    def __post_init__(self) -> None:
        if self.num_samples is not None:
            check_int(self.num_samples, "selection.num_samples", 1,
                      "use None to infer it from the module or the train dataloader's dataset.")
        for name, choices, fix in (("divergence", ("code", "paper"), "use 'code' (the authors' code)."),
                                   ("initial_memory", ("uniform", "authors"), "use 'uniform' (a distribution)."),
                                   ("initial_selection", ("random", "all"), "use 'random' ('all': the authors')."),
                                   ("threshold_rule", ("count", "authors"), "use 'count' (select round(ratio * N))."),
                                   ("criterion", ("tcs", "random"), "use 'tcs' ('random' is its ablation)."),
                                   ("memory_layout", ("auto", "sharded", "replicated"), "use 'auto'.")):
            check_choice(getattr(self, name), choices, f"selection.{name}", fix)
        storage_dtype_of(self.memory_dtype, "selection.memory_dtype")

    def sharded(self, num_samples: int, num_classes: int, world_size: int) -> bool:
        """Whether a memory of ``num_samples x num_classes`` is split over ``world_size`` processes."""
        if self.memory_layout != "auto":
            return self.memory_layout == "sharded"
        size = num_samples * num_classes * storage_dtype_of(self.memory_dtype).itemsize
        return world_size > 1 and size > SHARD_ABOVE_BYTES


@dataclass(frozen=True)
class CacheSettings:
    """Reusing hard positives for K epochs (the paper's appendix).

    Attributes:
        regenerate_every_n_epochs: ``K``: a sample's ``x'`` is reused for K epochs (1: no cache).
        attack_new_selections: with K > 1, solve a selected sample without a cached ``x'`` in any
            epoch (True) or only in the regeneration epochs (False: the solver runs once every K
            epochs).
        max_bytes: the largest in-memory cache of a process, shared by the module's networks
            (each gets its share; under DDP every process holds a whole copy); beyond it a
            memory-mapped file.
        dir: the file's folder (checked when the fit starts); None:
            ``<trainer.default_root_dir>/lpa3_cache``.
        on_device: keep an in-memory cache beside the model (GPU memory on a GPU).
        in_checkpoint: save the cache's entries in checkpoints, from memory or from its file, for
            an exact resume (a checkpoint then holds up to the cache's size); False: a resumed
            run regenerates them.
    """

    regenerate_every_n_epochs: int = 1
    attack_new_selections: bool = True
    max_bytes: int = DEFAULT_MAX_BYTES
    dir: str | None = None
    on_device: bool = True
    in_checkpoint: bool = False

    def __post_init__(self) -> None:
        check_int(self.regenerate_every_n_epochs, "cache.regenerate_every_n_epochs", 1,
                  "use 1 (no reuse) or e.g. 10 (the paper's appendix).")
        check_int(self.max_bytes, "cache.max_bytes", 0, "use e.g. 2**30 (1 GiB).")
        if isinstance(self.dir, os.PathLike):
            object.__setattr__(self, "dir", os.fspath(self.dir))  # a Path is kept as its string
        if self.dir is not None and not isinstance(self.dir, str):
            raise ValueError(f"`cache.dir` must be a folder path or None, got {self.dir!r}. Fix: e.g. '/scratch/lpa3', or "
                             "None to keep x' in memory.")
        for name in ("attack_new_selections", "on_device", "in_checkpoint"):
            check_flag(getattr(self, name), f"cache.{name}", "use the default.")


@dataclass(frozen=True)
class LoggingSettings:
    """What the callback logs beside the training itself, and how often.

    Attributes:
        every_n_steps: the per-step diagnostics (``lpa3/<name>_step`` and the epoch means of the
            ``x'``: perceptual distance, projected, label kept as trained and in eval mode,
            solver time, the selected shares) are measured on every N-th training batch only,
            so the other steps pay nothing for them; None: the Trainer's ``log_every_n_steps``
            (the steps Lightning writes to the logger anyway). 1 measures every step. The
            counts behind the warnings (non-finite inputs and predictions, ``x'`` that barely
            move) are kept on every step.
        images_every_n_epochs: every N epochs (0: never) a grid of the first ``num_images``
            training images, their ``x'`` and ``|x' - x|`` to the Trainer's logger.
        num_images: images in the grid.
        eval_preservation: log ``lpa3/label_preserved_eval`` (one extra no-grad forward of the
            selected ``x`` and ``x'`` on each measured step).
    """

    every_n_steps: int | None = None
    images_every_n_epochs: int = 0
    num_images: int = 8
    eval_preservation: bool = True

    def __post_init__(self) -> None:
        if self.every_n_steps is not None:
            check_int(self.every_n_steps, "logging.every_n_steps", 1,
                      "use None (the Trainer's log_every_n_steps) or 1 (every step).")
        check_int(self.images_every_n_epochs, "logging.images_every_n_epochs", 0, "use 0 (off) or e.g. 5.")
        check_int(self.num_images, "logging.num_images", 1, "use e.g. 8.")
        check_flag(self.eval_preservation, "logging.eval_preservation", "use True.")


#: The groups of each preset: this package's defaults, or the LP-A3 authors' behaviour where a
#: switch restores it (no projection, the unbounded step, TF32; every sample in the first pass,
#: one fewer selected, the stored prediction starting at 1.01).
PRESETS: dict[str, dict[str, Any]] = {
    "package": {},
    "authors": {"solver": SolverSettings(project=False, max_step=None, allow_tf32=True),
                "selection": SelectionSettings(initial_memory="authors", initial_selection="all",
                                               threshold_rule="authors")},
}
GROUPS = {"solver": SolverSettings, "selection": SelectionSettings, "cache": CacheSettings,
          "logging": LoggingSettings}


def _group_of(name: str) -> str | None:
    return next((group for group, cls in GROUPS.items() if name in {f.name for f in fields(cls)}), None)


def as_group(group: str, value: Any, preset: str) -> Any:
    """A group's settings: the preset's when ``value`` is None; else ``value`` as given (a dataclass,
    or a mapping of its fields over the documented defaults, never the preset's).

    Raises:
        TypeError: for another type, or a mapping with a key the group does not have (naming the
            group it belongs to, or the closest field).
    """
    cls = GROUPS[group]
    if value is None:
        return PRESETS[preset].get(group, cls())
    return dataclass_from(cls, value, group, home=_group_of)


def preset_groups(preset: str, **groups: Any) -> dict[str, Any]:
    """Every group, each from ``groups`` (a dataclass, a mapping or None for the preset's).

    Raises:
        ValueError: for an unknown preset, naming the choices.
    """
    check_choice(preset, tuple(PRESETS), "preset",
                 "use 'package' (default) or 'authors' (the LP-A3 authors' behaviour where a switch restores it).")
    return {group: as_group(group, groups.get(group), preset) for group in GROUPS}


def unknown_argument(name: str, arguments: list[str]) -> str:
    """The message for a keyword LPA3Callback does not take: the group holding a setting of that
    name, or the closest of ``arguments`` (the callback's own)."""
    group = _group_of(name)
    if group is not None:
        cls = GROUPS[group].__name__
        return (f"LPA3Callback's `{name}` is a setting of the `{group}` group: pass `{group}={cls}({name}=...)` (or "
                f"`{group}={{'{name}': ...}}`); in a YAML config, `{group}:` with `{name}:` under it.")
    prefix, _, rest = name.partition("_")  # a group's field with the group as a prefix: cache_dir
    if prefix in GROUPS and rest in {f.name for f in fields(GROUPS[prefix])}:
        return (f"LPA3Callback got an unexpected argument `{name}`: it is `{prefix}.{rest}`. Fix: pass "
                f"`{prefix}={{'{rest}': ...}}`; in a YAML config, `{prefix}:` with `{rest}:` under it.")
    candidates = {argument: argument for argument in arguments}
    for group_name, cls in GROUPS.items():
        candidates.update({f.name: f"{group_name}.{f.name}" for f in fields(cls) if f.name not in candidates})
    close = difflib.get_close_matches(name, list(candidates), n=1)
    hint = f"; did you mean `{candidates[close[0]]}`?" if close else ""
    return f"LPA3Callback got an unexpected argument `{name}`{hint} Fix: see its arguments and groups " \
           "(lpa3_lightning.callback.settings)."


@dataclass(frozen=True)
class RunSettings:
    """Everything one fit runs with, resolved at its start and handed to every runner and stage
    (they never read the callback): the callback's arguments with the seed, the input box and the
    path decided, and the five groups.

    Attributes:
        ratio, sigma, steps, warmup_epochs, layers: the callback's arguments.
        seed: the base seed of the solver's noise (the callback's ``seed``, or one fixed at the
            first fit and kept in checkpoints when it is None).
        input_range: the solver's input box (``"auto"`` resolved from the data module).
        world_size, rank: the processes of the fit.
        solver, selection, cache, logging: the groups.
        augment, noise_norm: what the selected rows' ``x'`` are (the callback's ``augment``).
    """

    ratio: float
    sigma: float
    steps: int
    warmup_epochs: int
    seed: int
    layers: Any
    input_range: Any
    world_size: int
    rank: int
    solver: SolverSettings
    selection: SelectionSettings
    cache: CacheSettings
    logging: LoggingSettings
    augment: str = "lpa3"
    noise_norm: float | None = None
