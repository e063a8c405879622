import os
import pickle
import re
import shutil
import signal
import struct
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, UnidentifiedImageError

from hfmca_lightning.data import (
    CIFAR,
    STL10,
    DatasetSource,
    ImageFolderSource,
    MultiViewDataModule,
    SyntheticShapes,
    UnlabelledFolderSource,
    archive_sources,
)
from hfmca_lightning.data.folder_sources import PIL_FORMATS
from hfmca_lightning.data.sources import UNLABELLED
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning
from tests.helpers import fit, write_cifar, write_image_folder, write_stl10


class TookTooLong(Exception):
    """Not an ``OSError`` (as ``TimeoutError`` is), which ``os.walk`` would swallow."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Fail with :class:`TookTooLong` after ``seconds`` instead of hanging (SIGALRM: main thread, Python code)."""

    def expire(signum: int, frame: object) -> None:
        raise TookTooLong(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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


def rewrite_cifar_batches(folder: Path, protocol: int, numpy_module: bytes | None = None) -> None:
    """Write every batch of ``folder`` again with pickle ``protocol``; ``numpy_module``: the module name numpy 1.x
    (and the official release) pickles ``_reconstruct`` under (protocols 0-2 name it in plain text)."""
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            entry = pickle.load(handle)
        payload = pickle.dumps(entry, protocol=protocol)
        if numpy_module is not None:
            assert b"numpy._core.multiarray\n_reconstruct" in payload or "data" not in entry
            payload = payload.replace(b"numpy._core.multiarray\n", numpy_module + b"\n")
        path.write_bytes(payload)


@pytest.mark.parametrize(
    ("protocol", "numpy_module"), [(2, None), (2, b"numpy.core.multiarray"), (5, None)], ids=["2", "2-numpy1", "5"]
)
def test_cifar_batches_load_whichever_protocol_and_numpy_wrote_them(tmp_path, protocol, numpy_module):
    reference = CIFAR(root=str(write_cifar(tmp_path / "reference", per_class=1).parent), verify=False)
    folder = write_cifar(tmp_path / "rewritten", per_class=1)
    rewrite_cifar_batches(folder, protocol, numpy_module)
    source = CIFAR(root=str(folder.parent), verify=False)
    for train in (True, False):
        expected, got = reference.split(train), source.split(train)
        assert torch.equal(got.images, expected.images) and got.targets == expected.targets


class WritesFile:
    """Unpickled, runs code that creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return exec, (f"open({str(self.path)!r}, 'w').close()",)


def test_a_cifar_batch_that_would_run_code_is_refused_in_one_line_and_never_runs(cifar10_on_disk, tmp_path, capsys):
    marker = tmp_path / "ran"
    payload = pickle.dumps({"data": WritesFile(marker), "labels": [0]})
    pickle.loads(payload)  # the payload works: plain pickle runs it
    assert marker.is_file()
    marker.unlink()
    batch = cifar10_on_disk / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(payload)
    source = {"class_path": "hfmca_lightning.data.CIFAR", "init_args": {"root": str(cifar10_on_disk), "verify": False}}
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path, **{"data.init_args.source": source})
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    [line] = [line for line in err.splitlines() if line.startswith("hfmca: error: ")]
    assert f"{batch} is not a CIFAR batch: its pickle refers to builtins.exec" in line, err
    assert "Traceback" not in err and not marker.exists()
    assert not (tmp_path / "checkpoints").exists(), "training started"


def test_cifar_checksums_are_verified_by_default(tmp_path):
    write_cifar(tmp_path, "cifar10", per_class=1)
    with pytest.raises(ConfigurationError, match="md5 sum of the official cifar10 release.*verify: false"):
        CIFAR(root=str(tmp_path)).prepare()


def test_a_cifar_data_module_checks_each_file_once_and_reads_each_split_once(tmp_path, monkeypatch):
    """prepare_data, setup and the evaluation splits all ask for the data: the md5 pass (every byte of the release)
    runs once per process, and the training split, which is also the kNN bank, is unpickled once."""
    write_cifar(tmp_path, "cifar10", per_class=2)
    checked: list[str] = []
    monkeypatch.setattr(archive_sources, "check_integrity", lambda path, md5: checked.append(path) or True)
    read = Counter()
    unpickle = archive_sources._read_cifar_batch

    def counted(path: Path, label_key: str) -> tuple:
        read.update([path.name])
        return unpickle(path, label_key)

    monkeypatch.setattr(archive_sources, "_read_cifar_batch", counted)
    data = MultiViewDataModule(CIFAR(root=str(tmp_path)), batch_size=4, num_workers=0)
    data.prepare_data()
    data.setup("fit")
    bank, queries = data.evaluation_splits
    assert bank is data.training_split and len(queries) == 20
    assert sorted(checked) == sorted({*checked}) and len(checked) == 6  # 5 training batches and the test batch
    assert set(read.values()) == {1} and len(read) == 6


def test_missing_cifar_says_where_it_looked_and_how_to_fix_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"looked for .*cifar-10-batches-py/data_batch_1.*download: true"):
        CIFAR(root=str(tmp_path / "nowhere")).prepare()


def test_failed_download_is_one_clear_error(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr("hfmca_lightning.data.archive_sources.download_and_extract_archive", offline)
    with pytest.raises(
        ConfigurationError, match="could not download cifar100.*network is unreachable.*copy the extracted"
    ):
        CIFAR(name="cifar100", root=str(tmp_path), download=True).prepare()


def test_image_folder_tree(tmp_path):
    write_image_folder(tmp_path, per_class=3, num_classes=2)
    source = ImageFolderSource(root=str(tmp_path))
    train = source.split(train=True)
    assert len(train) == 6 and source.num_classes == 2
    assert sorted(set(train.targets)) == [0, 1]
    image, target = train[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 40, 40) and target == 0


def looped_image_folder(root: Path, per_class: int) -> Path:
    """``write_image_folder`` with links that loop: ``self -> .`` and ``up -> ..`` in every class folder, ``loop ->
    .`` in every split folder, and in each class folder a second name for its first image (a hard link and a
    symbolic link)."""
    write_image_folder(root, per_class=per_class, num_classes=3, size=40)
    for split in ("train", "test"):
        (root / split / "loop").symlink_to(".")
        for folder in (root / split).glob("class_*"):
            first = sorted(folder.glob("*.png"))[0]
            os.link(first, folder / "hard_link.png")
            (folder / "symbolic_link.png").symlink_to(first.name)
            (folder / "self").symlink_to(".")
            (folder / "up").symlink_to("..")
    return root


def written_images(folder: Path) -> list[tuple[str, int]]:
    """``(path, class)`` of every image ``write_image_folder`` wrote in a split folder (``class_<k>/<n>.png``)."""
    return sorted((str(path), int(path.parent.name[6:])) for path in folder.glob("class_*/[0-9]*.png"))


def test_link_loops_in_an_image_folder_list_each_image_once_in_well_under_a_second(tmp_path):
    root = looped_image_folder(tmp_path, per_class=4)
    with time_limit(10):
        start = time.perf_counter()
        source = ImageFolderSource(root=str(root))
        bank, queries = source.evaluation_splits()
        unlabelled = UnlabelledFolderSource(root=str(root / "train")).training_split()
        elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert source.classes == ["class_0", "class_1", "class_2"]  # "loop" is the split again, not a class
    assert sorted(bank.samples) == written_images(root / "train") and len(bank) == 12
    assert sorted(queries.samples) == written_images(root / "test") and len(queries) == 12
    assert sorted(path for path, _ in unlabelled.samples) == [path for path, _ in written_images(root / "train")]


@pytest.mark.integration  # a training run
def test_fit_on_an_image_folder_with_link_loops_trains_on_each_image_once(tmp_path):
    root = looped_image_folder(tmp_path / "images", per_class=6)  # 18 training images: 2 batches of 8
    source = {
        "class_path": "hfmca_lightning.data.ImageFolderSource",
        "init_args": {"root": str(root), "image_size": 32},
    }
    with time_limit(60):
        fit(tmp_path, **{"data.init_args.source": source, "data.init_args.num_workers": 2})
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


def test_listing_a_folder_opens_no_image(tmp_path, monkeypatch):
    write_image_folder(tmp_path, per_class=3, num_classes=2)
    opened = []
    monkeypatch.setattr("hfmca_lightning.data.folder_sources.read_image", lambda path: opened.append(path))
    train = ImageFolderSource(root=str(tmp_path)).split(train=True)
    assert len(train) == 6 and opened == []
    train[4]
    assert opened == [train.samples[4][0]]


def test_unreadable_image_is_named_when_read(tmp_path):
    write_image_folder(tmp_path, per_class=2, num_classes=2)
    broken = tmp_path / "train" / "class_1" / "broken.png"
    broken.write_bytes(b"not a png")
    train = ImageFolderSource(root=str(tmp_path)).split(train=True)
    index = [path for path, _ in train.samples].index(str(broken))
    with pytest.raises(ConfigurationError, match=r"cannot read image .*broken\.png.*on_bad_image: skip"):
        train[index]


def test_an_image_over_pils_size_limit_is_an_unreadable_image_named_or_skipped(tmp_path):
    """A file whose header declares 225 megapixels (PIL refuses it as a decompression bomb, not as an OSError) is named
    in one line, or skipped with ``on_bad_image: skip`` (before: PIL's DecompressionBombError, skip or not)."""
    write_image_folder(tmp_path, per_class=2, num_classes=2)
    huge = tmp_path / "train" / "class_1" / "huge.bmp"
    side = 15000
    header = struct.pack("<IHHI", 54, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, side, side, 1, 24, 0, 0, 0, 0, 0, 0)
    huge.write_bytes(b"BM" + header)
    for on_bad_image in ("error", "skip"):
        train = ImageFolderSource(root=str(tmp_path), on_bad_image=on_bad_image).split(train=True)
        index = [path for path, _ in train.samples].index(str(huge))
        if on_bad_image == "error":
            with pytest.raises(ConfigurationError, match=r"cannot read image .*huge\.bmp: Image size \(225000000"):
                train[index]
        else:
            with pytest.warns(UserWarning, match=r"skipping unreadable image .*huge\.bmp"):
                image, _ = train[index]
            assert torch.equal(image, train[(index + 1) % len(train)][0])


@pytest.mark.parametrize("link", ["test", "val"])
def test_a_test_split_that_links_to_the_training_split_is_one_line(tmp_path, link):
    """``test -> train`` passed the check of the names, and kNN scored the training images against themselves."""
    root = write_image_folder(tmp_path / "images", per_class=2)
    shutil.rmtree(root / "test")
    (root / link).symlink_to("train")
    source = ImageFolderSource(str(root), test_dir=link, image_size=32)
    with pytest.raises(ConfigurationError, match=f"ImageFolderSource: {re.escape(str(root / link))} is the training "):
        source.prepare()
    ImageFolderSource(str(root), test_dir=None, image_size=32).prepare()  # training alone: fine


def test_an_image_in_two_class_folders_is_kept_in_the_first_and_a_class_of_none_of_its_own_is_one_line(tmp_path):
    """A file hard-linked into two class folders (deduplicating tools do that to ImageNet's cross-class duplicates)
    would be trained and scored under two classes, contradicting "each image once": it is kept in the first class,
    with a warning naming both paths. A class folder that is a link to another has no image of its own: one line."""
    write_image_folder(tmp_path, per_class=2, num_classes=2)
    (tmp_path / "train" / "class_2").symlink_to("class_0")
    (tmp_path / "test" / "class_2").symlink_to("class_0")
    with pytest.raises(ConfigurationError, match=r"class_2 holds only images of other class folders \(.*class_2/"):
        ImageFolderSource(root=str(tmp_path)).split(train=True)
    for split in ("train", "test"):
        (tmp_path / split / "class_2").unlink()
        (tmp_path / split / "class_2").mkdir()
        own = next((tmp_path / split / "class_1").glob("*.png")).read_bytes()
        (tmp_path / split / "class_2" / "own.png").write_bytes(own)
    first = next((tmp_path / "train" / "class_0").glob("*.png"))
    os.link(first, tmp_path / "train" / "class_2" / "linked.png")
    with pytest.warns(
        HFMCAWarning, match=r"1 image files under .* two class folders \(e.g. .*linked\.png is .*class_0"
    ):
        train = ImageFolderSource(root=str(tmp_path)).split(train=True)
    assert (str(first), 0) in train.samples and not [path for path, _ in train.samples if path.endswith("linked.png")]


def test_an_image_file_is_read_only_as_an_image_format(tmp_path, monkeypatch):
    """PIL would read an EPS file named ``.jpg`` by running Ghostscript on it: a file of another format than the
    image formats is an unreadable image, named, whatever its name, and Ghostscript is never called."""
    from PIL import EpsImagePlugin

    ghostscript_runs = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *args, **kwargs: ghostscript_runs.append(args))
    write_image_folder(tmp_path, per_class=2, num_classes=2)
    eps = tmp_path / "train" / "class_1" / "drawing.jpg"
    eps.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n")
    with pytest.raises(UnidentifiedImageError, match="cannot identify"):
        Image.open(eps, formats=PIL_FORMATS)
    assert Image.open(eps).format == "EPS"  # what PIL would take it for
    train = ImageFolderSource(root=str(tmp_path)).split(train=True)
    index = [path for path, _ in train.samples].index(str(eps))
    with pytest.raises(ConfigurationError, match=r"cannot read image .*drawing\.jpg"):
        train[index]
    assert ghostscript_runs == []


def test_unreadable_images_can_be_skipped_with_a_count(tmp_path):
    write_image_folder(tmp_path, per_class=2, num_classes=2)
    for name in ("a_broken.png", "b_broken.png"):
        (tmp_path / "train" / "class_1" / name).write_bytes(b"not a png")
    train = ImageFolderSource(root=str(tmp_path), on_bad_image="skip").split(train=True)
    first = [path for path, _ in train.samples].index(str(tmp_path / "train" / "class_1" / "a_broken.png"))
    with pytest.warns(UserWarning, match=r"skipping unreadable image .*a_broken\.png.*1 skipped so far"):
        with pytest.warns(UserWarning, match=r"b_broken\.png.*2 skipped so far"):
            image, target = train[first]
    replacement = (first + 2) % len(train)  # the next readable image of the list
    assert torch.equal(image, train[replacement][0]) and target == train.targets[replacement] and train.skipped == 2


def test_jpeg_and_grey_images_decode_to_rgb(tmp_path):
    from PIL import Image

    folder = tmp_path / "train" / "a"
    folder.mkdir(parents=True)
    Image.fromarray(np.full((30, 50, 3), 200, dtype=np.uint8)).save(folder / "photo.JPEG", quality=90)
    Image.fromarray(np.full((20, 20), 7, dtype=np.uint8)).save(folder / "grey.png")
    train = ImageFolderSource(root=str(tmp_path), test_dir=None).split(train=True)
    shapes = sorted(tuple(train[i][0].shape) for i in range(len(train)))
    assert shapes == [(3, 20, 20), (3, 30, 50)]


def test_a_class_list_selects_classes_and_names_missing_ones(tmp_path):
    write_image_folder(tmp_path / "images", per_class=2, num_classes=3)
    chosen = tmp_path / "classes.txt"
    chosen.write_text("# two of three\nclass_2\nclass_0\n")
    source = ImageFolderSource(root=str(tmp_path / "images"), class_list=str(chosen))
    train, test = source.evaluation_splits()
    assert source.classes == ["class_0", "class_2"] and source.num_classes == 2
    assert sorted(set(train.targets)) == [0, 1] and len(train) == 4 and len(test) == 4
    chosen.write_text("class_0\nclass_7\n")
    with pytest.raises(ConfigurationError, match=r"lacks 1 classes of class_list .*classes.txt \(e.g. \['class_7'\]\)"):
        ImageFolderSource(root=str(tmp_path / "images"), class_list=str(chosen)).split(train=True)


def test_an_unlabelled_tree_trains_without_evaluation_splits(tmp_path):
    write_image_folder(tmp_path, per_class=2, num_classes=2)
    source = UnlabelledFolderSource(root=str(tmp_path / "train"))
    train = source.training_split()
    assert len(train) == 4 and set(train.targets) == {UNLABELLED}
    assert source.evaluation_splits() is None
    labelled = UnlabelledFolderSource(root=str(tmp_path / "train"), evaluation=ImageFolderSource(root=str(tmp_path)))
    bank, queries = labelled.evaluation_splits()
    assert labelled.num_classes == 2 and len(bank) == 4 and len(queries) == 4


def test_stl10_binaries_load_through_the_real_layout(tmp_path):
    folder = write_stl10(tmp_path, unlabelled=6, train=4, test=3)
    source = STL10(root=str(tmp_path), verify=False)
    training = source.training_split()
    assert len(training) == 10 and training.targets == [UNLABELLED] * 6 + [0, 1, 2, 3]
    bank, queries = source.evaluation_splits()
    assert len(bank) == 4 and len(queries) == 3 and queries.targets == [0, 1, 2]
    image, _ = queries[1]
    raw = np.fromfile(folder / "test_X.bin", dtype=np.uint8).reshape(-1, 3, 96, 96)[1]
    assert image.shape == (3, 96, 96) and torch.equal(image, torch.from_numpy(raw.transpose(0, 2, 1).copy()))
    with pytest.raises(ConfigurationError, match="md5 sum of the official STL-10 release"):
        STL10(root=str(tmp_path)).prepare()


@pytest.mark.parametrize("label", [0, 11])
def test_stl10_labels_outside_1_to_10_are_one_clear_error(tmp_path, label):
    """A label 0 would have become UNLABELLED in the labelled split, 11 a class past the tenth."""
    folder = write_stl10(tmp_path)
    labels = folder / "train_y.bin"
    labels.write_bytes(bytes([label]) + labels.read_bytes()[1:])
    with pytest.raises(ConfigurationError, match="train_y.bin holds labels .* STL-10's are 1 to 10"):
        STL10(root=str(tmp_path), verify=False).split(train=True)


@pytest.mark.parametrize("kept", [0, 1000], ids=["empty", "a partial image"])
def test_a_truncated_stl10_binary_is_one_clear_error(tmp_path, kept):
    folder = write_stl10(tmp_path)
    images = folder / "train_X.bin"
    images.write_bytes(images.read_bytes()[:kept])
    with pytest.raises(ConfigurationError, match=f"{images} holds {kept} bytes, not a whole number of 3 x 96 x 96"):
        STL10(root=str(tmp_path), verify=False).split(train=True)


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


@pytest.mark.parametrize("source", [ImageFolderSource, UnlabelledFolderSource])
def test_an_unknown_on_bad_image_is_refused_when_the_source_is_made(source, tmp_path):
    with pytest.raises(ConfigurationError, match="on_bad_image must be one of error, skip; got 'ignore'") as error:
        source(str(tmp_path), on_bad_image="ignore")
    assert error.value.parameter == "on_bad_image"


@pytest.mark.parametrize(
    "entry",
    [
        ["not", "a", "dict"],
        {"labels": [0]},
        {"data": "abc", "labels": [0]},
        {"data": np.zeros((2, 3072)), "labels": [0]},
    ],
    ids=["a list", "no data", "data of text", "two images, one label"],
)
def test_a_cifar_batch_without_images_and_labels_is_one_clear_error(cifar10_on_disk, entry):
    """A file of the layout's name that unpickles (``verify: false``) but holds no batch of images and labels: one
    ConfigurationError naming it, not a KeyError or a reshape error from inside numpy."""
    batch = cifar10_on_disk / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(pickle.dumps(entry))
    with pytest.raises(ConfigurationError, match=f"{batch} is not a CIFAR batch: it holds no 3 x 32 x 32 uint8 'data'"):
        CIFAR(root=str(cifar10_on_disk), verify=False).split(train=True)


SETTINGS_OUT_OF_RANGE = {
    "image_size 0": (
        lambda root: ImageFolderSource(str(root), image_size=0),
        "ImageFolderSource: image_size must be >= 8; got 0",
    ),
    "negative image_size": (
        lambda root: UnlabelledFolderSource(str(root), image_size=-32),
        "UnlabelledFolderSource: image_size must be >= 8; got -32",
    ),
    "eval_resize below image_size": (
        lambda root: ImageFolderSource(str(root), image_size=32, eval_resize=8),
        "ImageFolderSource: eval_resize (8) is the shorter side before the centre crop of image_size (32)",
    ),
    "dataset eval_resize below image_size": (
        lambda root: DatasetSource(SyntheticShapes(train_per_class=1).split(True), image_size=32, eval_resize=16),
        "DatasetSource: eval_resize (16)",
    ),
    "std of zero": (
        lambda root: ImageFolderSource(str(root), std=(0.0, 0.0, 0.0)),
        "std needs one value in (0, 1] per RGB channel",
    ),
    # 0-255 statistics (mmcv's): accepted before, views nearly constant
    "mean of 0-255 images": (
        lambda root: ImageFolderSource(str(root), mean=(123.7, 116.3, 103.5)),
        "mean needs one value in [0, 1] per RGB channel, a statistic of images in [0, 1] (0-255 statistics: divide",
    ),
    "std of 0-255 images": (
        lambda root: DatasetSource(SyntheticShapes(train_per_class=1).split(True), std=(58.4, 57.1, 57.4)),
        "std needs one value in (0, 1]",
    ),
    "CIFAR name": (lambda root: CIFAR("cifar1000", root=str(root)), "CIFAR: name must be one of cifar10, cifar100"),
    "negative SyntheticShapes seed": (lambda root: SyntheticShapes(seed=-1), "SyntheticShapes: seed must be >= 0"),
    "test split is the training split": (
        lambda root: ImageFolderSource(str(root), train_dir="train", test_dir="./train"),
        "ImageFolderSource: test_dir is the training split (train): kNN and probes would score the training",
    ),
    # before: the evaluation source's own settings were silently replaced by the training source's
    "evaluation source of another size": (
        lambda root: UnlabelledFolderSource(str(root), image_size=32, evaluation=ImageFolderSource(str(root))),
        "UnlabelledFolderSource: evaluation has image_size 224, this source 32; evaluation images are read as",
    ),
    "evaluation source of other statistics": (
        lambda root: UnlabelledFolderSource(str(root), evaluation=ImageFolderSource(str(root), std=(0.5, 0.5, 0.5))),
        "UnlabelledFolderSource: evaluation has std (0.5, 0.5, 0.5), this source (0.229, 0.224, 0.225)",
    ),
    "NaN mean": (lambda root: ImageFolderSource(str(root), mean=(float("nan"), 0.5, 0.5)), "mean needs one value"),
    "STL-10 image_size 4": (lambda root: STL10(str(root), image_size=4), "STL10: image_size must be >= 8; got 4"),
    "image_size not a whole number": (
        lambda root: ImageFolderSource(str(root), image_size=32.0),
        "ImageFolderSource: image_size must be a whole number >= 8; got 32.0",
    ),
    "eval_resize not a whole number": (
        lambda root: DatasetSource(SyntheticShapes(train_per_class=1).split(True), eval_resize="36"),
        "DatasetSource: eval_resize must be a whole number >= 1; got '36'",
    ),
}


@pytest.mark.parametrize(("build", "message"), SETTINGS_OUT_OF_RANGE.values(), ids=SETTINGS_OUT_OF_RANGE.keys())
def test_a_source_setting_out_of_range_is_one_clear_error(tmp_path, build, message):
    """Each failed later inside torch or torchvision (a division by zero in the crop, torchvision's 'std evaluated
    to zero') or, for eval_resize, ran with evaluation images mostly padding."""
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        build(tmp_path)


def test_a_class_list_that_is_not_text_is_one_clear_error(tmp_path):
    write_image_folder(tmp_path)
    (tmp_path / "classes.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigurationError, match="class_list .*classes.txt is not a text file"):
        ImageFolderSource(str(tmp_path), class_list=str(tmp_path / "classes.txt")).prepare()


@pytest.mark.parametrize("label", [10, -11])
def test_cifar_labels_outside_the_classes_are_one_clear_error(cifar10_on_disk, label):
    """A batch of the layout (``verify: false``) with a label outside 0..9 stopped training partway with an IndexError
    from the cross-entropy of the online probe."""
    batch = cifar10_on_disk / "cifar-10-batches-py" / "data_batch_2"
    entry = pickle.loads(batch.read_bytes(), encoding="latin1")
    entry["labels"][0] = label
    batch.write_bytes(pickle.dumps(entry))
    with pytest.raises(
        ConfigurationError, match=f"the labels of cifar10 are 0 to 9, but its files hold {min(label, 0)}"
    ):
        CIFAR(root=str(cifar10_on_disk), verify=False).split(train=True)


@pytest.mark.parametrize("suffix", [".png", ".tif"])
def test_16_bit_images_are_read_scaled_to_8_bits(tmp_path, suffix):
    """A 16-bit PNG came back as uint16 (the batched drawers then failed deep inside their collate) and a 16-bit TIFF
    clipped at 255 by PIL's RGB conversion: both now read as the 8-bit image they hold."""
    from hfmca_lightning.data.folder_sources import read_image

    grey = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1024 + 100).astype(np.uint16)
    path = tmp_path / f"deep{suffix}"
    Image.fromarray(grey).save(path)
    image = read_image(str(path))
    assert image.dtype == torch.uint8 and image.shape == (3, 8, 8)
    expected = torch.from_numpy((grey.astype(np.int32) >> 8).astype(np.uint8))
    assert torch.equal(image, expected.expand(3, -1, -1)), image[0, :2]


@pytest.mark.parametrize(
    ("suffix", "convert"),
    [
        (".pgm", lambda grey: grey),  # PIL reads a 16-bit PGM as mode I (32-bit), on a 16-bit scale
        (".tif", lambda grey: grey.astype(np.int32)),  # a 32-bit integer TIFF, mode I
        (".tif", lambda grey: grey.astype(np.float32) / 65535),  # a float TIFF in [0, 1], mode F
    ],
    ids=["16-bit pgm", "32-bit tiff", "float tiff"],
)
def test_greyscale_of_more_than_8_bits_is_read_scaled_not_clipped(tmp_path, suffix, convert):
    """PIL's RGB conversion clips modes I and F at 255: a 16-bit PGM came back nearly white, a float TIFF black."""
    from hfmca_lightning.data.folder_sources import read_image

    grey = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1024 + 100).astype(np.uint16)
    path = tmp_path / f"deep{suffix}"
    Image.fromarray(convert(grey)).save(path)
    image = read_image(str(path))
    expected = torch.from_numpy((grey.astype(np.int32) >> 8).astype(np.uint8)).expand(3, -1, -1)
    assert image.dtype == torch.uint8 and image.shape == (3, 8, 8)
    assert (image.int() - expected.int()).abs().max() <= 1, image[0, :2]  # floats round, integers keep the high byte


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (np.full((8, 8), 70_000, dtype=np.int32), r"a mode I image holds 70000 to 70000; give integers of at most 16"),
        (
            np.full((8, 8), 255.0, dtype=np.float32),
            r"a mode F image holds values from 255 to 255; give floats in \[0, 1\]",
        ),
    ],
    ids=["beyond 16 bits", "0-255 floats"],
)
def test_greyscale_beyond_its_range_names_the_file(tmp_path, values, message):
    from hfmca_lightning.data.folder_sources import FolderImages

    path = tmp_path / "deep.tif"
    Image.fromarray(values).save(path)
    with pytest.raises(ConfigurationError, match=f"cannot read image {re.escape(str(path))}: {message}"):
        FolderImages([(str(path), 0)])[0]
