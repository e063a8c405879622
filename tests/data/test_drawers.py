"""Drawers (hfmca_lightning/data/drawers.py) through the data module, as training draws them: the same views wherever
and however they are drawn, per-sample seeds, output layouts, and one line, when the data module is made, for a spec
a drawer cannot draw. The training set kept on the device: tests/data/test_resident.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hfmca_lightning.data import (
    CIFAR,
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
from hfmca_lightning.data.drawers import check_drawer
from hfmca_lightning.errors import ConfigurationError
from tests.helpers import drawn, epoch_batches


def data(views: Any = None, drawer: Any = None, batch_size: int = 4, workers: int = 0, **options: Any):
    source = options.pop("source", SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2))
    views = SimCLRViews(count=4) if views is None else views
    return MultiViewDataModule(
        source, views=views, drawer=drawer, batch_size=batch_size, num_workers=workers, **options
    )


def test_batched_views_are_the_same_in_workers_on_the_device_and_alone(cifar10_on_disk):
    """Every batch of an epoch (CIFAR's layout on disk): the batched drawer in 2 workers, on the device after the
    transfer, and with the training set kept on the device (in chunks of 1 and 3 batches) give the same views and
    targets; each image's views equal a call for that image alone with its seed."""
    source = CIFAR(root=str(cifar10_on_disk), verify=False)
    paths = {
        "workers": data(drawer=BatchedDrawer(), batch_size=8, workers=2, source=source, seed=3),
        "device": data(drawer=BatchedDrawer(on="device"), batch_size=8, workers=2, source=source, seed=3),
        "resident": data(drawer=ResidentDrawer(), batch_size=8, workers=2, source=source, seed=3),
        "resident, 3 per call": data(drawer=ResidentDrawer(batches_per_call=3), batch_size=8, source=source, seed=3),
    }
    assert paths["resident"].train_dataloader().num_workers == 0  # a batch is its indices and seeds
    epochs = {name: epoch_batches(module) for name, module in paths.items()}
    reference = epochs.pop("workers")
    assert len(reference) == 100 // 8
    for name, batches in epochs.items():
        assert len(batches) == len(reference), name
        for (views, targets), (expected_views, expected_targets) in zip(batches, reference):
            torch.testing.assert_close(views, expected_views, rtol=0, atol=0, msg=name)
            assert torch.equal(targets, expected_targets), name
    module = paths["workers"]
    keys = list(module.train_dataloader().sampler)[:8]
    augmentation = module.drawer.augmentation
    for row, (index, seed) in enumerate(keys):
        image = module.training_split[index][0]
        alone = augmentation.views_from_seeds(image[None], torch.tensor([seed]), 4)[0]
        torch.testing.assert_close(reference[0][0][row], alone, rtol=0, atol=1e-6)


def test_views_do_not_depend_on_the_workers_or_the_batch_composition():
    for make_views, make_drawer in (
        (lambda: SimCLRViews(count=4), TorchvisionDrawer),
        (lambda: SimCLRViews(count=4), BatchedDrawer),
        (lambda: MultiCrop(1, 3), TorchvisionDrawer),
    ):
        serial = next(iter(data(make_views(), make_drawer()).train_dataloader()))
        parallel = next(iter(data(make_views(), make_drawer(), workers=2).train_dataloader()))
        torch.testing.assert_close(parallel, serial, rtol=0, atol=0)
    pairs = list(data(drawer=BatchedDrawer(), batch_size=2).train_dataloader())[:2]
    fours = next(iter(data(drawer=BatchedDrawer(), batch_size=4).train_dataloader()))
    torch.testing.assert_close(torch.cat([pairs[0][0], pairs[1][0]]), fours[0], rtol=0, atol=1e-6)


def test_device_drawers_emit_bf16_channels_last_views_when_asked():
    for drawer in (
        BatchedDrawer(on="device", output_dtype="bfloat16", channels_last=True),
        ResidentDrawer(2, "bfloat16", True),
    ):
        module = data(drawer=drawer)
        images, _ = drawn(module, next(iter(module.train_dataloader())))
        flat = images.flatten(0, 1)
        assert images.dtype == torch.bfloat16 and flat.is_contiguous(memory_format=torch.channels_last)
        reference = data(drawer=BatchedDrawer())
        expected, _ = next(iter(reference.train_dataloader()))
        torch.testing.assert_close(images.float(), expected, rtol=2**-8, atol=2**-8 * float(expected.abs().max()))


def test_a_drawer_draws_the_spec_of_its_data_module():
    """The data module draws with its own copy of the drawer, set up with its spec; the drawer given stays unbound."""
    views, drawer = SimCLRViews(count=3), BatchedDrawer()
    module = data(views, drawer)
    assert module.drawer is not drawer and type(module.drawer) is BatchedDrawer
    assert module.drawer.setup.views is views and module.drawer.setup.image_size == 32
    assert module.drawer.setup.normalisation == (module.source.mean, module.source.std)
    with pytest.raises(RuntimeError, match="BatchedDrawer has no views to draw: use the one a MultiViewDataModule"):
        _ = drawer.setup
    assert isinstance(data().drawer, TorchvisionDrawer)  # the default


@pytest.mark.parametrize("make", [BatchedDrawer, lambda: BatchedDrawer(on="device"), ResidentDrawer])
def test_one_drawer_configures_two_data_modules_each_with_its_own_views(make):
    shared = make()
    small = SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2, image_size=16)
    modules = [data(SimCLRViews(count=2), shared), MultiViewDataModule(small, views=SimCLRViews(count=5), drawer=shared,
               batch_size=6, num_workers=0)]  # fmt: skip
    alone = [data(SimCLRViews(count=2), make()), MultiViewDataModule(small, views=SimCLRViews(count=5), drawer=make(),
             batch_size=6, num_workers=0)]  # fmt: skip
    for module, reference in zip(modules, alone):
        got, want = epoch_batches(module)[0][0], epoch_batches(reference)[0][0]
        assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: BatchedDrawer(on="gpu"), "BatchedDrawer: on must be one of workers, device; got 'gpu'"),
        (lambda: BatchedDrawer(output_dtype="bfloat16"), "output_dtype and channels_last apply to views drawn"),
        (lambda: BatchedDrawer(channels_last=True), "output_dtype and channels_last apply to views drawn"),
        (lambda: BatchedDrawer(output_dtype="float16"), "output_dtype must be one of float32, bfloat16"),
        (lambda: ResidentDrawer(output_dtype="float16"), "output_dtype must be one of float32, bfloat16"),
        (lambda: ResidentDrawer(batches_per_call=0), "ResidentDrawer: batches_per_call must be >= 1; got 0"),
        (
            lambda: data(SameClassViews(count=2), BatchedDrawer()),
            "BatchedDrawer draws SimCLRViews only; SameClassViews is drawn by TorchvisionDrawer",
        ),
        (
            lambda: data(SingleView(), ResidentDrawer()),
            "ResidentDrawer draws SimCLRViews only; SingleView is drawn by TorchvisionDrawer",
        ),
        (
            lambda: data(MultiCrop(2, 2), BatchedDrawer(on="device")),
            "BatchedDrawer draws SimCLRViews only; MultiCrop is drawn by TorchvisionDrawer",
        ),
        (
            lambda: data(TransformViews(lambda image: [image]), ResidentDrawer()),
            "ResidentDrawer draws SimCLRViews only; TransformViews is drawn by TorchvisionDrawer",
        ),
        (
            lambda: data(SimCLRViews(count=2, grids=4), BatchedDrawer()),
            r"BatchedDrawer does not record crop grids; SimCLRViews\(grids=4\) is drawn by TorchvisionDrawer",
        ),
        (
            lambda: data(SimCLRViews(count=2, grids=4), ResidentDrawer()),
            r"ResidentDrawer does not record crop grids; SimCLRViews\(grids=4\)",
        ),
    ],
    ids=[
        "where",
        "workers in bf16",
        "workers channels-last",
        "float16",
        "resident float16",
        "batches per call",
        "batched same-class",
        "resident single",
        "batched multi-crop",
        "resident transform",
        "batched grids",
        "resident grids",
    ],
)
def test_what_a_drawer_cannot_do_is_one_line_before_anything_runs(make, message, request):
    with pytest.raises(ConfigurationError, match=message) as error:
        make()
    # a drawer's own argument is named by itself (data.init_args.drawer.init_args.<it>); a pair by the drawer
    own = {
        "where": "on",
        "workers in bf16": "output_dtype",
        "workers channels-last": "channels_last",
        "float16": "output_dtype",
        "resident float16": "output_dtype",
        "batches per call": "batches_per_call",
    }
    assert "\n" not in str(error.value) and error.value.parameter == own.get(request.node.callspec.id, "drawer")


def test_the_torchvision_drawer_draws_every_spec():
    for views in (
        SimCLRViews(count=2, grids=3),
        SingleView(),
        SameClassViews(count=2),
        MultiCrop(1, 1),
        TransformViews(lambda image: [image]),
    ):
        check_drawer(views, TorchvisionDrawer())  # no error
    check_drawer(SimCLRViews(count=5), BatchedDrawer())
    check_drawer(SimCLRViews(count=5), ResidentDrawer())
