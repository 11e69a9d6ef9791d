"""The algorithm without Lightning: no Lightning import, and the README's plain loop runs."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lpa3_lightning import TimeConsistency, augmented_logits, convert_dual_bn, lpa3_attack
from lpa3_lightning.core.forward_modes import label_log_prob
from tests.helpers import indexed_images, small_cnn


def test_every_core_module_imports_no_lightning():
    code = (
        "import importlib, pkgutil, sys, lpa3_lightning, lpa3_lightning.core\n"
        "names = [m.name for m in pkgutil.iter_modules(lpa3_lightning.core.__path__, 'lpa3_lightning.core.')]\n"
        "assert len(names) >= 10, names\n"
        "for name in names: importlib.import_module(name)\n"
        "import lpa3_lightning.mixins, lpa3_lightning.models\n"
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
    kept, trained = 0, 0
    for epoch in range(3):
        count = 0
        for x, y, idx in loader:
            mask = tcs.select(idx, epoch)
            loss = torch.zeros(())
            if mask.sum() > 1:
                logp, stats = label_log_prob(model, x[mask], y[mask], bn_mode="twin")
                x_adv = lpa3_attack(model, x[mask], y[mask], sigma=0.02, steps=2, bn_mode="twin",
                                    bn_statistics=stats)
                logits_adv = augmented_logits(model, x_adv, bn_mode="twin", bn_statistics=stats)
                loss = F.cross_entropy(logits_adv, y[mask])
                # the label is kept in the very forward the loss uses
                logp_adv = logits_adv.detach().log_softmax(1).gather(1, y[mask][:, None]).squeeze(1)
                kept += int((logp_adv >= logp - 0.02).sum())
                trained += int(mask.sum())
                count += int(mask.sum())
            logits = model(x)
            loss = loss + F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tcs.update(idx, logits.detach().softmax(1))
        tcs.refresh_threshold()
        augmented_per_epoch.append(count)
    assert 16 <= augmented_per_epoch[0] <= 24  # first pass: a random half (a lone pick in a batch waits)
    assert 0 < augmented_per_epoch[2] <= 24
    assert kept / trained >= 0.99
    assert model.training
