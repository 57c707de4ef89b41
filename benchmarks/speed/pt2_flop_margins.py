"""The compute budget of ``audit --model X.pt2`` against genuine models
(docs/audit.md#auditing-a-model-trained-elsewhere,
:mod:`fedlap_privacy.audit.readers.exported_compute`).

Exports each model with a dynamic batch, reads it back with the audit's interpreter and
prints the FLOP per record its walk counts, the budget, and their ratio (the margin is its
inverse): the project's ConvNet on MNIST and CIFAR-10 shapes, its tabular MLP, a VGG-style
CIFAR-10 network, a ResNet-18-style CIFAR-10 network (BasicBlocks 64-128-256-512), and the
small models of the test suite. ``--quick`` skips the two large ones.

    python benchmarks/speed/pt2_flop_margins.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from fedlap_privacy.audit.readers.exported import load_exported_program
from fedlap_privacy.models import ModelConfig, TabularMLP, build_model


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.na = nn.BatchNorm2d(cout)
        self.b = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.nb = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                   nn.BatchNorm2d(cout)) if stride != 1 or cin != cout
                     else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.nb(self.b(torch.relu(self.na(self.a(x))))) + self.skip(x))


def resnet18_cifar() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]
    return nn.Sequential(*layers)


def vgg_cifar() -> nn.Module:
    layers: list[nn.Module] = []
    cin = 3
    for cout in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M"):
        if cout == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, int(cout), 3, padding=1), nn.ReLU()]
            cin = int(cout)
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512 * 4, 10))


def models(quick: bool) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    out = [
        ("ConvNet MNIST (128 x 3)", build_model(ModelConfig(1, 28, 10)), (1, 28, 28)),
        ("ConvNet CIFAR-10 (128 x 3)", build_model(ModelConfig(3, 32, 10)), (3, 32, 32)),
        ("TabularMLP (54 features)", TabularMLP(54, 7), (54,)),
        ("MLP 64-64-10 (tests)", nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(),
                                               nn.Linear(64, 10)), (1, 8, 8)),
        ("logistic regression 4 -> 2", nn.Linear(4, 2), (4,)),
    ]
    if not quick:
        out += [("VGG-style CIFAR-10", vgg_cifar(), (3, 32, 32)),
                ("ResNet-18-style CIFAR-10", resnet18_cifar(), (3, 32, 32))]
    return out


def main() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        print(f"{'model':30} {'weights':>10} {'GFLOP/rec':>10} {'budget':>10} {'ratio':>8}")
        for name, model, shape in models("--quick" in sys.argv):
            model.eval()
            path = Path(folder) / "m.pt2"
            program = torch.export.export(model, (torch.rand(2, *shape),), dynamic_shapes=(
                {0: torch.export.Dim("batch", min=1)},))
            torch.export.save(program, path)
            ours = load_exported_program(path)
            x = torch.rand(8, *shape)
            spent, budget, whole = ours.flop_count(x)
            assert whole, f"the walk stopped before the end of {name}"
            per_record = spent / x.shape[0]
            print(f"{name:30} {budget.weights:>10} {per_record / 1e9:>10.5f} "
                  f"{budget.per_record / 1e9:>10.3f} {per_record / budget.per_record:>8.4f}")


if __name__ == "__main__":
    main()
