"""The algorithm without Lightning: no Lightning import, and the README's plain loop runs."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lpa3_lightning import TimeConsistency, convert_dual_bn, lpa3_attack, use_twin_bn
from tests.helpers import indexed_images, small_cnn


def test_core_modules_import_no_lightning():
    code = (
        "import sys, lpa3_lightning\n"
        "import lpa3_lightning.tcs, lpa3_lightning.selection, lpa3_lightning.features, lpa3_lightning.attack\n"
        "import lpa3_lightning.dual_bn, lpa3_lightning.augmented, lpa3_lightning.mixins, lpa3_lightning.models\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_readme_plain_pytorch_loop():
    torch.manual_seed(0)
    dataset = indexed_images(48)
    loader = DataLoader(dataset, batch_size=16, shuffle=True)
    model = convert_dual_bn(small_cnn())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    tcs = TimeConsistency(num_samples=len(dataset), num_classes=3, ratio=0.5)
    augmented_per_epoch = []
    for _ in range(3):
        count = 0
        for x, y, idx in loader:
            mask = tcs.select(idx)
            loss = torch.zeros(())
            if mask.sum() > 1:
                x_adv = lpa3_attack(model, x[mask], y[mask], sigma=0.02, steps=2, bn_mode="twin")
                with use_twin_bn(model):
                    loss = F.cross_entropy(model(x_adv), y[mask])
                count += int(mask.sum())
            logits = model(x)
            loss = loss + F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tcs.update(idx, logits.detach().softmax(1))
        tcs.refresh_threshold()
        augmented_per_epoch.append(count)
    assert augmented_per_epoch[0] == 48  # no threshold in the first pass
    assert 0 < augmented_per_epoch[2] < 48
    assert model.training
