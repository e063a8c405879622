"""The views a seed draws, pinned: every view spec, drawer and setting draws the views it drew when these
fingerprints were recorded (tests/data/view_fingerprints.json), so that a rework of the data code can show it changed
no draw. A fingerprint is each batch's shape, sum, sum of squares and a few values at fixed places: the augmentations'
float32 arithmetic may differ in its last bits from one CPU to another (vectorised resampling and blending), while
another draw moves every one of them by far more than the tolerance.

Record again only for a change that is meant to change the views: ``python tests/data/test_view_fingerprints.py``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hfmca_lightning.data import (
    BatchedDrawer,
    MultiCrop,
    MultiViewDataModule,
    ResidentDrawer,
    SameClassViews,
    SimCLRViews,
    SingleView,
    SyntheticShapes,
    TorchvisionDrawer,
)
from hfmca_lightning.data.sources import ImageSource
from hfmca_lightning.evaluation_data import view_batches

FINGERPRINTS = Path(__file__).with_name("view_fingerprints.json")
PLACES = 12  # values kept per batch, at evenly spaced flat indices
RELATIVE = 1e-4  # of the batch's largest magnitude: float32 resampling and blends on another CPU


def _source() -> ImageSource:
    return SyntheticShapes(num_classes=4, train_per_class=6, test_per_class=2, image_size=16)


def _module(**settings: Any) -> Callable[[], MultiViewDataModule]:
    def build() -> MultiViewDataModule:
        options = {"views": SimCLRViews(count=4), "batch_size": 4, "num_workers": 0, "seed": 3, **settings}
        return MultiViewDataModule(_source(), **options)

    return build


STRENGTHS = {"crop_strength": 0.5, "color_strength": 0.8, "gray_strength": 0.5, "blur": 0.5, "solarize": 0.2}
CASES: dict[str, Callable[[], MultiViewDataModule]] = {
    "torchvision": _module(drawer=TorchvisionDrawer()),
    "torchvision, strengths": _module(views=SimCLRViews(count=4, **STRENGTHS)),
    "torchvision, color_jitter, no flip": _module(
        views=SimCLRViews(count=4, color_jitter=[0.4, 0.4, 0.2, 0.1], horizontal_flip=False)
    ),
    "torchvision, crop grids": _module(views=SimCLRViews(count=4, grids=3)),
    "batched in workers": _module(drawer=BatchedDrawer()),
    "batched in workers, strengths": _module(
        views=SimCLRViews(count=4, color_strength=0.8, blur=0.5, solarize=0.2), drawer=BatchedDrawer()
    ),
    "batched on the device": _module(drawer=BatchedDrawer(on="device")),
    "resident": _module(drawer=ResidentDrawer(batches_per_call=2)),
    "multi-crop": _module(views=MultiCrop(global_crops=2, local_crops=2, global_size=16, local_size=8)),
    "same class": _module(views=SameClassViews(count=4)),
    "single": _module(views=SingleView()),
}


def fingerprint(build: Callable[[], MultiViewDataModule]) -> list[dict[str, Any]]:
    """Two training batches of the case on the CPU: each group's shape, sums and values at fixed places, and the
    samples' indices."""
    data = build()
    data.setup("fit")
    prints = []
    for batch in view_batches(data, torch.device("cpu"), limit=2):
        for group in batch.groups:
            flat = group.detach().double().flatten()
            places = torch.linspace(0, flat.numel() - 1, PLACES).long()
            prints.append(
                {
                    "shape": list(group.shape),
                    "sum": float(flat.sum()),
                    "squares": float((flat * flat).sum()),
                    "largest": float(flat.abs().max()),
                    "values": flat[places].tolist(),
                    "indices": batch.indices.tolist(),
                }
            )
        if batch.grids is not None:  # VICRegL's source positions of each view's grid
            grids = batch.grids.detach().double()
            prints.append({"shape": list(grids.shape), "sum": float(grids.sum()), "squares": float((grids**2).sum()),
                           "largest": float(grids.abs().max()), "values": grids.flatten()[:PLACES].tolist(),
                           "indices": batch.indices.tolist()})  # fmt: skip
    return prints


@pytest.mark.parametrize("case", list(CASES))
def test_each_pipeline_draws_the_views_it_drew_when_recorded(case: str) -> None:
    recorded = json.loads(FINGERPRINTS.read_text())[case]
    drawn = fingerprint(CASES[case])
    assert len(drawn) == len(recorded)
    for got, want in zip(drawn, recorded):
        assert got["shape"] == want["shape"] and got["indices"] == want["indices"]
        scale = want["largest"] * RELATIVE
        assert got["values"] == pytest.approx(want["values"], abs=scale)
        elements = torch.tensor(want["shape"]).prod().item()
        assert got["sum"] == pytest.approx(want["sum"], abs=scale * elements)
        assert got["squares"] == pytest.approx(want["squares"], abs=2 * want["largest"] * scale * elements)


if __name__ == "__main__":  # record
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    FINGERPRINTS.write_text(json.dumps({case: fingerprint(build) for case, build in CASES.items()}, indent=1) + "\n")
    print(f"recorded {len(CASES)} cases into {FINGERPRINTS}")
