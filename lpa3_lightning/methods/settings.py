"""The mixins' settings: one frozen dataclass per mixin, each validated once, when it is built.

A mixin reads its settings from one attribute, ``self.lpa3_settings``, an instance of its own
class (:class:`SupervisedSettings`, :class:`FixMatchSettings`, :class:`PESSettings`,
:class:`DivideMixSettings`, each extending the base's :class:`LPA3Settings`)::

    class MyPES(PESLPA3Mixin, pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lpa3_settings = PESSettings(early_epochs=5, lambda_u=25.0)

A misspelled field is refused by the dataclass itself (``PESSettings(early_epoch=5)`` raises a
TypeError), a value out of range by its ``__post_init__`` (a ValueError naming ``group.field``,
the value and the fix), and an ``lpa3_settings`` of another class by
:meth:`~lpa3_lightning.methods.base.LPA3ModuleMixin.lpa3_check_settings`. Every other attribute of
the module is the user's own. The ready modules take the same classes as one argument named
after the method (``PESClassifier(pes=PESSettings(...))``); LightningCLI fills it from nested
YAML keys (``model.init_args.pes: {early_epochs: 5}``), as LPA3Callback's groups.

The defaults are the references' (the citation of each is in its class's docstring;
``tests/test_paper_rows.py`` checks the paper rows' values against the references' code).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, TypeVar

from torch import Tensor

from lpa3_lightning.core.arguments import check_choice, check_flag, check_int, check_number, dataclass_from
from lpa3_lightning.core.augmented_forward import TrainForward, check_train_forward
from lpa3_lightning.core.checks import check_class_prior

__all__ = ["DivideMixSettings", "FixMatchSettings", "LPA3Settings", "PESSettings", "SupervisedSettings",
           "check_lpa3_confidence", "check_solve_trained_only", "settings_from", "settings_hparams"]

S = TypeVar("S", bound="LPA3Settings")


def check_lpa3_confidence(confidence: float | None, name: str = "pes.lpa3_confidence") -> float | None:
    """Validate PES's ``x'`` confidence threshold (None, or a number in (0, 1]), returning it."""
    if confidence is not None and (isinstance(confidence, bool) or not isinstance(confidence, (int, float))
                                   or not 0 < confidence <= 1):
        raise ValueError(f"`{name}` must be None or a number in (0, 1], got {confidence!r}. "
                         "Fix: e.g. 0.9 (on the sharpened guess), or None (every unlabeled row, the authors').")
    return confidence


def check_solve_trained_only(value: bool, name: str = "fixmatch.solve_trained_only") -> bool:
    """Validate the switch that lets the callback solve only the ``x'`` the loss weighs, returning it."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}. "
                         "Fix: use True (the same loss, less solver work) or False (the authors' cost).")
    return value


@dataclass(frozen=True)
class LPA3Settings:
    """The settings every mixin shares (:class:`~lpa3_lightning.methods.base.LPA3ModuleMixin`'s).

    Attributes:
        train_forward: how ``lpa3_forward_augmented`` normalises ``x'`` for the loss:
            ``"verified"`` (default, this package's): the normalisation the solver checked the
            label under (twin BatchNorms on the clean selected samples' statistics, the model's own
            BatchNorms on the clean batch's, or the running statistics, as ``solver.attack_bn``
            says; :mod:`lpa3_lightning.core.augmented_forward`), so every
            ``x'`` keeps its label in the forward that trains on it; ``"batch_stats"``: the ``x'``
            batch's own statistics through the twins in train mode (the LP-A3 authors' code).
    """

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
    """:class:`~lpa3_lightning.methods.supervised.SupervisedLPA3Mixin`'s settings (LP-A3's Algorithm 1).

    Attributes:
        train_forward: see :class:`LPA3Settings` (``"verified"``).
        weight: ``1.0``. Weight of the loss on the hard positives, ``loss = CE(F(x), y) + weight *
            CE(F(x'), y)`` (Yang et al., NeurIPS 2022, Algorithm 1: 1).
    """

    group: ClassVar[str] = "supervised"

    weight: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._number("weight", "use 1.0 (Algorithm 1).", minimum=0)


