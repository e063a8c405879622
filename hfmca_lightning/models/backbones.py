"""Backbones: plain ``nn.Module``s mapping ``(N, 3, H, W)`` images to ``(N, feature_dim)`` features."""

from __future__ import annotations

import difflib
import re
import warnings
from typing import Any

import torchvision
from torch import Tensor, nn

from hfmca_lightning.errors import ConfigurationError, HFMCAWarning, check_at_least

__all__ = ["CIFARResNet18", "SmallConvNet", "TimmBackbone", "TorchvisionBackbone"]

_CLASSIFIER_ATTRIBUTES = ("fc", "classifier", "heads", "head")
_AUXILIARY_CLASSIFIER_ATTRIBUTES = ("aux1", "aux2", "AuxLogits")  # GoogLeNet's, Inception-v3's


class TorchvisionBackbone(nn.Module):
    """Any torchvision classification model by name, its classifier removed: ``(N, 3, H, W) -> (N, feature_dim)``.

    ``resnet50``, ``wide_resnet50_2``, ``resnext50_32x4d``, ``convnext_tiny``, ``efficientnet_b0``,
    ``regnet_y_800mf``, ``vit_b_16``, ... (``torchvision.models.list_models()``). The last linear layer of the
    classifier (``fc``, ``classifier``, ``heads`` or ``head``) becomes the identity and ``feature_dim`` is
    its input size. The model sits under ``net``, so its torchvision module names are kept behind a
    ``net.`` prefix (``net.layer1.0``: what internal-cost ``layers`` name). Auxiliary classifiers (``googlenet``'s
    ``aux1`` / ``aux2``, ``inception_v3``'s ``AuxLogits``) are removed, so that training mode gives the features too,
    not torchvision's ``GoogLeNetOutputs`` / ``InceptionOutputs``. Models built for one input size (``vit_*``,
    ``maxvit_t``: 224 px) set ``image_size``, which training checks against the data's before the first step.

    Args:
        name: the torchvision model name.
        weights: torchvision weights to start from (e.g. ``IMAGENET1K_V2``; downloaded); ``None``: random.
        cifar_stem: ResNet family only: 3x3 stride-1 ``conv1`` and no max-pool, for 32-px images (a new, random
            ``conv1``: with ``weights``, the rest stays pretrained, with a warning).

    Raises:
        ConfigurationError: for a name or weights torchvision does not have, or ``cifar_stem`` on a model without a
            ResNet stem.
    """

    def __init__(self, name: str = "resnet50", weights: str | None = None, cifar_stem: bool = False) -> None:
        super().__init__()
        available = torchvision.models.list_models(module=torchvision.models)
        if name not in available:
            close = difflib.get_close_matches(name, available, n=3)
            raise ConfigurationError(
                f"{name!r} is not a torchvision classification "
                f"model{'; did you mean ' + ' / '.join(close) + '?' if close else ''} "
                "(torchvision.models.list_models() lists them)",
                parameter="name",
            )
        if weights is not None:
            known = torchvision.models.get_model_weights(name)
            if weights.removeprefix(f"{known.__name__}.") not in known.__members__:
                raise ConfigurationError(
                    f"{weights!r} is not a weight of {name}; it has {', '.join(known.__members__)} (or null: random)",
                    parameter="weights",
                )
        net = torchvision.models.get_model(name, weights=weights)
        if cifar_stem:
            if not isinstance(getattr(net, "conv1", None), nn.Conv2d) or not hasattr(net, "maxpool"):
                raise ConfigurationError(
                    f"cifar_stem replaces conv1 and the max-pool of ResNet-family models; {name} has none",
                    parameter="cifar_stem",
                )
            if weights is not None:
                warnings.warn(
                    f"cifar_stem replaces the pretrained conv1 of {name} ({weights}) by a new, random 3x3 one; the "
                    "rest of the network stays pretrained",
                    HFMCAWarning,
                    stacklevel=2,
                )
            net.conv1 = nn.Conv2d(3, net.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
            net.maxpool = nn.Identity()
        _remove_auxiliary_classifiers(net)
        self.feature_dim, self.classifier_path = _remove_classifier(net, name)
        self.architecture, self.cifar_stem = name, cifar_stem  # what `hfmca export` writes down
        image_size = _fixed_input_size(net)
        if image_size is not None:  # ViTs, MaxViT: one input size (checked against the data)
            self.image_size: int = image_size
        self.net = net

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)


