"""SimCLR views drawn from uint8 batches by kornia, with per-sample random parameters (:class:`~hfmca_lightning.data.
KorniaViews`; :mod:`hfmca_lightning.data.batched_augment` draws the same distributions in fewer, whole-batch
operations: kornia's cost at CIFAR size is dispatch).

The data loader only decodes and resizes; after the batch reaches the device, each of the ``B * L`` views
draws its own crop, flip, colour jitter and greyscale parameters (kornia samples per sample by default,
unlike batched torchvision v2 transforms, pytorch/vision #8484). The distributions are those of :func:`view_transform`
(:class:`ViewAugmentation` is shared), tested parameter by parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torchvision.transforms.functional import pil_to_tensor

from hfmca_lightning.data.transforms import BLUR_SIGMA, ViewAugmentation
from hfmca_lightning.errors import ConfigurationError

__all__ = ["DeviceViewAugmentation", "SampleViews"]


class DeviceViewAugmentation(nn.Module):
    """``uint8 (B, C, H, W)`` on any device -> ``L`` normalised views ``(B, L, C, S, S)``.

    Crop, flip, colour jitter and greyscale are shared by all views; blur and solarisation follow the
    spec's view kinds (view ``l`` of each group uses kind ``l % kinds``), as the CPU path does.
    """

    def __init__(self, spec: ViewAugmentation, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        try:
            import kornia.augmentation as K  # only this pipeline needs kornia (an optional extra)
        except ImportError:
            raise ConfigurationError(
                "the kornia view pipeline (KorniaViews) needs kornia: "
                "pip install 'hfmca_lightning[kornia]', or use the batched pipeline (the default)"
            ) from None

        size = (spec.image_size, spec.image_size)
        steps: list[nn.Module] = [K.RandomResizedCrop(size, scale=spec.crop_scale, ratio=spec.crop_ratio)]
        if spec.horizontal_flip:
            steps.append(K.RandomHorizontalFlip())
        if spec.jitter_p > 0:
            steps.append(K.ColorJitter(*spec.jitter, p=spec.jitter_p))
        if spec.gray_p > 0:
            steps.append(K.RandomGrayscale(p=spec.gray_p))
        self.pipeline = nn.Sequential(*steps)
        self.per_kind = nn.ModuleList()
        for kind in range(spec.view_kinds):
            blur_p, solarize_p = spec.kind(kind)
            extras: list[nn.Module] = []
            if blur_p > 0:
                extras.append(K.RandomGaussianBlur(spec.blur_kernel, sigma=BLUR_SIGMA, p=blur_p))
            if solarize_p > 0:
                # threshold exactly SOLARIZE_THRESHOLD / 255 (no random shift), no brightness addition
                extras.append(K.RandomSolarize(thresholds=0.0, additions=0.0, p=solarize_p))
            self.per_kind.append(nn.Sequential(*extras))
        self.normalize = K.Normalize(mean=torch.tensor(mean), std=torch.tensor(std))

    def forward(self, images: Tensor, num_views: int) -> Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(
                f"device augmentation expects uint8 (B, C, H, W) batches; got {images.dtype} {tuple(images.shape)}"
            )
        batch = images.shape[0]
        views = self.pipeline(images.repeat_interleave(num_views, dim=0).float().div_(255))
        kinds = len(self.per_kind)
        if any(len(extras) for extras in self.per_kind):
            view_kind = torch.arange(views.shape[0], device=views.device) % num_views % kinds
            views = views.clone()
            for kind, extras in enumerate(self.per_kind):
                selected = view_kind == kind
                if len(extras) and bool(selected.any()):
                    views[selected] = extras(views[selected])
        views = self.normalize(views)
        return views.reshape(batch, num_views, *views.shape[1:])


class SampleViews:
    """All ``L`` views of one image in one batched call of :class:`DeviceViewAugmentation`, on the CPU in a
    data-loader worker (``KorniaViews(on="workers")``): ``image (C, H, W)`` uint8 tensor or PIL image ->
    ``(L, C, S, S)``. The distributions of the per-view torchvision pipeline; about 2x its speed on CIFAR-sized
    images (one vectorised colour jitter for all views instead of one small call per view). Random numbers
    come from torch's generator, so views stay a function of the sample seed."""

    def __init__(self, augmentation: DeviceViewAugmentation) -> None:
        self.augmentation = augmentation

    def __call__(self, image: Any, num_views: int) -> Tensor:
        if not isinstance(image, Tensor):
            image = pil_to_tensor(image)
        with torch.no_grad():
            return self.augmentation(image[None], num_views)[0]