@dataclass(frozen=True)
class FixMatchSettings(LPA3Settings):
    """:class:`~lpa3_lightning.methods.fixmatch.FixMatchLPA3Mixin`'s settings (FixMatch: Sohn et al.,
    NeurIPS 2020; with LP-A3 as in the LP-A3 authors' code, CausalLearning/LPA3 at 7059ca3).

    Attributes:
        train_forward: see :class:`LPA3Settings` (``"verified"``).
        threshold: ``0.95``. Confidence from which a pseudo-label trains the strong view (Sohn et
            al.; LPA3 ``FixMatch/fixmatch_LPA3.py:184``).
        lambda_u: ``1.0``. Weight of the unlabeled loss (Sohn et al.; LPA3
            ``FixMatch/fixmatch_LPA3.py:180``).
        temperature: ``1.0``. Softmax temperature of the pseudo-labels (FixMatch's: 1).
        lpa3_confidence_threshold: ``0.9``. The LP-A3 authors' second threshold: an ``x'`` counts
            in the loss only where its pseudo-label's confidence is at least this (LPA3
            ``FixMatch/fixmatch_LPA3.py:207``, ``--threshold_lpa3``).
        lpa3_weight: ``1.0``. Weight of the LP-A3 term (LPA3 ``FixMatch/fixmatch_LPA3.py:480``:
            ``loss = l_ce + l_cs + l_adv``).
        lpa3_loss_warmup_epochs: ``5``. Epochs (passes over the unlabeled set) before the LP-A3
            term counts. The authors' code adds it once more than 5 of its 1,024-step epochs have
            passed (LPA3 ``FixMatch/fixmatch_LPA3.py:160, 202, 449``); ``configs/ssl/`` converts
            that to passes. The callback's own ``warmup_epochs`` decides when the attack runs;
            the authors attack during this warm-up too (``solve_trained_only`` skips that cost).
        solve_trained_only: ``True`` (this package's; ``False`` is the authors' cost). The
            request's ``train_mask`` names the rows whose ``x'`` the loss will weigh (confidence
            >= ``lpa3_confidence_threshold``, after the loss warm-up), so the callback solves only
            those. The authors solve every selected row and zero the rest in the loss; here the
            skipped rows still count in the loss's denominator and their clean inputs still set
            the twin statistics, so the loss is theirs (each ``x'`` from another draw of the
            solver's initial noise), while the solver's work shrinks to the confident share
            (``benchmarks/fixmatch_step.py`` prints it). Applies with ``train_forward="verified"``
            and without the callback's cache; otherwise every selected row is solved.
    """

    group: ClassVar[str] = "fixmatch"

    threshold: float = 0.95
    lambda_u: float = 1.0
    temperature: float = 1.0
    lpa3_confidence_threshold: float = 0.9
    lpa3_weight: float = 1.0
    lpa3_loss_warmup_epochs: int = 5
    solve_trained_only: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._number("threshold", "use 0.95 (FixMatch).", above=0, maximum=1)
        self._number("lambda_u", "use 1.0 (FixMatch).", minimum=0)
        self._number("temperature", "use 1.0.", above=0)
        self._number("lpa3_confidence_threshold", "use 0.9 (the LP-A3 authors').", minimum=0, maximum=1)
        self._number("lpa3_weight", "use 1.0 (the LP-A3 authors').", minimum=0)
        self._int("lpa3_loss_warmup_epochs", 0, "use e.g. 5, in passes over the unlabeled set.")
        check_solve_trained_only(self.solve_trained_only, f"{self.group}.solve_trained_only")


