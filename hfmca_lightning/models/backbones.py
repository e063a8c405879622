"""Backbones: plain ``nn.Module``s mapping ``(N, 3, H, W)`` images to ``(N, feature_dim)`` features."""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models import resnet18

from hfmca_lightning.errors import ConfigurationError

__all__ = ["CIFARResNet18", "SmallConvNet"]


class CIFARResNet18(nn.Module):
    """torchvision ResNet-18 with the CIFAR stem (docs/conventions.md §2): 3x3 stride-1 ``conv1``, no max-pool, no fc.

    Forgetting the CIFAR stem costs SimCLR ~10 kNN points on CIFAR (lightly #1419). The torchvision
    module names (``layer1.0``, ``layer4.1``, ...) are kept, so internal-cost hooks can name blocks.
    Output: ``(N, 512)``.
    """

    feature_dim = 512

    def __init__(self) -> None:
        super().__init__()
        net = resnet18(weights=None)
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
        net.fc = nn.Identity()
        self.net = net

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)


class SmallConvNet(nn.Module):
    """A small, fast CNN for CPU runs and tests: ``num_stages`` x (3x3 conv, BN, ReLU, 2x2 max-pool).

    Output: ``(N, feature_dim)`` after global average pooling, ``feature_dim = width * 2**(num_stages-1)``.
    """

    def __init__(self, width: int = 32, num_stages: int = 3) -> None:
        super().__init__()
        for name, value in (("width", width), ("num_stages", num_stages)):
            if value < 1:
                raise ConfigurationError(f"SmallConvNet needs {name} >= 1; got {value}", parameter=name)
        layers: list[nn.Module] = []
        in_channels = 3
        for stage in range(num_stages):
            out_channels = width * 2**stage
            layers += [
                nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
                nn.BatchNorm2d(out_channels),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            in_channels = out_channels
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = in_channels

    def forward(self, images: Tensor) -> Tensor:
        return self.pool(self.features(images)).flatten(1)
