"""SimCLR views of whole batches on any device (:class:`BatchedViewAugmentation`; docs/conventions.md §5): the
distributions of :func:`~hfmca_lightning.data.transforms.view_transform` in a fixed number of tensor operations, each
sample's parameters from its seed alone (:mod:`~hfmca_lightning.data.counter_random`), pixels in float32
(torchvision's uint8 blends truncate after every jitter step, about 1/255 darker per step)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfmca_lightning.data.counter_random import CounterUniforms
from hfmca_lightning.data.transforms import BLUR_SIGMA, SOLARIZE_THRESHOLD, ViewAugmentation

__all__ = ["BatchedViewAugmentation", "jitter_views", "sample_crop_boxes"]

GREY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale
CROP_TRIES = 10  # torchvision's RandomResizedCrop.get_params
Interval = tuple[float, float]


def sample_crop_boxes(
    count: int, height: int, width: int, scale: Interval, ratio: Interval, uniforms: CounterUniforms
) -> Tensor:
    """``(count, 4)`` crops ``(top, left, height, width)`` (float64 holding integers) drawn from ``uniforms`` as
    torchvision's ``RandomResizedCrop.get_params``: the first of ten tries that fits, else its centre-crop fallback."""
    target = height * width * uniforms.uniform((count, CROP_TRIES), *scale, dtype=torch.float64)
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    aspect = torch.exp(uniforms.uniform((count, CROP_TRIES), *log_ratio, dtype=torch.float64))
    widths, heights = torch.round(torch.sqrt(target * aspect)), torch.round(torch.sqrt(target / aspect))
    fits = (widths > 0) & (widths <= width) & (heights > 0) & (heights <= height)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # the first try that fits (0 if none does)
    w, h = widths.gather(1, first)[:, 0], heights.gather(1, first)[:, 0]
    # torchvision's fallback: the whole image, cut to the nearest allowed aspect ratio, centred
    allowed = min(max(width / height, min(ratio)), max(ratio))
    fallback_w, fallback_h = min(width, round(height * allowed)), min(height, round(width / allowed))
    found = fits.any(dim=1)
    w, h = w.where(found, torch.full_like(w, fallback_w)), h.where(found, torch.full_like(h, fallback_h))
    uniform = uniforms.rand((count, 2), dtype=torch.float64)
    top = torch.floor(uniform[:, 0] * (height - h + 1)).where(found, torch.full_like(h, (height - fallback_h) // 2))
    left = torch.floor(uniform[:, 1] * (width - w + 1)).where(found, torch.full_like(w, (width - fallback_w) // 2))
    return torch.stack((top, left, h, w), dim=1)


def _crop_grid(boxes: Tensor, flip: Tensor, size: int, height: int, width: int) -> Tensor:
    """``(N, size, size, 2)`` sampling grid of ``grid_sample`` (``align_corners=False``) that resizes each box to
    ``size x size`` (pixel centres at ``left + (u + 1/2) w / size``) and mirrors the flipped views."""
    centres = (torch.arange(size, dtype=torch.float64, device=boxes.device) + 0.5) / size
    xs = (boxes[:, 1:2] + centres * boxes[:, 3:4]) / width * 2 - 1  # (N, size)
    ys = (boxes[:, 0:1] + centres * boxes[:, 2:3]) / height * 2 - 1
    xs = torch.where(flip[:, None], xs.flip(1), xs)
    grid = torch.stack((xs[:, None, :].expand(-1, size, -1), ys[:, :, None].expand(-1, -1, size)), dim=-1)
    return grid.to(torch.float32)


def _grey(views: Tensor) -> Tensor:
    """``(N, 1, H, W)`` luma of ``(N, 3, H, W)`` RGB views, as torchvision's ``rgb_to_grayscale`` (two fused
    multiply-adds: a 1 x 1 convolution is far slower on CPUs)."""
    r, g, b = views[:, 0:1], views[:, 1:2], views[:, 2:3]
    return r.mul(GREY_WEIGHTS[0]).add_(g, alpha=GREY_WEIGHTS[1]).add_(b, alpha=GREY_WEIGHTS[2])


def _shift_hue(views: Tensor, shift: Tensor) -> Tensor:
    """torchvision's ``adjust_hue`` on float RGB in [0, 1]: to HSV, hue + shift (mod 1), back; ``shift (N,)``.
    The sector formulas of torchvision's ``_rgb2hsv`` / ``_hsv2rgb`` in closed form (equal up to rounding)."""
    r, g, b = views.unbind(dim=1)
    minimum, maximum = torch.aminmax(views, dim=1)
    chroma = maximum - minimum
    safe_chroma = torch.where(chroma > 0, chroma, torch.ones_like(chroma))
    saturation = chroma / torch.where(maximum > 0, maximum, torch.ones_like(maximum))
    hue = torch.where(maximum == g, (b - r) / safe_chroma + 2.0, (r - g) / safe_chroma + 4.0)
    hue = torch.where(maximum == r, (g - b) / safe_chroma, hue)
    hue = torch.remainder(hue / 6.0 + 1.0 + shift.view(-1, 1, 1), 1.0)
    # channel n in (5, 3, 1) for (R, G, B): v - v s clamp(min(k, 4 - k), 0, 1) with k = (n + 6 h) mod 6
    offsets = torch.arange(5.0, 0.0, -2.0, dtype=views.dtype, device=views.device).view(1, 3, 1, 1)
    k = torch.remainder(offsets + 6.0 * hue.unsqueeze(1), 6.0)
    return maximum.unsqueeze(1) * (1.0 - saturation.unsqueeze(1) * torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0))


def _gaussian_blur(views: Tensor, sigma: Tensor, kernel: int) -> Tensor:
    """Separable Gaussian blur of ``(N, C, H, W)`` views, ``sigma (N,)`` per view (0: unchanged), reflect padding."""
    count, channels = views.shape[:2]
    offsets = torch.arange(kernel, dtype=views.dtype, device=views.device) - (kernel - 1) / 2
    blurred = sigma > 0
    safe_sigma = torch.where(blurred, sigma, torch.ones_like(sigma)).to(views.dtype)
    weights = torch.exp(-(offsets**2) / (2 * safe_sigma[:, None] ** 2))
    weights = weights / weights.sum(dim=1, keepdim=True)
    identity = (offsets == 0).to(views.dtype).expand(count, -1)
    weights = torch.where(blurred[:, None], weights, identity).repeat_interleave(channels, dim=0)  # (N*C, k)
    half = kernel // 2
    flat = views.reshape(1, count * channels, *views.shape[2:])
    for padding, shape in (((0, 0, half, half), (kernel, 1)), ((half, half, 0, 0), (1, kernel))):  # along H, then W
        flat = F.conv2d(F.pad(flat, padding, mode="reflect"), weights.view(-1, 1, *shape), groups=count * channels)
    return flat.view_as(views)


class BatchedViewAugmentation(nn.Module):
    """``uint8 (B, C, H, W)`` on any device -> ``L`` normalised views ``(B, L, C, S, S)`` of ``spec`` per image, view
    ``l`` of each image of kind ``l % spec.view_kinds`` (blur, solarisation), normalised with ``mean`` and ``std``."""

    mean: Tensor
    std: Tensor
    blur_p: Tensor
    solarize_p: Tensor

    def __init__(self, spec: ViewAugmentation, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.spec = spec
        blur_p, solarize_p = zip(*(spec.kind(kind) for kind in range(spec.view_kinds)))
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("blur_p", torch.tensor(blur_p, dtype=torch.float32), persistent=False)
        self.register_buffer("solarize_p", torch.tensor(solarize_p, dtype=torch.float32), persistent=False)
        self._any_blur, self._any_solarize = any(blur_p), any(solarize_p)

    def views_from_seeds(self, images: Tensor, seeds: Tensor, num_views: int) -> Tensor:
        """``(B, L, C, S, S)`` views of ``images (B, C, H, W)`` uint8, image ``b``'s parameters from ``seeds[b]``
        (int64, on the images' device) alone, drawn from its counter-based numbers in a fixed order."""
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"need uint8 (B, C, H, W) images to augment; got {images.dtype} {tuple(images.shape)}")
        spec, (batch, channels, height, width), size = self.spec, images.shape, self.spec.image_size
        if seeds.shape != (batch,):
            raise ValueError(f"need one seed per image: {batch} images, seeds of shape {tuple(seeds.shape)}")
        uniforms, count, device = CounterUniforms(seeds, num_views), batch * num_views, seeds.device
        boxes = sample_crop_boxes(count, height, width, spec.crop_scale, spec.crop_ratio, uniforms=uniforms)
        flip = uniforms.rand((count,)) < 0.5 if spec.horizontal_flip else seeds.new_zeros(count, dtype=torch.bool)
        brightness, contrast, saturation, hue = spec.jitter
        applied = uniforms.rand((count,)) < spec.jitter_p

        def factor(strength: float) -> Tensor:  # drawn even at strength 0: the later draws keep their positions
            drawn = uniforms.uniform((count,), max(0.0, 1.0 - strength), 1.0 + strength)
            return torch.where(applied, drawn, torch.ones_like(drawn)) if strength > 0 else torch.ones_like(drawn)

        factors = torch.stack((factor(brightness), factor(contrast), factor(saturation)), dim=1)
        hue_shift = uniforms.uniform((count,), -hue, hue) if hue > 0 else torch.zeros(count, device=device)
        hue_shift = torch.where(applied, hue_shift, torch.zeros_like(hue_shift))
        order = uniforms.rand((count, 4)).argsort(dim=1, stable=True)  # ties: the same order on every device
        grey = uniforms.rand((count,)) < spec.gray_p
        kind = torch.arange(count, device=device) % num_views % self.blur_p.numel()
        sigma = uniforms.uniform((count,), *BLUR_SIGMA)
        sigma = torch.where(uniforms.rand((count,)) < self.blur_p.to(device)[kind], sigma, torch.zeros_like(sigma))
        solarize = uniforms.rand((count,)) < self.solarize_p.to(device)[kind]
        sources = images.float().div_(255.0).repeat_interleave(num_views, dim=0)
        grid = _crop_grid(boxes.to(images.device), flip.to(images.device), size, height, width)
        views = F.grid_sample(sources, grid, mode="bilinear", padding_mode="border", align_corners=False).clamp_(0, 1)
        if spec.jitter_p > 0 and any(spec.jitter) and channels == 3:
            views = jitter_views(views, factors, hue_shift, order)
        if spec.gray_p > 0 and channels == 3:
            views = torch.where(grey.view(-1, 1, 1, 1), _grey(views).expand_as(views), views)
        if self._any_blur:
            views = _gaussian_blur(views, sigma, spec.blur_kernel)
        if self._any_solarize:
            views = torch.where(solarize.view(-1, 1, 1, 1) & (views >= SOLARIZE_THRESHOLD / 255.0), 1.0 - views, views)
        return ((views - self.mean) / self.std).view(batch, num_views, channels, size, size)


def jitter_views(
    views: Tensor, factors: Tensor, hue_shift: Tensor, order: Tensor, select_rows: bool | None = None
) -> Tensor:
    """torchvision's colour jitter of float RGB views ``(N, 3, H, W)`` in [0, 1]: ``factors (N, 3)`` brightness,
    contrast, saturation (1: unchanged), ``hue_shift (N,)`` (0: unchanged), ``order (N, 4)`` a permutation of 0
    brightness, 1 contrast, 2 saturation, 3 hue. ``select_rows``: the hue shift on the rows that need it only (a quarter
    of the arithmetic, but the rows are read on the host) or on all rows, selected; default: rows on CPUs only."""
    select_rows = views.device.type == "cpu" if select_rows is None else select_rows
    count = views.shape[0]
    # per round and view: the blend factor (1 in the hue's round) and the reference's weights on the grey image
    # and on the mean grey: brightness (0, 0), contrast (0, 1), saturation (1, 0)
    with_hue = torch.cat((factors, torch.ones_like(factors[:, :1])), dim=1)  # (N, 4)
    blend = with_hue.gather(1, order).T.reshape(4, count, 1, 1, 1)
    grey_weight = (order == 2).T.to(views.dtype).reshape(4, count, 1, 1, 1)
    mean_weight = (order == 1).T.to(views.dtype).reshape(4, count, 1, 1, 1)
    hue_round = ((order == 3) & (hue_shift != 0)[:, None]).T  # (4, N)
    for step in range(4):
        grey = _grey(views)
        reference = grey * grey_weight[step] + grey.mean(dim=(2, 3), keepdim=True) * mean_weight[step]
        views = torch.lerp(reference, views, blend[step]).clamp_(0.0, 1.0)
        if select_rows:
            rows = hue_round[step].nonzero()[:, 0]
            if len(rows):
                views = views.index_copy(0, rows, _shift_hue(views.index_select(0, rows), hue_shift[rows]))
        else:
            views = torch.where(hue_round[step].view(-1, 1, 1, 1), _shift_hue(views, hue_shift), views)
    return views