@dataclass(frozen=True)
class PESSettings(LPA3Settings):
    """:class:`~lpa3_lightning.methods.pes.PESLPA3Mixin`'s settings (PES: Bai et al., NeurIPS 2021;
    with LP-A3 as in the LP-A3 authors' PES code, CausalLearning/LPA3 at 7059ca3, ``PES/PES_LPA3.py``).

    Attributes:
        train_forward: see :class:`LPA3Settings` (``"verified"``).
        early_epochs: ``20``. T1, epochs of the early-stopped first phase (the authors: 20 on
            CIFAR-10, 35 on CIFAR-100; LPA3 ``PES/PES_LPA3.py:361-362, 374-375``).
        refine_epochs: ``5``. T2, epochs of head re-training (LPA3 ``PES/PES_LPA3.py:43``); with 0
            the head is not re-initialised.
        lambda_u: ``150.0``. Weight of the unlabeled loss after the ramp, and of the ``x'`` term
            (the authors' default: 150; their run commands set it per row, LPA3 README.md:50-64).
        temperature: ``0.5``. Sharpening temperature of the guessed labels (LPA3
            ``PES/PES_LPA3.py:39``).
        alpha: ``4.0``. Mixup's Beta parameter (LPA3 ``PES/PES_LPA3.py:38``).
        alpha_late: ``0.75``. Mixup's Beta parameter from ``alpha_late_epoch`` on (LPA3
            ``PES/PES_LPA3.py:175-176``).
        alpha_late_epoch: ``None``. First epoch of ``alpha_late``: the mixin never switches on
            None or a negative value; the ready :class:`~lpa3_lightning.PESClassifier` takes None
            for half of the run (the authors' epoch 150 of 300) and a negative value for never.
        rampup_epochs: ``16.0``. Length of the linear ramp of the unlabeled weight, which starts
            with the semi-supervised phase.
        class_weight_cap: ``3.0``. Largest class weight of the class-balanced labeled loss (LPA3
            ``PES/PES_LPA3.py:333``, ``clamp(max=3)``; tmllab/PES at 5466238, ``PES_semi.py:192``).
        lpa3_mixup: ``True`` (the LP-A3 authors'): the ``x'`` are mixed up with the labeled views;
            False: the unmixed ``x'`` are trained against the guessed label.
        lpa3_confidence: ``None`` (the authors': every unlabeled row may be attacked). A number in
            (0, 1] (this package's option): only the rows whose *sharpened* guess gives its label
            at least this probability (like FixMatch + LP-A3's second threshold, on a sharpened
            distribution: 0.9 there is a raw top probability of about 0.75 between two classes):
            an ``x'`` keeps its guessed label, so a wrong guess becomes a hard positive of the
            wrong class.
        guess_forward: ``"joint_frozen"`` (this package's): the guess of the unlabeled rows comes
            from one no-grad train-mode forward of both views together (each normalised by the
            statistics of both), the BatchNorm running statistics left alone, so that only the
            mixed training forward moves them. ``"reference"``: as PES's code (tmllab/PES at
            5466238, ``PES_semi.py:100-102``; LPA3 ``PES/PES_LPA3.py:204-206``): the two views
            forwarded one after the other in train mode, each normalised by its own batch and each
            moving the running statistics (three moves a step instead of one).

    The ``x'`` check: the solver keeps the guessed label of each ``x'`` it returns, on the unmixed
    ``x'``; with ``lpa3_mixup=True`` (the authors') the rows the loss trains are mixed ``x'``
    (``l x' + (1 - l) x_other``, ``l >= 0.5``, against the mixed target), which no check covers:
    ``lpa3/label_preserved`` is the share of the unmixed ``x'`` that keep their label.
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
        check_lpa3_confidence(self.lpa3_confidence, f"{self.group}.lpa3_confidence")
        check_choice(self.guess_forward, ("joint_frozen", "reference"), f"{self.group}.guess_forward",
                     "use 'joint_frozen' (the default: one forward of both views, running statistics left alone) "
                     "or 'reference' (PES's code: each view forwarded alone, moving the running statistics).")


@dataclass(frozen=True)
class DivideMixSettings(LPA3Settings):
    """:class:`~lpa3_lightning.methods.dividemix.DivideMixLPA3Mixin`'s settings (DivideMix: Li, Socher,
    Hoi, ICLR 2020; LiJunnan1992/DivideMix at d9d3058, ``Train_cifar.py``).

    Attributes:
        train_forward: see :class:`LPA3Settings` (``"verified"``).
        networks: ``("net1", "net2")``. The two networks' names (``lpa3_networks()`` returns them).
        warmup_epochs: ``10``. Cross-entropy epochs (10 on CIFAR-10, 30 on CIFAR-100;
            ``Train_cifar.py:218-221``).
        lambda_u: ``25.0``. Unlabeled weight after the ramp (``Train_cifar.py:21-22``; its paper:
            0 to 150 by noise level).
        threshold: ``0.5``. Clean-probability threshold of the split (``Train_cifar.py:21-22``;
            0.6 at 90% noise).
        temperature: ``0.5``. Sharpening temperature (``Train_cifar.py:23``).
        alpha: ``4.0``. Mixup's Beta parameter (``Train_cifar.py:20``).
        rampup_epochs: ``16.0``. Ramp length of the unlabeled weight, from the warm-up's end
            (``Train_cifar.py:192-194``).
        loss_history: ``1``. Epochs of normalised losses averaged for the Gaussian mixture (5 at
            90% noise; ``Train_cifar.py:178-183``).
        negative_entropy: ``False``. Add the negative-entropy penalty in the warm-up (the authors:
            asymmetric noise).
        lpa3_mixup: ``True``. Mix the ``x'`` up with the labeled views (as the LP-A3 authors' PES
            code) or train them unmixed.
        lpa3_weight: ``None``. Weight of the ``x'`` term after the ramp; None uses ``lambda_u``,
            as PES's LP-A3 does. Rows with ``lambda_u = 0`` (DivideMix's CIFAR-10 asymmetric and
            20% rows) need a weight of their own, or the ``x'`` train nothing.
        seed: ``0``. Seed of the Gaussian mixture's initialisation (the authors' is unseeded).
        guess_bn_updates: ``False`` (this package's). How each network's own no-grad guessing and
            refinement forwards (train mode) treat BatchNorm: ``False``: both views of a row set in
            one forward, running statistics left alone (only the mixed training forward moves
            them); ``True``: the same pooled forwards, each moving the running statistics (twice a
            step); ``"reference"``: as the authors' code (``Train_cifar.py:64-67, 76-77``): one
            forward per view, each normalised by its own batch and each moving the running
            statistics (four times a step). The other network's guess is always in eval mode, on
            its running statistics as they are at the start of the step.
        split_per_class: ``False`` (the authors' one mixture over the whole set). True (this
            package's option): fit the mixture once per noisy class
            (:func:`~lpa3_lightning.methods.dividemix_parts.clean_probability_per_class`).
        stratified_split: ``False`` (the mixture's posterior, as the authors). True (this
            package's option): after the mixture, label as clean the same number of rows as its
            first split did, shared out over the noisy classes in proportion to their sizes, each
            class's lowest-loss rows (:func:`~lpa3_lightning.methods.dividemix_parts.stratified_selection`);
            the count is fixed at the first semi-supervised epoch's (measured in the project's
            results: at 80% noise the mixture's labeled count grows as the networks fit the noisy
            rows they were given, and one threshold starves the hard classes). Until a split has
            both a labeled and an unlabeled row, its posterior is used as is. With
            ``split_per_class`` each class keeps the count of its own first mixture instead.
        prior_weight: ``1.0``. Weight of the prior penalty ``KL(prior || mean prediction)`` (the
            authors': 1; 0 turns it off).
        class_prior: ``None`` (uniform, the authors', right for balanced classes). The penalty's
            class frequencies: one positive number per class, summing to 1 (kept as a tuple).
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
    """A ready module's settings argument as ``cls``: None gives the defaults, an instance is kept,
    a mapping gives its fields (a checkpoint's hyper-parameters hold them as one).

    Raises:
        TypeError: for a mapping with a key ``cls`` has no field for, or another type, naming
            ``argument``, the fields and the fix.
    """
    return cls() if value is None else dataclass_from(cls, value, argument)


def settings_hparams(settings: LPA3Settings) -> dict[str, Any]:
    """``settings``' fields as a plain mapping (tuples as lists): what a ready module keeps in its
    hyper-parameters, so that ``hparams.yaml`` and TensorBoard get plain values (the fields, not
    an object) and ``load_from_checkpoint`` rebuilds the dataclass through :func:`settings_from`.

    Example:
        >>> settings_hparams(SupervisedSettings(weight=0.5))
        {'train_forward': 'verified', 'weight': 0.5}
    """
    return {f.name: list(value) if isinstance(value := getattr(settings, f.name), tuple) else value
            for f in fields(settings)}
