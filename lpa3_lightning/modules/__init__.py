"""Ready LightningModules: supervised (MedMNIST), FixMatch, PES and DivideMix, each with LP-A3."""

from lpa3_lightning.modules.classifier import LPA3Classifier
from lpa3_lightning.modules.dividemix_classifier import DivideMixClassifier
from lpa3_lightning.modules.fixmatch_classifier import FixMatchClassifier
from lpa3_lightning.modules.pes_classifier import PESClassifier

__all__ = ["DivideMixClassifier", "FixMatchClassifier", "LPA3Classifier", "PESClassifier"]
