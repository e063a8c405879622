"""SimCLR views drawn on the accelerator from uint8 batches (kornia), with per-sample random parameters.

With 9 views per image the CPU workers, not the GPU, limit throughput. Here the data loader only decodes
and resizes; after the batch reaches the device, each of the ``B * L`` views draws its own crop, flip,
colour jitter and greyscale parameters (kornia samples per sample by default, unlike batched torchvision
v2 transforms, pytorch/vision #8484). The distributions are those of :func:`view_transform`
(:class:`ViewAugmentation` is shared), tested parameter by parameter.
"""

from __future__ import annotations

import kornia.augmentation as K
import torch
from torch import Tensor, nn

from hfmca_lightning.data.transforms import ViewAugmentation

__all__ = ["DeviceViewAugmentation"]


class DeviceViewAugmentation(nn.Module):
    """``uint8 (B, C, H, W)`` on any device -> ``L`` normalised views ``(B, L, C, S, S)``."""

    def __init__(self, spec: ViewAugmentation, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        size = (spec.image_size, spec.image_size)
        steps: list[nn.Module] = [K.RandomResizedCrop(size, scale=spec.crop_scale, ratio=spec.crop_ratio)]
        if spec.horizontal_flip:
            steps.append(K.RandomHorizontalFlip())
        if spec.jitter_p > 0:
            steps.append(K.ColorJitter(*spec.jitter, p=spec.jitter_p))
        if spec.gray_p > 0:
            steps.append(K.RandomGrayscale(p=spec.gray_p))
        self.pipeline = nn.Sequential(*steps)
        self.normalize = K.Normalize(mean=torch.tensor(mean), std=torch.tensor(std))

    def forward(self, images: Tensor, num_views: int) -> Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"device augmentation expects uint8 (B, C, H, W) batches; got {images.dtype} {tuple(images.shape)}")
        batch = images.shape[0]
        views = images.repeat_interleave(num_views, dim=0).float().div_(255)
        views = self.normalize(self.pipeline(views))
        return views.reshape(batch, num_views, *views.shape[1:])
