"""Every view spec x drawer x batch format: each pair draws its batch in the format's layout or is refused in one line
when the data module is made (before any training); every setting of a spec and of a drawer changes what it should,
or the pair is refused; no setting is ignored."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torchvision.transforms.functional import pil_to_tensor

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
    TransformViews,
)
from hfmca_lightning.data.batch_formats import BATCH_FORMATS
from hfmca_lightning.data.drawers import ViewDrawer
from hfmca_lightning.data.resident import ResidentBatch
from hfmca_lightning.data.view_specs import ViewSpec
from hfmca_lightning.errors import ConfigurationError
from tests.helpers import drawn

BATCH = 4


class NoisyCopies:
    """A user transform: three views, each the image plus its own noise (torch's generator)."""

    def __init__(self, count: int = 3) -> None:
        self.count = count

    def __call__(self, image: Any) -> list[Tensor]:
        pixels = pil_to_tensor(image).float() / 255
        return [pixels + 0.1 * torch.randn_like(pixels) for _ in range(self.count)]


SPECS: dict[str, Callable[..., ViewSpec]] = {
    "SimCLRViews": lambda **settings: SimCLRViews(**{"count": 3, **settings}),
    "SingleView": SingleView,
    "SameClassViews": lambda **settings: SameClassViews(**{"count": 3, **settings}),
    "MultiCrop": lambda **settings: MultiCrop(**{"global_crops": 2, "local_crops": 2, **settings}),
    "TransformViews": lambda **settings: TransformViews(**{"transform": NoisyCopies(), **settings}),
}
DRAWERS: dict[str, Callable[..., ViewDrawer]] = {
    "TorchvisionDrawer": TorchvisionDrawer,
    "BatchedDrawer(workers)": BatchedDrawer,
    "BatchedDrawer(device)": lambda **settings: BatchedDrawer(**{"on": "device", **settings}),
    "ResidentDrawer": lambda **settings: ResidentDrawer(**{"batches_per_call": 2, **settings}),
}
# which pairs draw: the batched drawers draw SimCLR views only (docs/conventions.md §5)
DRAWS = {(spec, drawer) for spec in SPECS for drawer in DRAWERS if "Torchvision" in drawer or spec == "SimCLRViews"}
VIEWS = {"SimCLRViews": 3, "SingleView": 1, "SameClassViews": 3, "MultiCrop": 4, "TransformViews": 3}


def _data(views: ViewSpec, drawer: ViewDrawer, batch_format: str = "stacked") -> MultiViewDataModule:
    source = SyntheticShapes(num_classes=2, train_per_class=6, test_per_class=2, image_size=16)
    return MultiViewDataModule(source, views=views, drawer=drawer, batch_format=batch_format, batch_size=BATCH,  # type: ignore[arg-type]
                               num_workers=0, seed=5)  # fmt: skip


def _first_batch(data: MultiViewDataModule) -> Any:
    """The first training batch as a training step gets it (device drawers: drawn in the data module's
    ``on_after_batch_transfer``)."""
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    return drawn(data, batch) if data.drawer.draws_on_device else batch


def _views(batch: Any, batch_format: str) -> list[Tensor]:
    """Every view of a batch, in order, as ``(B, C, H, W)`` tensors, checking the format's layout on the way."""
    if batch_format == "stacked":
        views, targets = batch[0], batch[1]
        assert targets.shape == (BATCH,)
        groups = views if isinstance(views, list) else [views]
        if groups[0].dim() == 4:  # SingleView: no view axis
            return [groups[0]]
        return [group[:, view] for group in groups for view in range(group.shape[1])]
    if batch_format == "lightly":
        views, targets, names = batch
        assert targets.shape == (BATCH,) and len(names) == BATCH and all(isinstance(name, str) for name in names)
        return list(views)
    if batch_format in ("dict", "dict_named"):
        assert type(batch) is dict and batch["label"].shape == (BATCH,) and batch["sample_idx"].shape == (BATCH,)
        if "views" not in batch:  # SingleView
            return [batch["image"]]
        views = batch["views"]
        if batch_format == "dict_named":
            globals_ = [key for key in views if key.startswith("global_")]
            assert list(views) == globals_ + [f"local_{i}" for i in range(len(views) - len(globals_))]
            views = list(views.values())
        assert all(torch.equal(view["label"], batch["label"]) for view in views)
        return [view["image"] for view in views]
    indexes, views, targets = batch
    assert indexes.shape == (BATCH,) and targets.shape == (BATCH,)
    return list(views)


@pytest.mark.parametrize("batch_format", BATCH_FORMATS)
@pytest.mark.parametrize("drawer", list(DRAWERS))
@pytest.mark.parametrize("spec", list(SPECS))
def test_each_pair_draws_its_batch_or_is_refused_in_one_line(spec: str, drawer: str, batch_format: str) -> None:
    if (spec, drawer) not in DRAWS:
        with pytest.raises(ConfigurationError) as refused:
            _data(SPECS[spec](), DRAWERS[drawer](), batch_format)
        message = str(refused.value)
        assert "\n" not in message and type(SPECS[spec]()).__name__ in message and "TorchvisionDrawer" in message
        assert refused.value.parameter == "drawer"
        return
    views = _views(_first_batch(_data(SPECS[spec](), DRAWERS[drawer](), batch_format)), batch_format)
    assert len(views) == VIEWS[spec]
    assert all(view.shape[0] == BATCH and view.dim() == 4 and torch.isfinite(view).all() for view in views)
    # the format only lays the views out: the stacked batch holds the same views
    stacked = _views(_first_batch(_data(SPECS[spec](), DRAWERS[drawer](), "stacked")), "stacked")
    assert all(torch.equal(got, want) for got, want in zip(views, stacked))


@pytest.mark.parametrize("batch_format", BATCH_FORMATS)
def test_crop_grids_reach_every_format_that_has_a_place_for_them(batch_format: str) -> None:
    """The same grids as the stacked batch's, or the pair refused: solo's batches dropped them without a word."""
    views = SimCLRViews(count=2, grids=2)
    if batch_format == "solo":
        with pytest.raises(ConfigurationError, match="batch_format solo, .* has no place for crop grids") as refused:
            _data(views, TorchvisionDrawer(), batch_format)
        assert refused.value.parameter == "batch_format"
        return
    batch = _first_batch(_data(views, TorchvisionDrawer(), batch_format))
    expected = _first_batch(_data(views, TorchvisionDrawer(), "stacked"))[2]  # (B, L, g, g, 2)
    if batch_format == "lightly":
        grids = torch.stack(batch[0][2:], dim=1)  # after the views
    elif batch_format in ("dict", "dict_named"):
        per_view = batch["views"].values() if batch_format == "dict_named" else batch["views"]
        grids = torch.stack([view["grid"] for view in per_view], dim=1)
    else:
        grids = batch[2]
    assert expected.shape == (BATCH, 2, 2, 2, 2) and torch.equal(grids, expected)


# A value for every setting of every spec, other than its default. Each must change the views of every drawer that
# draws the spec (same seed, same samples).
APPEARANCE = {  # the settings every SimCLR-style spec shares
    "color_strength": 1.0,
    "gray_strength": 1.0,
    "color_jitter": [0.9, 0.9, 0.9, 0.4],
    "horizontal_flip": False,
    "blur": 1.0,
    "solarize": 1.0,
}
SETTINGS: dict[str, dict[str, Any]] = {
    "SimCLRViews": {"count": 2, "crop_strength": 0.0, **APPEARANCE, "grids": 2},
    "SingleView": {"crop_strength": 0.0, **APPEARANCE},
    "SameClassViews": {"count": 2, "crop_strength": 0.0, **APPEARANCE},
    "MultiCrop": {
        "global_crops": 1,
        "local_crops": 1,
        "global_size": 12,
        "local_size": 6,
        "global_scale": (0.9, 1.0),
        "local_scale": (0.5, 0.6),
        **APPEARANCE,
    },
    "TransformViews": {"transform": NoisyCopies(count=2)},
}
SPEC_CLASSES = {"SimCLRViews": SimCLRViews, "SingleView": SingleView, "SameClassViews": SameClassViews,
                "MultiCrop": MultiCrop, "TransformViews": TransformViews}  # fmt: skip


def _parameters(cls: type) -> set[str]:
    return {name for name in inspect.signature(cls.__init__).parameters if name != "self"}


def test_every_setting_of_every_spec_and_drawer_is_exercised() -> None:
    for name, cls in SPEC_CLASSES.items():
        assert set(SETTINGS[name]) == _parameters(cls), name
    assert _parameters(BatchedDrawer) == {"on", "output_dtype", "channels_last"}
    assert _parameters(ResidentDrawer) == {"batches_per_call", "output_dtype", "channels_last"}
    assert _parameters(TorchvisionDrawer) == set()


def _all_views(batch: Any) -> list[Tensor]:
    return _views(batch, "stacked")


@pytest.mark.parametrize(
    "spec, setting", [(spec, setting) for spec, settings in SETTINGS.items() for setting in settings]
)
def test_every_spec_setting_changes_the_views_or_the_pair_is_refused(spec: str, setting: str) -> None:
    value = SETTINGS[spec][setting]
    for drawer in DRAWERS:
        if (spec, drawer) not in DRAWS:
            continue
        if spec == "SimCLRViews" and setting == "grids" and drawer != "TorchvisionDrawer":
            with pytest.raises(ConfigurationError, match="does not record crop grids"):
                _data(SPECS[spec](**{setting: value}), DRAWERS[drawer]())
            continue
        default = _first_batch(_data(SPECS[spec](), DRAWERS[drawer]()))
        changed = _first_batch(_data(SPECS[spec](**{setting: value}), DRAWERS[drawer]()))
        if setting == "grids":  # what it changes: each view comes with its grid's source positions
            assert len(default) == 2 and len(changed) == 3 and changed[2].shape == (BATCH, 3, 2, 2, 2)
            continue
        before, after = _all_views(default), _all_views(changed)
        differs = len(before) != len(after) or any(
            a.shape != b.shape or not torch.equal(a, b) for a, b in zip(before, after)
        )
        assert differs, f"{spec}({setting}={value!r}) drew the same views with {drawer}"


def test_every_drawer_setting_has_its_effect() -> None:
    spec = SPECS["SimCLRViews"]
    plain = _first_batch(_data(spec(), BatchedDrawer(on="device")))[0]
    for drawer in (BatchedDrawer(on="device", output_dtype="bfloat16"), ResidentDrawer(output_dtype="bfloat16")):
        assert _first_batch(_data(spec(), drawer))[0].dtype == torch.bfloat16
    for drawer in (BatchedDrawer(on="device", channels_last=True), ResidentDrawer(channels_last=True)):
        views = _first_batch(_data(spec(), drawer))[0]
        assert views.stride(2) == 1 and torch.equal(views, plain)  # channels innermost in each (C, H, W) view
    # where the views are drawn changes nothing in them; only what travels through the loader
    workers = _data(spec(), BatchedDrawer(on="workers"))
    device = _data(spec(), BatchedDrawer(on="device"))
    workers.setup("fit"), device.setup("fit")
    assert isinstance(next(iter(workers.train_dataloader()))[0], Tensor)
    assert not isinstance(next(iter(device.train_dataloader())), tuple)  # images to draw from after the transfer
    assert torch.equal(_first_batch(workers)[0], plain)
    # batches_per_call: the views of that many batches are drawn in one call, the same views
    for per_call in (1, 2):
        data = _data(spec(), ResidentDrawer(batches_per_call=per_call))
        data.setup("fit")
        first = next(iter(data.train_dataloader()))
        assert isinstance(first, ResidentBatch) and len(first.indices) == per_call * BATCH
        assert torch.equal(_first_batch(data)[0], plain)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: BatchedDrawer(on="workers", output_dtype="bfloat16"), "apply to views drawn on the device"),
        (lambda: BatchedDrawer(on="gpu"), "on must be one of workers, device"),  # type: ignore[arg-type]
        (lambda: ResidentDrawer(batches_per_call=0), "batches_per_call must be >= 1"),
        (lambda: ResidentDrawer(output_dtype="float16"), "output_dtype must be"),  # type: ignore[arg-type]
        (lambda: SimCLRViews(count=0), "count must be >= 1"),
        (lambda: SimCLRViews(color_strength=0.5, color_jitter=[0.4, 0.4, 0.2, 0.1]), "set one of them"),
        (lambda: SameClassViews(gray_strength=2.0), "gray_strength must be in"),
        (lambda: MultiCrop(global_crops=0, local_crops=0), "at least one crop"),
        (lambda: MultiCrop(local_scale=(0.5, 0.2)), "local_scale"),
        (lambda: SingleView(blur=1.5), "blur is a probability"),
        (lambda: SingleView(blur=[1.0, 0.0]), "blur gives 2 view kinds for 1 view"),
        (lambda: SimCLRViews(count=2, solarize=[0.0, 0.2, 0.4]), "solarize gives 3 view kinds for 2 view"),
        (lambda: MultiCrop(1, 1, blur=[1.0, 0.5, 0.0]), "blur gives 3 view kinds for 2 view"),
        (lambda: _data(SimCLRViews, TorchvisionDrawer()), r"views is the class SimCLRViews; give an instance"),
        (lambda: TransformViews(transform=3), "needs a callable"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_setting_is_refused_in_one_line_when_made(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as refused:
        make()
    assert "\n" not in str(refused.value)


def test_a_transform_that_does_not_return_view_tensors_is_one_line_before_training() -> None:
    def pil_views(image: Any) -> list[Any]:
        return [image, image]

    with pytest.raises(ConfigurationError, match="pil_views must return a list of .C, H, W. view tensors") as error:
        _data(pil_views, TorchvisionDrawer()).setup("fit")
    assert "\n" not in str(error.value) and error.value.parameter == "views"


def test_one_transform_spec_serves_data_modules_of_different_sizes() -> None:
    def patches(image: Any) -> list[Tensor]:  # as many 8-px patches as the image holds
        pixels = pil_to_tensor(image).float()
        return [tile for row in pixels.split(8, dim=1) for tile in row.split(8, dim=2)]

    spec = TransformViews(patches)
    small = _data(spec, TorchvisionDrawer())
    large = MultiViewDataModule(SyntheticShapes(num_classes=2, train_per_class=6, image_size=32), views=spec,
                                batch_size=BATCH, num_workers=0)  # fmt: skip
    for module, count in ((small, 4), (large, 16)):
        module.setup("fit")
        assert module.num_views == count == len(_views(_first_batch(module), "stacked"))
