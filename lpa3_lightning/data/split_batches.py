"""The old home of the split-balanced sampler, now :mod:`lpa3_lightning.data.sampling`: kept for the imports
that name it (``lpa3_lightning.methods.noisy_training``)."""

from lpa3_lightning.data.sampling import SplitBalancedSampler, draws_split_balanced, labeled_per_batch

__all__ = ["SplitBalancedSampler", "draws_split_balanced", "labeled_per_batch"]
