"""The training set kept on the device (hfmca_lightning/data/resident.py, ``ResidentDrawer``): N batches drawn per
call, each the views of one batch at a time; nothing read on the host; a resumed epoch draws its own chunks; a split
too large for the device is one line before training. Its views equal the batched drawer's:
tests/data/test_drawers.py."""

from __future__ import annotations

from dataclasses import asdict, replace
from functools import partial
from typing import Any
from unittest import mock

import pytest
import torch

from hfmca_lightning.data import (
    ImageFolderSource,
    MultiViewDataModule,
    ResidentDrawer,
    SimCLRViews,
    SyntheticShapes,
    batched_augment,
)
from hfmca_lightning.data.datamodule import TrainingPosition
from hfmca_lightning.data.resident import ResidentBatch, stored_on_device, stored_split
from hfmca_lightning.data.transforms import resize_transform
from hfmca_lightning.diagnostics import HostReads, OperationCounts
from hfmca_lightning.errors import ConfigurationError
from tests.helpers import REPO, TrainerStandIn, drawn, epoch_batches, write_image_folder


def data(drawer: ResidentDrawer, batch_size: int = 4, **options: Any) -> MultiViewDataModule:
    views = options.pop("views", SimCLRViews(count=4))
    source = SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=2)
    return MultiViewDataModule(source, views=views, drawer=drawer, batch_size=batch_size, num_workers=0, **options)


def test_n_batches_per_call_give_the_views_of_one_batch_at_a_time():
    """ResidentDrawer(batches_per_call=N): one call draws the views of N batches; every batch equals the batch drawn
    alone, for chunks that end with a short one (8 batches in chunks of 3) and across epochs."""
    alone = data(ResidentDrawer(), batch_size=3, seed=5)
    chunked = data(ResidentDrawer(batches_per_call=3), batch_size=3, seed=5)
    for epoch_number in range(2):
        loaders = [module.train_dataloader() for module in (alone, chunked)]
        for loader in loaders:
            loader.sampler.set_epoch(epoch_number)
        first, second = [
            [drawn(module, batch) for batch in loader] for module, loader in zip((alone, chunked), loaders)
        ]
        assert len(first) == len(second) == 24 // 3
        for (views, targets), (chunk_views, chunk_targets) in zip(first, second):
            torch.testing.assert_close(chunk_views, views, rtol=0, atol=1e-6)
            assert torch.equal(chunk_targets, targets)
    batch = next(iter(chunked.train_dataloader()))
    assert isinstance(batch, ResidentBatch) and batch.indices.shape == (9,) and batch.next_indices.shape == (9,)


def test_each_batch_carries_the_next_chunks_samples_to_draw_ahead():
    """The first batch of a chunk names the next chunk's samples (what CUDA draws ahead on a side stream while the
    chunk trains; tests/cuda/test_gpu_paths.py checks those views); the last chunk of an epoch has none. Chunk numbers
    never repeat, not even in the next pass over the same module."""
    module = data(ResidentDrawer(batches_per_call=3), batch_size=3, seed=5)
    batches = list(module.train_dataloader())  # 8 batches: chunks of 3, 3 and 2
    first = batches[0].chunk
    assert [batch.chunk - first for batch in batches] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert [batch.position for batch in batches] == [0, 1, 2, 0, 1, 2, 0, 1]
    for start, following in ((0, 3), (3, 6)):
        assert torch.equal(batches[start].next_indices, batches[following].indices)
        assert torch.equal(batches[start].next_seeds, batches[following].seeds)
    assert batches[-1].next_indices.numel() == 0 and batches[-1].indices.shape == (6,)
    keys = list(module.train_dataloader().sampler.sampler)  # the epoch's (index, seed) keys, in order
    assert [int(index) for batch in batches for index in batch.names] == [index for index, _ in keys[:24]]
    assert next(iter(module.train_dataloader())).chunk > batches[-1].chunk


def test_drawing_on_the_device_reads_nothing_on_the_host_and_copies_no_python_constants(monkeypatch):
    """The training set kept on the device, the hue computed on all rows and selected (the default on GPUs): a batch's
    views come from tensors on the device alone: no host read, no tensor made from Python data."""
    module = data(
        ResidentDrawer(batches_per_call=2),
        batch_size=6,
        views=SimCLRViews(count=4, blur=[1.0, 0.1], solarize=[0.0, 0.2]),
    )
    monkeypatch.setattr(batched_augment, "jitter_views", partial(batched_augment.jitter_views, select_rows=False))
    batches = list(module.train_dataloader())
    drawn(module, batches[0])  # the first call places the images and the drawing's constants
    with HostReads() as reads, OperationCounts(torch.ops.aten.lift_fresh) as from_python:
        views, targets = drawn(module, batches[2])
    assert reads.reads == [] and from_python.count == 0
    assert views.shape == (6, 4, 3, 32, 32) and targets.shape == (6,)


