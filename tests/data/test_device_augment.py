"""On-device (kornia) views have the distributions of the CPU (torchvision) views, drawn per sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import RandomResizedCrop

from hfmca_lightning.data import KorniaViews, MultiViewDataModule, SyntheticShapes, view_transform
from hfmca_lightning.data.device_augment import DeviceViewAugmentation
from hfmca_lightning.data.transforms import ViewAugmentation
from hfmca_lightning.errors import ConfigurationError
from tests.helpers import ks_critical, proportion_tolerance

N = 4000
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic of ``a`` and ``b``, as a fraction of its critical value at
    alpha = 1e-4 for their sizes (``ks_critical``): below 1 when they look drawn from one distribution."""
    grid = np.sort(np.concatenate([a, b]))
    statistic = float(
        np.abs(
            np.searchsorted(np.sort(a), grid, "right") / len(a) - np.searchsorted(np.sort(b), grid, "right") / len(b)
        ).max()
    )
    return statistic / ks_critical(len(a), len(b))


def device(spec: ViewAugmentation) -> DeviceViewAugmentation:
    return DeviceViewAugmentation(spec, MEAN, STD)


@pytest.mark.parametrize("crop_strength", [None, 0.5, 1.0])
def test_crop_area_and_aspect_distributions_match_torchvision(crop_strength):
    torch.manual_seed(0)
    spec = ViewAugmentation.from_strengths(32, crop_strength=crop_strength)
    crop = device(spec).pipeline[0]
    boxes = crop.forward_parameters(torch.Size([N, 3, 32, 32]))["src"]
    width = (boxes[:, 1, 0] - boxes[:, 0, 0] + 1).numpy()
    height = (boxes[:, 2, 1] - boxes[:, 1, 1] + 1).numpy()
    image = torch.zeros(3, 32, 32)
    cpu = np.array(
        [RandomResizedCrop.get_params(image, list(spec.crop_scale), list(spec.crop_ratio))[2:] for _ in range(N)],
        dtype=float,
    )
    assert ks_statistic(width * height / 1024, cpu[:, 0] * cpu[:, 1] / 1024) < 1
    assert ks_statistic(np.log(width / height), np.log(cpu[:, 1] / cpu[:, 0])) < 1


def test_colour_and_greyscale_parameters():
    torch.manual_seed(1)
    spec = ViewAugmentation.from_strengths(32)  # SimCLR defaults: jitter (0.4, 0.4, 0.4, 0.1) with p 0.8, grey p 0.2
    _, _, jitter, grey = device(spec).pipeline  # crop, flip, jitter, grey
    params = jitter.forward_parameters(torch.Size([N, 3, 32, 32]))
    uniform = np.random.default_rng(0).uniform(0.6, 1.4, N)
    for key in ("brightness_factor", "contrast_factor", "saturation_factor"):
        assert ks_statistic(params[key].numpy(), uniform) < 1, key
    assert ks_statistic(params["hue_factor"].numpy(), np.random.default_rng(1).uniform(-0.1, 0.1, N)) < 1
    assert params["batch_prob"].float().mean().item() == pytest.approx(0.8, abs=proportion_tolerance(0.8, N))
    greyed = grey.forward_parameters(torch.Size([N, 3, 32, 32]))["batch_prob"].float().mean().item()
    assert greyed == pytest.approx(0.2, abs=proportion_tolerance(0.2, N))


def test_every_view_of_the_same_image_gets_its_own_parameters():
    torch.manual_seed(2)
    image = SyntheticShapes(num_classes=2, train_per_class=1).split(True)[0][0]
    views = device(ViewAugmentation.from_strengths(32))(image[None].repeat(2, 1, 1, 1), num_views=8)
    assert views.shape == (2, 8, 3, 32, 32)
    flat = views.flatten(0, 1).flatten(1)
    assert len({tuple(row[:64].tolist()) for row in flat}) == 16


def test_device_and_cpu_views_have_the_same_pixel_statistics():
    torch.manual_seed(3)
    images = SyntheticShapes(num_classes=4, train_per_class=1).split(True).images  # (4, 3, 32, 32) uint8
    cpu_transform = view_transform(ViewAugmentation.from_strengths(32), MEAN, STD)
    cpu = torch.stack([cpu_transform(image) for image in images for _ in range(200)])
    gpu_like = device(ViewAugmentation.from_strengths(32))(images, num_views=200).flatten(0, 1)
    # per-channel statistics of two pipelines' views: sampling error ~0.01 each, uint8 truncation 0.01-0.03 (CPU)
    torch.testing.assert_close(gpu_like.mean(dim=(0, 2, 3)), cpu.mean(dim=(0, 2, 3)), atol=0.05, rtol=0)
    torch.testing.assert_close(gpu_like.std(dim=(0, 2, 3)), cpu.std(dim=(0, 2, 3)), atol=0.05, rtol=0)


def test_the_kornia_pipeline_without_kornia_is_one_clear_error(monkeypatch):
    """kornia is an optional extra: choosing its pipeline without it installed says so before anything runs."""
    import builtins
    import sys

    real_import = builtins.__import__

    def without_kornia(name, *args, **kwargs):
        if name.split(".")[0] == "kornia":
            raise ModuleNotFoundError("No module named 'kornia'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_kornia)
    for module in [name for name in sys.modules if name.split(".")[0] == "kornia"]:
        monkeypatch.delitem(sys.modules, module)
    with pytest.raises(ConfigurationError, match=r"needs kornia: pip install 'hfmca_lightning\[kornia\]'"):
        MultiViewDataModule(SyntheticShapes(), views=KorniaViews())
