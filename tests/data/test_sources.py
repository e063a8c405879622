import numpy as np
import pytest
import torch

from hfmca_lightning.data import CIFAR, ImageFolderSource, SyntheticShapes
from hfmca_lightning.errors import ConfigurationError
from tests.factories import write_cifar, write_image_folder


@pytest.mark.parametrize(("name", "classes"), [("cifar10", 10), ("cifar100", 100)])
def test_cifar_pickles_load_through_the_real_layout(tmp_path, name, classes):
    write_cifar(tmp_path, name, per_class=2)
    source = CIFAR(name=name, root=str(tmp_path), verify=False)
    source.prepare()
    train, test = source.split(train=True), source.split(train=False)
    assert source.num_classes == classes
    batches = 5 if name == "cifar10" else 1
    assert len(train) == 2 * batches * 10  # per_class images per batch file, 10 classes written
    image, target = train[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
    assert 0 <= target < 10
    assert len(test) == 20


def test_cifar_pixels_are_decoded_in_channel_order(tmp_path):
    folder = write_cifar(tmp_path, "cifar10", per_class=1)
    import pickle

    with open(folder / "test_batch", "rb") as handle:
        raw = pickle.load(handle, encoding="latin1")
    image, _ = CIFAR(root=str(tmp_path), verify=False).split(train=False)[3]
    expected = torch.from_numpy(np.asarray(raw["data"][3]).reshape(3, 32, 32))
    assert torch.equal(image, expected)


def test_cifar_checksums_are_verified_by_default(tmp_path):
    write_cifar(tmp_path, "cifar10", per_class=1)
    with pytest.raises(ConfigurationError, match="md5 sum of the official cifar10 release.*verify: false"):
        CIFAR(root=str(tmp_path)).prepare()


def test_missing_cifar_says_where_it_looked_and_how_to_fix_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"looked for .*cifar-10-batches-py/data_batch_1.*download: true"):
        CIFAR(root=str(tmp_path / "nowhere")).prepare()


def test_failed_download_is_one_clear_error(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr("hfmca_lightning.data.sources.download_and_extract_archive", offline)
    with pytest.raises(ConfigurationError, match="could not download cifar100.*network is unreachable.*copy the extracted"):
        CIFAR(name="cifar100", root=str(tmp_path), download=True).prepare()


def test_image_folder_tree(tmp_path):
    write_image_folder(tmp_path, per_class=3, num_classes=2)
    source = ImageFolderSource(root=str(tmp_path))
    train = source.split(train=True)
    assert len(train) == 6 and source.num_classes == 2
    assert sorted(set(train.targets)) == [0, 1]


def test_unreadable_image_is_named(tmp_path):
    write_image_folder(tmp_path, per_class=2, num_classes=2)
    broken = tmp_path / "train" / "class_1" / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(ConfigurationError, match=r"cannot read image .*broken\.png"):
        ImageFolderSource(root=str(tmp_path)).split(train=True)


def test_missing_image_folder_split(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"looked for .*train"):
        ImageFolderSource(root=str(tmp_path)).split(train=True)


def test_synthetic_shapes_are_deterministic_and_balanced():
    first = SyntheticShapes(num_classes=5, train_per_class=3, seed=7).split(train=True)
    second = SyntheticShapes(num_classes=5, train_per_class=3, seed=7).split(train=True)
    other = SyntheticShapes(num_classes=5, train_per_class=3, seed=8).split(train=True)
    assert torch.equal(first.images, second.images) and not torch.equal(first.images, other.images)
    assert np.bincount(first.targets).tolist() == [3] * 5
    test = SyntheticShapes(num_classes=5, test_per_class=2, seed=7).split(train=False)
    assert len(test) == 10 and not torch.equal(test.images[:2], first.images[:2])


def test_synthetic_shapes_reject_too_many_classes():
    with pytest.raises(ValueError, match="num_classes must be in"):
        SyntheticShapes(num_classes=11)
