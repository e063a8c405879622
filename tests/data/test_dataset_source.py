"""Any torch Dataset of (image, target) pairs as a source (hfmca_lightning.data.dataset_source): its images reach the
views as the other sources' do, whatever form they come in, and from YAML as from Python."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from hfmca_lightning.data import DatasetSource, MultiViewDataModule, SimCLRViews
from hfmca_lightning.data.dataset_source import as_uint8_image
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation_data import view_batches


class PairsOfPIL(Dataset):
    """``n`` PIL images of 20 px whose colour is their index, target ``index % 3``; no ``targets`` attribute."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.new("RGB", (20, 20), (index, 2 * index, 3 * index)), index % 3


def test_a_dataset_of_pil_images_gives_batches_of_views_and_its_targets() -> None:
    data = MultiViewDataModule(
        DatasetSource(PairsOfPIL(12), PairsOfPIL(6), image_size=16),
        views=SimCLRViews(count=2),
        batch_size=4,
        num_workers=0,
    )
    data.setup("fit")
    (batch,) = list(view_batches(data, torch.device("cpu"), limit=1))
    assert batch.groups[0].shape == (4, 2, 3, 16, 16)
    assert batch.targets.tolist() == [int(index) % 3 for index in batch.indices]
    assert data.source.num_classes == 3
    bank, queries = data.source.evaluation_splits()
    assert (len(bank), len(queries)) == (12, 6) and queries.targets == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize(
    "image",
    [
        Image.new("RGB", (5, 4), (10, 20, 30)),
        np.tile(np.array([10, 20, 30], dtype=np.uint8), (4, 5, 1)),
        torch.tensor([10, 20, 30], dtype=torch.uint8)[:, None, None].expand(3, 4, 5),
        torch.tensor([10, 20, 30], dtype=torch.float32)[:, None, None].expand(3, 4, 5) / 255,
    ],
    ids=["PIL", "array HWC", "uint8 CHW", "float CHW"],
)
def test_every_image_form_becomes_the_same_uint8_image(image: object) -> None:
    converted = as_uint8_image(image)
    assert converted.dtype == torch.uint8 and converted.shape == (3, 4, 5)
    assert converted[:, 0, 0].tolist() == [10, 20, 30] and bool((converted == converted[:, :1, :1]).all())


def test_greyscale_is_repeated_over_the_three_channels_and_bad_forms_are_one_line() -> None:
    assert as_uint8_image(torch.full((4, 5), 7, dtype=torch.uint8)).shape == (3, 4, 5)
    assert as_uint8_image(Image.new("L", (5, 4), 7))[:, 0, 0].tolist() == [7, 7, 7]
    for bad, message in (
        (torch.zeros(4, 4, 4), r"shape \(4, 4, 4\)"),
        (torch.zeros(3, 4, 4, dtype=torch.int64), "torch.int64"),
        ("image.png", "a str"),
        # normalised images, or floats in [0, 255]: clamped to [0, 1] before, mostly black or white without a word
        ((torch.rand(3, 4, 4) - 0.5) / 0.25, "holds values from -.* to .*; give floats in \\[0, 1\\], not normalised"),
        (torch.rand(3, 4, 4) * 255, "divide by 255"),
        (torch.full((3, 4, 4), float("nan")), "holds values from nan"),
    ):
        with pytest.raises(ConfigurationError, match=message):
            as_uint8_image(bad)


def test_a_source_without_a_test_split_has_no_evaluation_and_wrong_inputs_are_one_line() -> None:
    source = DatasetSource(PairsOfPIL(6))
    assert source.evaluation_splits() is None and source.num_classes == 3
    with pytest.raises(ConfigurationError, match="no test split"):
        source.split(train=False)
    with pytest.raises(ConfigurationError, match="train must be a data set with a length and indexing; got int"):
        DatasetSource(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="num_classes 2 does not hold the training targets"):
        DatasetSource(PairsOfPIL(6), num_classes=2)
    images = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    with pytest.raises(ConfigurationError, match=r"^TensorDataset\[0\] is a tuple of 1; DatasetSource needs \(image, "):
        DatasetSource(torch.utils.data.TensorDataset(images))  # the targets left out


