import torch
from torch import nn

from lpa3_lightning import LPA3Classifier


class Tiny(LPA3Classifier):
    def __init__(self, fail_seed: int = -1, num_classes: int = 2) -> None:
        net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                            nn.Flatten(), nn.Linear(8, num_classes))
        super().__init__(in_channels=1, num_classes=num_classes, model=net)
        self.fail_seed = fail_seed

    def on_train_start(self):
        if torch.initial_seed() == self.fail_seed:
            raise RuntimeError(f"the test's failing seed {self.fail_seed}")
