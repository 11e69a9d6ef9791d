"""Write the semi-supervised configs of this folder (run it after changing a setting here).

    python configs/ssl/make_configs.py

One YAML per paper row (Yang et al., NeurIPS 2022, Table 1: FixMatch and FixMatch + LP-A3 on
CIFAR-10 40/250/4000 labels, CIFAR-100 400/2500/10000, STL-10 1000), with the FixMatch recipe
(Sohn et al., NeurIPS 2020: 2^20 steps, batch 64, mu 7, SGD Nesterov 0.03, cosine 7pi/16,
EMA 0.999, threshold 0.95) and the LP-A3 authors' settings (sigma 0.002 for CIFAR-10 and
STL-10, 0.02 for CIFAR-100, ratio 0.9, lam 1, 5 steps, the LP-A3 term after 5 epochs with
pseudo-label confidence >= 0.9), plus CPU rows on MNIST-5k (shipped) and PneumoniaMNIST.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

PAPER = {  # source -> (arch, classes, channels, sigma, weight decay, label counts)
    "cifar10": ("wrn28_2", 10, 3, 0.002, 5e-4, (40, 250, 4000)),
    "cifar100": ("wrn28_8", 100, 3, 0.02, 1e-3, (400, 2500, 10000)),
    "stl10": ("wrn28_2", 10, 3, 0.002, 5e-4, (1000,)),
}
CPU = {  # source -> (arch, classes, channels, sigma, label counts, batch, max_steps)
    "mnist5k": ("small_cnn", 10, 1, 0.02, (10, 20, 40), 32, 1000),
    "pneumoniamnist": ("small_cnn", 2, 1, 0.02, (20, 100), 32, 1000),
}


def _yaml(name: str, *, source: str, arch: str, classes: int, channels: int, wd: float, labels: int, batch: int,
          max_steps: int, sigma: float | None, root: str | None, download: bool, note: str) -> str:
    lpa3 = "" if sigma is None else f"""    - class_path: lpa3_lightning.LPA3Callback
      init_args:
        ratio: 0.9
        sigma: {sigma}
        steps: 5
        lam: 1.0
"""
    root_line = f"    root: {root}\n" if root else ""
    return f"""# {note}
# Written by configs/ssl/make_configs.py; `lpa3 fit --config configs/ssl/{name}.yaml`.
seed_everything: 0
test_after_fit: true
trainer:
  max_steps: {max_steps}
  max_epochs: -1
  accelerator: auto
  devices: 1
  default_root_dir: runs/ssl/{name}
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args:
      save_dir: runs/ssl/{name}
      name: ""
  callbacks:
{lpa3}    - class_path: lightning.pytorch.callbacks.EMAWeightAveraging
      init_args:
        decay: 0.999
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        save_last: true
model:
  class_path: lpa3_lightning.FixMatchClassifier
  init_args:
    arch: {arch}
    in_channels: {channels}
    num_classes: {classes}
    lr: 0.03
    momentum: 0.9
    weight_decay: {wd}
    threshold: 0.95
    lambda_u: 1.0
    lpa3_confidence_threshold: 0.9
    lpa3_weight: 1.0
    lpa3_loss_warmup_epochs: 5
    twin_bn: true
data:
  class_path: lpa3_lightning.data.SemiSupervisedDataModule
  init_args:
    source: {source}
{root_line}    num_labels: {labels}
    seed: 0
    split_file: runs/ssl/{name}/labeled_split.json
    batch_size: {batch}
    mu: 7
    download: {str(download).lower()}
"""


def main() -> None:
    written = []
    for source, (arch, classes, channels, sigma, wd, counts) in PAPER.items():
        for labels in counts:
            for with_lpa3 in (False, True):
                name = f"{source}_{labels}_{'fixmatch_lpa3' if with_lpa3 else 'fixmatch'}"
                note = (f"Paper row: {source.upper()} with {labels} labels, FixMatch{' + LP-A3' if with_lpa3 else ''}"
                        f" ({arch}); downloads the data set to data/ (needs internet).")
                written.append((name, _yaml(name, source=source, arch=arch, classes=classes, channels=channels, wd=wd,
                                            labels=labels, batch=64, max_steps=2**20,
                                            sigma=sigma if with_lpa3 else None, root="data", download=True,
                                            note=note)))
    for source, (arch, classes, channels, sigma, counts, batch, steps) in CPU.items():
        root = None if source == "mnist5k" else "../shared/data/medmnist"
        for labels in counts:
            for with_lpa3 in (False, True):
                name = f"{source}_{labels}_{'fixmatch_lpa3' if with_lpa3 else 'fixmatch'}"
                note = (f"CPU row: {source} with {labels} labels, FixMatch{' + LP-A3' if with_lpa3 else ''} "
                        f"({arch}, {steps} steps of batch {batch} + 7 x {batch} unlabeled)"
                        + ("; MNIST-5k ships in the package" if source == "mnist5k" else
                           "; set --data.init_args.root to the folder holding pneumoniamnist.npz"))
                written.append((name, _yaml(name, source=source, arch=arch, classes=classes, channels=channels,
                                            wd=5e-4, labels=labels, batch=batch, max_steps=steps,
                                            sigma=sigma if with_lpa3 else None, root=root, download=False,
                                            note=note)))
    for name, text in written:
        (HERE / f"{name}.yaml").write_text(text)
    print(f"wrote {len(written)} configs to {HERE}")


if __name__ == "__main__":
    main()
