"""One seed for each (seed, epoch): the generators of the per-epoch draws (the first pass's random
selection, the data modules' shuffles), so that every rank and a resumed run draw the same."""

from __future__ import annotations

__all__ = ["epoch_seed"]


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of ``epoch`` under ``seed``: ``seed * 1000003 + epoch``, wrapped into the
    63 bits ``torch.Generator.manual_seed`` takes (a seed fixed from ``torch.initial_seed()``,
    67280421310721 in a script that never seeds, times 1000003 is past them).

    Example:
        >>> epoch_seed(0, 3), epoch_seed(2**62, 1) < 2**63
        (3, True)
    """
    return (int(seed) * 1_000_003 + int(epoch)) % 2**63