def _remove_auxiliary_classifiers(net: nn.Module) -> None:
    """Drop GoogLeNet's / Inception-v3's auxiliary classifiers (Szegedy et al. 2015, 2016), as torchvision does for
    pretrained weights: with them, training-mode ``forward`` returns a namedtuple of logits instead of the features."""
    if not getattr(net, "aux_logits", False):
        return
    setattr(net, "aux_logits", False)  # noqa: B010  # an attribute of GoogLeNet / Inception3, not of nn.Module
    for attribute in _AUXILIARY_CLASSIFIER_ATTRIBUTES:
        if isinstance(getattr(net, attribute, None), nn.Module):
            setattr(net, attribute, None)  # what torchvision's builders set without auxiliary heads


def _fixed_input_size(net: nn.Module) -> int | None:
    """The one image size a model takes, where it has one: a torchvision ViT's ``image_size``; MaxViT's first stage
    grid (built for it: window and grid partitions of fixed size) times its stride 4 (stride-2 stem, stride-2 first
    MBConv)."""
    if isinstance(getattr(net, "image_size", None), int):
        return int(net.image_size)  # type: ignore[arg-type]  # checked just above
    if isinstance(net, torchvision.models.MaxVit):
        grid: tuple[int, int] = net.blocks[0].grid_size  # a MaxVitBlock's (H, W), after its stride 2
        return 4 * int(grid[0])
    return None


def _remove_classifier(net: nn.Module, name: str) -> tuple[int, str]:
    """Replace the last ``nn.Linear`` of the classifier by the identity; return its input size and its module
    path in ``net`` (``fc``, ``classifier.2``, ``heads.head``)."""
    for attribute in _CLASSIFIER_ATTRIBUTES:
        classifier = getattr(net, attribute, None)
        if not isinstance(classifier, nn.Module):
            continue
        if isinstance(classifier, nn.Linear):
            setattr(net, attribute, nn.Identity())
            return classifier.in_features, attribute
        linears = [(path, module) for path, module in classifier.named_modules() if isinstance(module, nn.Linear)]
        if linears:
            path, linear = linears[-1]
            parent = classifier.get_submodule(path.rpartition(".")[0]) if "." in path else classifier
            setattr(parent, path.rpartition(".")[2], nn.Identity())
            return linear.in_features, f"{attribute}.{path}"
    raise ConfigurationError(
        f"cannot find the classifier of torchvision model {name} (looked for {', '.join(_CLASSIFIER_ATTRIBUTES)})",
        parameter="name",
    )


class CIFARResNet18(TorchvisionBackbone):
    """torchvision ResNet-18 with the CIFAR stem (docs/conventions.md §2): 3x3 stride-1 ``conv1``, no max-pool, no fc.

    Forgetting the CIFAR stem costs SimCLR ~10 kNN points on CIFAR (lightly #1419). The torchvision
    module names are kept behind the ``net.`` prefix (``net.layer1.0``, ``net.layer4.1``, ...): internal-cost hooks
    name blocks by them.
    Output: ``(N, 512)``. The same as ``TorchvisionBackbone(name="resnet18", cifar_stem=True)``.
    """

    def __init__(self) -> None:
        super().__init__("resnet18", cifar_stem=True)


