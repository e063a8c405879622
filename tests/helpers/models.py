"""Small models and data several tests share."""

from __future__ import annotations

import torch

from hfmca_lightning.data import MultiViewDataModule, SimCLRViews, SyntheticShapes
from hfmca_lightning.losses import HFMCACost
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.models import GridExternalHead, SpectrumCNN
from hfmca_lightning.models.layers import PaddingLayer


def tiny_spectrum_module(noise_channels: int = 2) -> HFMCAModule:
    backbone = SpectrumCNN(channels=6, hidden_dim=12, noise_channels=noise_channels)
    return HFMCAModule(
        backbone,
        external_head=GridExternalHead(6, 2, 2, 12, noise_channels=noise_channels),
        external_cost=HFMCACost(reg=1e-3, beta=0.5, name="external"),
        internal_costs=InternalCosts(backbone.internal_layers, reg=1e-3, beta=0.5),
    )


def tiny_data() -> MultiViewDataModule:
    return MultiViewDataModule(
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=3),
        views=SimCLRViews(count=4),
        batch_size=6,
        num_workers=0,
    )


def block_sizes(model: SpectrumCNN, image_size: int) -> dict[str, tuple[int, int, int]]:
    """``{block: (input size, padded size, output size)}`` of one forward pass on square images."""
    sizes: dict[str, list[int]] = {}
    handles = []
    for name, block in model.blocks.named_children():
        if not name.startswith("L"):
            continue
        padding = next(module for module in block.modules() if isinstance(module, PaddingLayer))
        handles.append(
            block.register_forward_hook(
                lambda _m, inputs, output, name=name: sizes.setdefault(name, []).extend(
                    [inputs[0].shape[-1], output.shape[-1]]
                )
            )
        )
        handles.append(
            padding.register_forward_hook(
                lambda _m, _i, output, name=name: sizes.setdefault(name + "/padded", []).append(output.shape[-1])
            )
        )
    with torch.no_grad():
        features = model.eval()(torch.rand(2, 3, image_size, image_size))
    for handle in handles:
        handle.remove()
    assert features.shape == (2, model.feature_dim)
    return {name: (sizes[name][0], sizes[name + "/padded"][0], sizes[name][1]) for name in sizes if "/" not in name}
