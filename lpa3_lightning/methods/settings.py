"""The mixins' settings (``self.lpa3_settings``): one frozen dataclass per mixin, each extending
:class:`LPA3Settings`, validated when built (a misspelled field: TypeError; a value out of range: a
ValueError naming ``group.field``, the value and the fix). The ready modules take the same class as one
argument named after the method (``PESClassifier(pes=PESSettings(...))``). Each class cites the sources
of its defaults; their meanings: ``docs/mixins.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, TypeVar

from torch import Tensor

from lpa3_lightning.core.checks import check_choice, check_class_prior, check_flag, check_int, check_number, dataclass_from
from lpa3_lightning.core.forward_modes import TrainForward, check_train_forward

__all__ = ["DivideMixSettings", "FixMatchSettings", "LPA3Settings", "PESSettings", "SupervisedSettings",
           "settings_from", "settings_hparams"]

S = TypeVar("S", bound="LPA3Settings")


@dataclass(frozen=True)
class LPA3Settings:
    """The settings every mixin shares. ``train_forward``: how ``lpa3_forward_augmented`` normalises ``x'``,
    ``"verified"`` (ours: as the solver checked the label, :mod:`lpa3_lightning.core.forward_modes`) or
    ``"batch_stats"`` (the ``x'`` batch's own statistics through the twins, the LP-A3 authors' code)."""

    #: the name of the group in messages and in a ready module's arguments (``pes.early_epochs``)
    group: ClassVar[str] = "lpa3"

    train_forward: TrainForward = "verified"

    def __post_init__(self) -> None:
        try:
            check_train_forward(self.train_forward)
        except ValueError as exc:  # the core's message, named by this group's field
            raise ValueError(f"`{self.group}.{str(exc)[1:]}") from None

    def _number(self, name: str, fix: str, **bounds: float) -> None:
        check_number(getattr(self, name), f"{self.group}.{name}", fix, **bounds)

    def _int(self, name: str, low: int, fix: str) -> None:
        check_int(getattr(self, name), f"{self.group}.{name}", low, fix)

    def _bool(self, name: str, fix: str) -> None:
        check_flag(getattr(self, name), f"{self.group}.{name}", fix)


@dataclass(frozen=True)
class SupervisedSettings(LPA3Settings):
    """:class:`~lpa3_lightning.methods.supervised.SupervisedLPA3Mixin`'s settings. ``weight`` (``1.0``):
    of ``CE(F(x'), y)`` beside ``CE(F(x), y)`` (LP-A3's Algorithm 1)."""

    group: ClassVar[str] = "supervised"

    weight: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._number("weight", "use 1.0 (Algorithm 1).", minimum=0)


@dataclass(frozen=True)
class FixMatchSettings(LPA3Settings):
    """:class:`~lpa3_lightning.methods.fixmatch.FixMatchLPA3Mixin`'s settings (Sohn et al., NeurIPS 2020;
    lines of the LP-A3 authors' ``FixMatch/fixmatch_LPA3.py``, CausalLearning/LPA3 at 7059ca3).

    Attributes:
        threshold: ``0.95``. Confidence from which a pseudo-label trains the strong view (line 184).
        lambda_u: ``1.0``. Weight of the unlabeled loss (line 180).
        temperature: ``1.0``. Softmax temperature of the pseudo-labels.
        lpa3_confidence_threshold: ``0.9``. Confidence from which an ``x'`` counts in the loss (line 207).
        lpa3_weight: ``1.0``. Weight of the LP-A3 term (line 480).
        lpa3_loss_warmup_epochs: ``5``. Passes over the unlabeled set before the LP-A3 term counts (the
            authors: 5 of their 1,024-step epochs, lines 160, 202, 449).
        solve_trained_only: ``True`` (ours; ``False``: the authors' cost). Only the rows the loss will
            weigh are solved, the loss unchanged; with ``train_forward="verified"`` and no ``x'`` cache.
        share_forward: ``True`` (ours). The request's joint forward, with its graph, is the step's: one
            forward a step, the graph held through the solve (more peak memory: docs/results.md, Cost);
            ``False``: the request forwards the joint batch once more without gradient (0.3's design).
    """

    group: ClassVar[str] = "fixmatch"

    threshold: float = 0.95
    lambda_u: float = 1.0
    temperature: float = 1.0
    lpa3_confidence_threshold: float = 0.9
    lpa3_weight: float = 1.0
    lpa3_loss_warmup_epochs: int = 5
    solve_trained_only: bool = True
    share_forward: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._number("threshold", "use 0.95 (FixMatch).", above=0, maximum=1)
        self._number("lambda_u", "use 1.0 (FixMatch).", minimum=0)
        self._number("temperature", "use 1.0.", above=0)
        self._number("lpa3_confidence_threshold", "use 0.9 (the LP-A3 authors').", minimum=0, maximum=1)
        self._number("lpa3_weight", "use 1.0 (the LP-A3 authors').", minimum=0)
        self._int("lpa3_loss_warmup_epochs", 0, "use e.g. 5, in passes over the unlabeled set.")
        self._bool("solve_trained_only", "use True (the same loss, less solver work) or False (the authors' cost).")
        self._bool("share_forward", "use True (one forward a step) or False (less peak memory, one forward more).")


@dataclass(frozen=True)
class PESSettings(LPA3Settings):
    """:class:`~lpa3_lightning.methods.pes.PESLPA3Mixin`'s settings (Bai et al., NeurIPS 2021; lines of the
    LP-A3 authors' ``PES/PES_LPA3.py``, CausalLearning/LPA3 at 7059ca3).

    Attributes:
        early_epochs: ``20``. T1, the early phase's epochs (35 on CIFAR-100; lines 361-362, 374-375).
        refine_epochs: ``5``. T2, epochs of head re-training (line 43); 0: the head is kept.
        lambda_u: ``150.0``. Weight of the unlabeled loss and ``x'`` term after the ramp (the code's; the
            run commands set it per row, LPA3 README.md:50-64).
        temperature: ``0.5``. Sharpening temperature of the guessed labels (line 39).
        alpha: ``4.0``. Mixup's Beta parameter (line 38).
        alpha_late: ``0.75``. Mixup's Beta parameter from ``alpha_late_epoch`` on (lines 175-176).
        alpha_late_epoch: ``None``. First epoch of ``alpha_late``; None or negative: never (the ready
            :class:`~lpa3_lightning.PESClassifier` takes None for half of the run, the authors').
        rampup_epochs: ``16.0``. Length of the unlabeled weight's linear ramp, from the semi phase.
        class_weight_cap: ``3.0``. Largest class weight (line 333; tmllab/PES at 5466238, ``PES_semi.py:192``).
        lpa3_mixup: ``True`` (the authors'). Mix the ``x'`` up with the labeled views, or not.
        lpa3_confidence: ``None`` (the authors': all). Ours: attack only the unlabeled rows whose sharpened
            guess gives its label at least this (in (0, 1]).
        guess_forward: ``"joint_frozen"`` (ours): the guess from one no-grad train-mode forward of both
            views, the running statistics left alone; ``"reference"``: each view forwarded alone, each
            moving them (tmllab/PES ``PES_semi.py:100-102``; lines 204-206).
    """

    group: ClassVar[str] = "pes"

    early_epochs: int = 20
    refine_epochs: int = 5
    lambda_u: float = 150.0
    temperature: float = 0.5
    alpha: float = 4.0
    alpha_late: float = 0.75
    alpha_late_epoch: int | None = None
    rampup_epochs: float = 16.0
    class_weight_cap: float = 3.0
    lpa3_mixup: bool = True
    lpa3_confidence: float | None = None
    guess_forward: Literal["joint_frozen", "reference"] = "joint_frozen"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._int("early_epochs", 1, "use e.g. 20 (CIFAR-10) or 35 (CIFAR-100), the authors' T1.")
        self._int("refine_epochs", 0, "use 5 (the authors' T2), or 0 for no refine phase.")
        self._number("lambda_u", "use e.g. 150 (PES), or 25 on small sets.", minimum=0)
        self._number("temperature", "use 0.5 (MixMatch).", above=0)
        self._number("alpha", "use 4.0 (PES).", above=0)
        self._number("alpha_late", "use 0.75 (PES).", above=0)
        if self.alpha_late_epoch is not None and (isinstance(self.alpha_late_epoch, bool)
                                                  or not isinstance(self.alpha_late_epoch, int)):
            raise ValueError(f"`pes.alpha_late_epoch` must be None or an int, got {self.alpha_late_epoch!r}. Fix: "
                             "None (PESClassifier: half of the run), an epoch, or -1 (never).")
        self._number("rampup_epochs", "use 16.0 (PES).", above=0)
        self._number("class_weight_cap", "use 3.0 (PES).", above=0)
        self._bool("lpa3_mixup", "use True (the LP-A3 authors') or False.")
        confidence = self.lpa3_confidence
        if confidence is not None and (isinstance(confidence, bool) or not isinstance(confidence, (int, float))
                                       or not 0 < confidence <= 1):
            raise ValueError(f"`{self.group}.lpa3_confidence` must be None or a number in (0, 1], got {confidence!r}. "
                             "Fix: e.g. 0.9 (on the sharpened guess), or None (every unlabeled row, the authors').")
        check_choice(self.guess_forward, ("joint_frozen", "reference"), f"{self.group}.guess_forward",
                     "use 'joint_frozen' (the default: one forward of both views, running statistics left alone) "
                     "or 'reference' (PES's code: each view forwarded alone, moving the running statistics).")


@dataclass(frozen=True)
class DivideMixSettings(LPA3Settings):
    """:class:`~lpa3_lightning.methods.dividemix.DivideMixLPA3Mixin`'s settings (Li, Socher, Hoi, ICLR 2020;
    lines of DivideMix's ``Train_cifar.py``, LiJunnan1992/DivideMix at d9d3058).

    Attributes:
        networks: ``("net1", "net2")``. The two networks' names (``lpa3_networks()``).
        warmup_epochs: ``10``. Cross-entropy epochs (30 on CIFAR-100; lines 218-221).
        lambda_u: ``25.0``. Unlabeled weight after the ramp (lines 21-22; the paper: 0 to 150).
        threshold: ``0.5``. Clean-probability threshold of the split (lines 21-22; 0.6 at 90% noise).
        temperature: ``0.5``. Sharpening temperature (line 23).
        alpha: ``4.0``. Mixup's Beta parameter (line 20).
        rampup_epochs: ``16.0``. Ramp length of the unlabeled weight, from the warm-up's end (192-194).
        loss_history: ``1``. Epochs of losses averaged for the mixture (5 at 90% noise; lines 178-183).
        negative_entropy: ``False``. The negative-entropy penalty in the warm-up (asymmetric noise).
        lpa3_mixup: ``True``. Mix the ``x'`` up with the labeled views (as PES's LP-A3), or not.
        lpa3_weight: ``None``. Weight of the ``x'`` term after the ramp; None: ``lambda_u``.
        seed: ``0``. Seed of the mixture's initialisation (the authors' is unseeded).
        guess_bn_updates: ``False`` (ours): a network's own no-grad guessing and refinement forwards take
            both views at once, running statistics left alone; ``True``: moving them; ``"reference"``: one
            forward per view, each moving them (lines 64-67, 76-77).
        split_per_class: ``False`` (the authors'). Ours: one mixture per noisy class.
        stratified_split: ``False`` (the authors'). Ours: keep the first two-sided split's count of clean
            rows, shared by class size (:func:`~lpa3_lightning.methods.dividemix_split.stratified_selection`).
        prior_weight: ``1.0``. Weight of the penalty ``KL(prior || mean prediction)`` (0: off).
        class_prior: ``None`` (uniform). The penalty's class frequencies, summing to 1 (kept as a tuple).
    """

    group: ClassVar[str] = "dividemix"

    networks: tuple[str, str] = ("net1", "net2")
    warmup_epochs: int = 10
    lambda_u: float = 25.0
    threshold: float = 0.5
    temperature: float = 0.5
    alpha: float = 4.0
    rampup_epochs: float = 16.0
    loss_history: int = 1
    negative_entropy: bool = False
    lpa3_mixup: bool = True
    lpa3_weight: float | None = None
    seed: int = 0
    guess_bn_updates: bool | Literal["reference"] = False
    split_per_class: bool = False
    stratified_split: bool = False
    prior_weight: float = 1.0
    class_prior: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        names = tuple(self.networks) if isinstance(self.networks, Sequence) and not isinstance(self.networks, str) \
            else None
        if names is None or len(names) != 2 or len(set(names)) != 2 \
                or not all(isinstance(n, str) and n and "/" not in n for n in names):
            raise ValueError(f"`dividemix.networks` must be two distinct non-empty names without '/', got "
                             f"{self.networks!r}. Fix: use ('net1', 'net2').")
        object.__setattr__(self, "networks", names)  # a list (YAML, Python) is kept as a tuple
        self._int("warmup_epochs", 0, "use 10 (CIFAR-10) or 30 (CIFAR-100), DivideMix's.")
        self._number("lambda_u", "use 25 (DivideMix, 50% noise).", minimum=0)
        self._number("threshold", "use 0.5 (0.6 at 90% noise), DivideMix's.", above=0, below=1)
        self._number("temperature", "use 0.5 (DivideMix).", above=0)
        self._number("alpha", "use 4.0 (DivideMix).", above=0)
        self._number("rampup_epochs", "use 16.0 (DivideMix).", above=0)
        self._int("loss_history", 1, "use 1 (5 at 90% noise), DivideMix's.")
        self._int("seed", 0, "use e.g. 0.")
        for name in ("negative_entropy", "lpa3_mixup", "split_per_class", "stratified_split"):
            self._bool(name, "use the default (False, or True for lpa3_mixup).")
        if not isinstance(self.guess_bn_updates, bool) and self.guess_bn_updates != "reference":
            raise ValueError(f"`{self.group}.guess_bn_updates` must be False, True or 'reference', got "
                             f"{self.guess_bn_updates!r}. Fix: False (the default: running statistics left alone), "
                             "True (pooled views, moving them) or 'reference' (one forward per view, as DivideMix's "
                             "code).")
        if self.lpa3_weight is not None:
            self._number("lpa3_weight", "use None (lambda_u's weight) or e.g. 25.", minimum=0)
        self._number("prior_weight", "use 1.0 (the authors') or 0 (off).", minimum=0)
        if self.class_prior is not None:
            prior = self.class_prior
            if not isinstance(prior, (Sequence, Tensor)) or isinstance(prior, str) or len(prior) < 2:
                raise ValueError(f"`dividemix.class_prior` must be None or one frequency per class (at least 2) "
                                 f"summing to 1, got {prior!r}. Fix: e.g. the training set's class shares.")
            object.__setattr__(self, "class_prior", check_class_prior(prior, len(prior), name="dividemix.class_prior"))


def settings_from(cls: type[S], value: S | Mapping[str, Any] | None, argument: str) -> S:
    """A ready module's settings argument as ``cls``: None gives the defaults, an instance is kept, a
    mapping (a checkpoint's hyper-parameters) gives its fields; a TypeError naming ``argument``, the
    fields and the fix for an unknown key or another type."""
    return cls() if value is None else dataclass_from(cls, value, argument)


def settings_hparams(settings: LPA3Settings) -> dict[str, Any]:
    """``settings``' fields as a plain mapping (tuples as lists) for a ready module's hyper-parameters.

    Example:
        >>> settings_hparams(SupervisedSettings(weight=0.5))
        {'train_forward': 'verified', 'weight': 0.5}
    """
    return {f.name: list(value) if isinstance(value := getattr(settings, f.name), tuple) else value
            for f in fields(settings)}