class TimmBackbone(nn.Module):
    """Any timm model by name (ViT, Swin, ConvNeXt, ...), without classifier: ``(N, 3, H, W) -> (N, feature_dim)``.

    Needs the optional extra ``timm`` (``pip install 'hfmca_lightning[timm]'``). Transformers have no
    window geometry: they train with the external cost only (internal costs need convolutional blocks).

    Args:
        name: the timm model name (``timm.list_models()``), e.g. ``vit_small_patch16_224``.
        pretrained: start from timm's pretrained weights (downloaded).
        model_kwargs: more arguments of ``timm.create_model``, e.g. ``{img_size: 96, patch_size: 8}``.
    """

    def __init__(
        self, name: str = "vit_small_patch16_224", pretrained: bool = False, model_kwargs: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        try:
            import timm
        except ImportError:
            raise ConfigurationError("TimmBackbone needs timm: pip install 'hfmca_lightning[timm]'") from None
        if not timm.is_model(name):
            close = difflib.get_close_matches(name, timm.list_models(), n=3)
            raise ConfigurationError(
                f"{name!r} is not a timm model{'; did you mean ' + ' / '.join(close) + '?' if close else ''}",
                parameter="name",
            )
        try:
            self.net = timm.create_model(name, pretrained=pretrained, num_classes=0, **(model_kwargs or {}))
        except TypeError as error:
            unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(error))
            if unexpected is None or unexpected.group(1) not in (model_kwargs or {}):
                raise
            raise ConfigurationError(
                f"timm model {name!r} takes no argument {unexpected.group(1)!r}; remove it from model_kwargs "
                "(they go to timm.create_model and the model's constructor)",
                parameter="model_kwargs",
            ) from None
        # the pooled features' size: head_hidden_size where a model has a head before its classifier (MobileNetV3's
        # conv_head: 1024 after 288 channels), which num_classes=0 keeps
        size = getattr(self.net, "head_hidden_size", None) or self.net.num_features
        self.feature_dim = int(size)  # type: ignore[arg-type]  # timm models set it to an int
        patches = getattr(self.net, "patch_embed", None)  # ViTs of a fixed input size (checked against the data)
        if getattr(patches, "strict_img_size", False) and not getattr(patches, "dynamic_img_size", False):
            self.image_size: int = int(patches.img_size[0])  # type: ignore[union-attr]  # set where strict
        self.architecture, self.model_kwargs = name, dict(model_kwargs or {})  # what `hfmca export` writes down

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)


class SmallConvNet(nn.Module):
    """A small, fast CNN for CPU runs and tests: ``num_stages`` x (3x3 conv, BN, ReLU, 2x2 max-pool).

    Each stage is one module, ``features.0`` .. ``features.<num_stages - 1>`` (:attr:`internal_layers`), whose window
    geometry is ``(4, 2, 1)``: the stages are what ``hfmca analyze`` and the spectrum callback look inside by default.
    Output: ``(N, feature_dim)`` after global average pooling, ``feature_dim = width * 2**(num_stages-1)``.

    Args:
        width: the channels of the first stage; each further stage doubles them.
        num_stages: how many stages; each halves the map, so images need at least ``2**num_stages`` pixels a side
            (``min_image_size``).

    Raises:
        ConfigurationError: when ``width`` or ``num_stages`` is not a whole number >= 1.
    """

    def __init__(self, width: int = 32, num_stages: int = 3) -> None:
        super().__init__()
        for name, value in (("width", width), ("num_stages", num_stages)):
            check_at_least(value, 1, name, "SmallConvNet")
        stages: list[nn.Module] = []
        in_channels = 3
        for stage in range(num_stages):
            out_channels = width * 2**stage
            stages.append(
                nn.Sequential(
                    nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
                    nn.BatchNorm2d(out_channels),
                    nn.ReLU(inplace=True),
                    nn.MaxPool2d(2),
                )
            )
            in_channels = out_channels
        self.features = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = in_channels
        self.min_image_size = 2**num_stages  # each stage halves the map

    @property
    def internal_layers(self) -> list[str]:
        """Module names of the stages: ``features.0`` .. ``features.<num_stages - 1>``."""
        return [f"features.{index}" for index in range(len(self.features))]

    def forward(self, images: Tensor) -> Tensor:
        return self.pool(self.features(images)).flatten(1)
