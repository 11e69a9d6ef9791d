"""The module paths from before the folders still import, each with a DeprecationWarning naming
where its names are now, and give the very objects of the new modules."""

from __future__ import annotations

import importlib
import sys

import pytest

from lpa3_lightning._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_with_a_warning_naming_the_new_place(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"`{old}` moved: import from `{MOVED[old][0]}`"):
        module = importlib.import_module(old)
    for target in MOVED[old]:
        new = importlib.import_module(target)
        public = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
        assert public, target
        for name in public:  # the same objects, not copies
            assert getattr(module, name) is getattr(new, name), (old, name)


def test_the_former_readme_imports_still_run():
    for old in ("lpa3_lightning.attack", "lpa3_lightning.augmented_forward", "lpa3_lightning.mixins.fixmatch"):
        sys.modules.pop(old, None)  # (an earlier test may have imported them)
    with pytest.warns(DeprecationWarning):
        from lpa3_lightning.attack import label_log_prob
        from lpa3_lightning.augmented_forward import augmented_logits
        from lpa3_lightning.mixins.fixmatch import FixMatchLPA3Mixin
    from lpa3_lightning import augmented_logits as top_level
    from lpa3_lightning.core.solver_forward import label_log_prob as new
    from lpa3_lightning.mixins import FixMatchLPA3Mixin as public

    assert label_log_prob is new and augmented_logits is top_level and FixMatchLPA3Mixin is public