def test_a_resumed_epoch_in_the_same_process_draws_its_own_chunks_not_the_interrupted_runs():
    """An epoch interrupted after two batches and resumed by the same data module (a fit, then a fit from its
    checkpoint in one process): every resumed batch has the views a fresh module draws for it, not views left over from
    the chunks the interrupted pass drew (chunks 3 batches long, resumed one batch into the second)."""

    def resumed_epoch(module: MultiViewDataModule) -> list[Any]:
        module.load_state_dict({"position": asdict(TrainingPosition(epoch=0, samples_seen=4 * 3))})
        return epoch_batches(module)

    reused = data(ResidentDrawer(batches_per_call=3), batch_size=3, seed=5)
    for _, batch in zip(range(5), reused.train_dataloader()):  # the chunks of batches 0-2 and 3-5 drawn
        drawn(reused, batch)
    fresh = data(ResidentDrawer(batches_per_call=3), batch_size=3, seed=5)
    for (views, targets), (expected_views, expected_targets) in zip(resumed_epoch(reused), resumed_epoch(fresh)):
        assert torch.equal(targets, expected_targets)
        torch.testing.assert_close(views, expected_views, rtol=0, atol=0)


def test_a_split_too_large_for_the_device_is_one_line_when_the_data_module_is_set_up(monkeypatch):
    """The data module stores the split on the trainer's device in setup, before the first batch: 24 images of
    3 KiB do not fit in half of 40 kB."""

    class OnCuda(TrainerStandIn):
        class strategy:  # noqa: N801 - an attribute of the trainer
            root_device = torch.device("cuda")

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40_000, 80_000))
    module = data(ResidentDrawer())
    module.trainer = OnCuda()  # type: ignore[assignment]
    with pytest.raises(
        ConfigurationError,
        match=r"ResidentDrawer: the training split takes 0\.0 GiB as uint8, more than half of the 0\.0 GiB free on "
        r"cuda.*\(drawer: BatchedDrawer\)",
    ) as error:
        module.setup("fit")
    assert "\n" not in str(error.value) and error.value.parameter == "drawer"


def test_images_of_another_size_are_stored_resized_like_the_workers_resize_them(tmp_path):
    write_image_folder(tmp_path, per_class=2, size=40)
    source = ImageFolderSource(str(tmp_path), image_size=32)
    split = source.training_split()
    images, targets = stored_split(split, 32)
    assert images.shape == (6, 3, 32, 32) and targets.tolist() == split.targets
    assert torch.equal(images[4], resize_transform(32)(split[4][0]))


def test_a_split_too_large_for_the_device_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40_000, 80_000))
    with pytest.raises(
        ConfigurationError,
        match=r"^ResidentDrawer: the training split takes 0\.0 GiB as uint8, more than half of the 0\.0 GiB free on "
        r"cuda.*\(drawer: BatchedDrawer\)$",
    ) as error:
        stored_on_device(torch.zeros(10, 3, 32, 32, dtype=torch.uint8), torch.device("cuda"))
    assert error.value.parameter == "drawer"


def test_every_chunk_drawn_ahead_on_a_gpu_uses_one_side_stream(monkeypatch):
    """On a CUDA device (the roofline tracer's modelled one) each chunk's successor is drawn ahead on a side stream,
    the same one for every chunk: the caching allocator reuses a block only on the stream it was freed to."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from kernel_trace.gpus import GPUS
    from kernel_trace.steps import _on_host
    from kernel_trace.trace import tracing

    with _on_host():
        module = data(ResidentDrawer(batches_per_call=2), batch_size=3)
        batches = list(module.train_dataloader())  # 8 batches: 4 chunks, 3 of them drawn ahead
    made = []
    with tracing(GPUS["h100-sxm"]):
        modelled = torch.cuda.Stream  # the tracer's, restored by it on exit

        class CountedStream(modelled):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                made.append(args)
                super().__init__(*args, **kwargs)

        with mock.patch.object(torch.cuda, "Stream", CountedStream):
            module.drawer.prepare(module.training_split, torch.device("cuda"))
            keys = ("indices", "seeds", "next_indices", "next_seeds")
            for batch in batches:
                views = module.drawer.draw(replace(batch, **{key: getattr(batch, key).to("cuda") for key in keys}))
                assert views.groups[0].shape == (3, 4, 3, 32, 32)
    assert len(made) == 1
    assert torch.cuda.Stream.__module__.startswith("torch")