class Labelled(Dataset):
    """Images of 8 px with the given targets."""

    def __init__(self, targets: list[int]) -> None:
        self.targets = targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(3, 8, 8, dtype=torch.uint8), self.targets[index]


def test_targets_that_evaluation_cannot_use_are_one_line_before_training() -> None:
    """Before: test targets outside the training classes scored kNN 0 (or a torchmetrics traceback after an epoch),
    and unlabelled training images in the kNN bank an index error after an epoch."""
    with pytest.raises(ConfigurationError, match="a training target is -2; targets are class indices >= 0, or -1"):
        DatasetSource(Labelled([0, 1, -2]), image_size=8)
    with pytest.raises(ConfigurationError, match="1 training images have no class .* label them, or leave out test"):
        DatasetSource(Labelled([0, 1, -1]), Labelled([0, 1]), image_size=8)
    source = DatasetSource(Labelled([0, 1, 2]), Labelled([0, 11, 12]), image_size=8)
    with pytest.raises(ConfigurationError, match="2 test targets are outside the 3 classes .* \\(e.g. 11\\)"):
        source.evaluation_splits()
    unlabelled = DatasetSource(Labelled([-1, -1]), image_size=8)  # no classes, no evaluation: training only
    assert unlabelled.num_classes == 0 and unlabelled.evaluation_splits() is None


class Shifted(Labelled):
    """Targets ``t`` in ``targets``, ``t + 3`` in the pairs: a torchvision data set with a ``target_transform``."""

    def __init__(self, targets: list[int]) -> None:
        super().__init__(targets)
        self.target_transform = lambda target: target + 3

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(3, 8, 8, dtype=torch.uint8), self.target_transform(self.targets[index])


class Targets(Labelled):
    """Pairs whose targets are as given (any type), without a ``targets`` attribute."""

    def __init__(self, targets: list[object]) -> None:
        self.given = targets

    def __len__(self) -> int:
        return len(self.given)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, object]:
        return torch.zeros(3, 8, 8, dtype=torch.uint8), self.given[index]


def test_the_pairs_targets_count_and_a_target_that_is_no_class_index_is_one_line() -> None:
    """A ``target_transform`` changes the pairs' targets, not the ``targets`` attribute: the split, every drawer and
    kNN use the pairs' (before: the attribute's, so training, kNN and the class count disagreed). Integer targets of
    any kind (floats of integer value too) are class indices; fractions, strings, None and multi-hot tensors are one
    line (before: 0.5 became 0)."""
    source = DatasetSource(Shifted([0, 1, 2]), Shifted([2, 1]), image_size=8)
    assert source.num_classes == 6 and source.split(True).targets == [3, 4, 5]
    assert [source.split(True)[index][1] for index in range(3)] == [3, 4, 5]
    assert [source.split(False)[index][1] for index in range(2)] == [5, 4]
    integers = DatasetSource(
        Targets([0, np.int64(1), torch.tensor(2), np.array(1), 2.0, torch.tensor(1.0)]), image_size=8
    )
    assert integers.split(True).targets == [0, 1, 2, 1, 2, 1]
    for target in (0.5, torch.tensor(1.5), float("nan"), "cat", None, torch.tensor([0, 1])):
        with pytest.raises(ConfigurationError, match="the target of sample 1 is .*, not a class index"):
            DatasetSource(Targets([0, target]), image_size=8)


def test_torchvision_data_sets_come_from_yaml_as_class_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchvision's FakeData (PIL images, no ``targets``) named in a config, as a user writes it."""
    from hfmca_lightning.cli.trainer_cli import HFMCACLI
    from tests.helpers import DEMO

    fake = {"class_path": "torchvision.datasets.FakeData", "init_args": {"size": 10, "image_size": [3, 20, 20]}}
    source = {"class_path": "hfmca_lightning.data.DatasetSource", "init_args": {"train": fake, "image_size": 16}}
    monkeypatch.chdir(tmp_path)
    cli = HFMCACLI(args=["--config", str(DEMO), "--data.init_args.source", json.dumps(source)], run=False)
    assert isinstance(cli.datamodule.source, DatasetSource)
    assert len(cli.datamodule.source.split(train=True)) == 10
