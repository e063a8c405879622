"""What the tests share: tiny data sets in the real on-disk layouts, plain reference implementations, runs of the
``hfmca`` command (in-process and as a subprocess), and the small models, data and callbacks several test files use
(configs name the callbacks by class path, ``tests.helpers.<Class>``). Fixtures built on them are in conftest.py."""

from __future__ import annotations

import copy
import csv
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer
from PIL import Image
from torch import nn
from torch.optim import Optimizer

from hfmca_lightning.cli import main
from hfmca_lightning.data import MultiViewDataModule, SyntheticShapes, ViewPipeline
from hfmca_lightning.data.synthetic import generate_shapes
from hfmca_lightning.diagnostics import HostReads
from hfmca_lightning.losses import CorrelationStatistics, HFMCACost
from hfmca_lightning.methods import HFMCAModule, InternalCosts
from hfmca_lightning.models import GridExternalHead, SpectrumCNN
from hfmca_lightning.models.layers import PaddingLayer

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo.yaml"


DEMO_TINY_MODEL = {
    "init_args": {
        "backbone": {"class_path": "hfmca_lightning.models.SmallConvNet", "init_args": {"width": 8, "num_stages": 2}},
        "projector": {
            "class_path": "hfmca_lightning.models.ViewProjector",
            "init_args": {"input_dim": 16, "output_dim": 16, "hidden_dim": 32},
        },
        "external_head": {
            "class_path": "hfmca_lightning.models.GridExternalHead",
            "init_args": {"feature_dim": 16, "grid_height": 2, "grid_width": 2, "hidden_dim": 16, "noise_channels": 0},
        },
    }
}


def tiny_overrides(tmp_path: Path, model: dict | None = None, **extra: object) -> Path:
    """Shrink a run to a few seconds: tiny data, one epoch, outputs under tmp_path; ``model`` overrides
    (default: a tiny version of the demo's model)."""
    config = {
        "trainer": {
            "max_epochs": 1,
            "max_steps": -1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path / "logs"), "name": "run"},
            },
            "callbacks": [
                {"class_path": "hfmca_lightning.callbacks.KNNEvaluation", "init_args": {"k": 20}},
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(tmp_path / "checkpoints"), "save_last": True},
                },
            ],
        },
        "model": copy.deepcopy(DEMO_TINY_MODEL if model is None else model),
        "data": {
            "init_args": {
                "source": {
                    "class_path": "hfmca_lightning.data.SyntheticShapes",
                    "init_args": {"num_classes": 4, "train_per_class": 8, "test_per_class": 3},
                },
                "batch_size": 8,
                "eval_batch_size": 64,
                "num_workers": 0,
            }
        },
    }
    for dotted, value in extra.items():
        node = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "overrides.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit(tmp_path: Path, *args: str, **extra: object) -> None:
    main(["fit", "--config", str(DEMO), "--config", str(tiny_overrides(tmp_path, **extra)), *args])


def interrupted_fit(tmp_path: Path, after_epochs: int, *args: str, **extra: object) -> None:
    overrides = tiny_overrides(tmp_path, **extra)
    config = yaml.safe_load(overrides.read_text())
    stop = {"class_path": "tests.helpers.StopAfterEpochs", "init_args": {"epochs": after_epochs}}
    config["trainer"]["callbacks"].append(stop)
    overrides.write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(DEMO), "--config", str(overrides), *args])


def logged(tmp_path: Path, metric: str) -> list[float]:
    rows = list(csv.DictReader(open(next((tmp_path / "logs").glob("run/version_*/metrics.csv")))))
    return [float(row[metric]) for row in rows if row.get(metric)]


class StopAfterEpochs(Callback):
    """Interrupt a run after ``epochs`` epochs, as a crash or a time limit would (the schedule is unchanged)."""

    def __init__(self, epochs: int = 1) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


# --- the `hfmca` console script as a subprocess: real workers, real signals, real files -------------------

HFMCA = Path(sys.executable).with_name("hfmca")
DISTRIBUTED_ENVIRONMENT = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
)
SHRUNK_DATA = {
    "source": {
        "class_path": "hfmca_lightning.data.SyntheticShapes",
        "init_args": {"num_classes": 4, "train_per_class": 16, "test_per_class": 3},
    },
    "batch_size": 8,
    "eval_batch_size": 64,
}


def write_overrides(folder: Path, name: str, overrides: dict) -> Path:
    """A second ``--config`` file that shrinks a shipped config (sizes only; callbacks and logger stay)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(overrides))
    return path


def start_hfmca(cwd: Path, *args: str, log_name: str = "hfmca.log", test_classes: bool = False) -> subprocess.Popen:
    """Start ``hfmca <args>`` in ``cwd`` (relative paths of the shipped configs land there) in its own process
    group, output to ``cwd/<log_name>``; ``test_classes``: configs may name classes of this test suite
    (``tests.<module>.<class>``)."""
    # A fresh shell's environment: a WANDB_SERVICE or MASTER_PORT inherited from this process (tests that ran
    # W&B or DDP in-process leave them behind) would make every subprocess share one W&B service or one
    # rendezvous port, unlike separate runs of the command.
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("WANDB_") and name not in DISTRIBUTED_ENVIRONMENT
    }
    # PYTHONFAULTHANDLER: a run that hangs is sent SIGABRT, and every process prints where it was.
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    if test_classes:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = open(cwd / log_name, "w")
    return subprocess.Popen(
        [str(HFMCA), *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


class HFMCATimeout(AssertionError):
    """An ``hfmca`` subprocess did not finish in time; the message ends with every process's Python stacks."""


def run_hfmca(
    cwd: Path, *args: str, timeout: float = 240, log_name: str = "hfmca.log", test_classes: bool = False
) -> subprocess.CompletedProcess:
    """Run ``hfmca <args>`` to completion; returns the process with ``stdout`` = its whole output.

    On time-out every process of the run (DDP ranks, data-loader workers) gets SIGABRT, which makes it print
    its Python stacks (faulthandler), then SIGKILL; :class:`HFMCATimeout` carries the output."""
    return finish_hfmca(
        start_hfmca(cwd, *args, log_name=log_name, test_classes=test_classes), cwd, timeout=timeout, log_name=log_name
    )


def finish_hfmca(
    process: subprocess.Popen, cwd: Path, timeout: float = 240, log_name: str = "hfmca.log"
) -> subprocess.CompletedProcess:
    """Wait for a run started by :func:`start_hfmca` (as :func:`run_hfmca` does; a reference run started first
    and finished later overlaps its start-up with the test's other runs)."""
    args = process.args[1:]  # type: ignore[index]
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGABRT)
        time.sleep(3)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise HFMCATimeout(
            f"hfmca {' '.join(args)} did not finish in {timeout} s:\n{(cwd / log_name).read_text()[-8000:]}"
        ) from None
    return subprocess.CompletedProcess(process.args, process.returncode, (cwd / log_name).read_text())


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, timeout: float = 120) -> None:
    """Poll ``condition`` every 10 ms while ``process`` runs; fail if it ends or time runs out first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"hfmca ended (status {process.returncode}) before the awaited moment")
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError("timed out waiting for the awaited moment")
        time.sleep(0.01)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (weights, buffers, optimiser state, callback states such as the online
    linear probe's), flattened by key path."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    tensors: dict[str, torch.Tensor] = {}

    def visit(node: object, key: str) -> None:
        if isinstance(node, torch.Tensor):
            tensors[key] = node
        elif isinstance(node, dict):
            for name, child in node.items():
                visit(child, f"{key}/{name}")
        elif isinstance(node, (list, tuple)):
            for index, child in enumerate(node):
                visit(child, f"{key}/{index}")

    visit(
        {
            "state_dict": checkpoint["state_dict"],
            "optimizer_states": checkpoint["optimizer_states"],
            "callbacks": checkpoint.get("callbacks", {}),
        },
        "",
    )
    return tensors


def _shapes(per_class: int, num_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    return generate_shapes(num_classes, per_class, 32, seed)


def write_cifar(root: Path, name: str = "cifar10", per_class: int = 4, num_classes: int = 10) -> Path:
    """torchvision's ``cifar-10-batches-py`` (5 train batches, test batch, meta) or ``cifar-100-python``.

    Pixels are synthetic shapes so that a model can learn something; labels use the real key names.
    """
    if name == "cifar10":
        folder, train_files, test_file, label_key = (
            root / "cifar-10-batches-py",
            [f"data_batch_{i}" for i in range(1, 6)],
            "test_batch",
            "labels",
        )
        meta_file, meta = "batches.meta", {"label_names": [f"class{i}" for i in range(10)]}
    else:
        folder, train_files, test_file, label_key = root / "cifar-100-python", ["train"], "test", "fine_labels"
        meta_file, meta = "meta", {"fine_label_names": [f"class{i}" for i in range(100)]}
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = _shapes(per_class * len(train_files), num_classes, seed=1)
    order = np.random.default_rng(0).permutation(len(labels))
    chunks = np.array_split(order, len(train_files))
    for file_name, chunk in zip(train_files, chunks):
        _dump(folder / file_name, images[chunk], labels[chunk], label_key)
    test_images, test_labels = _shapes(per_class, num_classes, seed=2)
    _dump(folder / test_file, test_images, test_labels, label_key)
    with open(folder / meta_file, "wb") as handle:
        pickle.dump(meta, handle)
    return folder


def _dump(path: Path, images: np.ndarray, labels: np.ndarray, label_key: str) -> None:
    entry = {
        "data": images.transpose(0, 3, 1, 2).reshape(len(images), -1),
        label_key: labels.tolist(),
        "batch_label": path.name,
    }
    with open(path, "wb") as handle:
        pickle.dump(entry, handle)


def write_image_folder(root: Path, per_class: int = 4, num_classes: int = 3, size: int = 40) -> Path:
    """``root/{train,test}/<class>/<n>.png`` with images of ``size x size`` pixels (not the network size)."""
    for split, seed in (("train", 3), ("test", 4)):
        images, labels = generate_shapes(num_classes, per_class, size, seed)
        for index, (image, label) in enumerate(zip(images, labels)):
            folder = root / split / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{index}.png")
    return root


def write_stl10(root: Path, unlabelled: int = 6, train: int = 4, test: int = 3) -> Path:
    """torchvision's ``stl10_binary`` layout: ``*_X.bin`` (uint8, each image 3 x 96 x 96 column-major),
    ``*_y.bin`` (labels 1..10), ``unlabeled_X.bin``, ``class_names.txt``."""
    folder = root / "stl10_binary"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, count in (("unlabeled", unlabelled), ("train", train), ("test", test)):
        rng.integers(0, 256, (count, 3, 96, 96), dtype=np.uint8).tofile(folder / f"{name}_X.bin")
        if name != "unlabeled":
            (np.arange(count) % 10 + 1).astype(np.uint8).tofile(folder / f"{name}_y.bin")
    (folder / "class_names.txt").write_text("\n".join(f"class{i}" for i in range(10)))
    return folder


def write_jpeg_tree(
    root: Path,
    classes: list[str],
    per_class: int = 1,
    splits: tuple[str, ...] = ("train", "val"),
    size: tuple[int, int] = (240, 300),
) -> Path:
    """An ImageNet-style tree ``root/<split>/<wnid>/<name>.JPEG`` of full-size JPEGs (``size`` = height, width)."""
    rng = np.random.default_rng(0)
    for split in splits:
        for index, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for item in range(per_class):
                pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
                pixels[:, : size[1] // 2] = (index * 37) % 256  # a class-dependent half
                Image.fromarray(pixels).save(folder / f"{name}_{item}.JPEG", quality=85)
    return root


def reference_group_moments(
    low: torch.Tensor, high: torch.Tensor, real: torch.Tensor | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """R1, R2, P of docs/conventions.md §1 by explicit loops over groups and members (float64 numpy). ``real (M, L)``
    marks the members of groups with fewer than ``L`` (windows at a padded border): each group's member means are
    then taken over its own members."""
    z = low.detach().double().numpy()
    h = high.detach().double().numpy()
    groups, members, k1 = z.shape
    mask = np.ones((groups, members), dtype=bool) if real is None else real.numpy()
    k2 = h.shape[1]
    r1 = np.zeros((k1, k1))
    r2 = np.zeros((k2, k2))
    cross = np.zeros((k1, k2))
    for m in range(groups):
        own = z[m][mask[m]]
        for member in own:
            r1 += np.outer(member, member) / len(own)
        r2 += np.outer(h[m], h[m])
        cross += np.outer(own.mean(axis=0), h[m])
    return r1 / groups, r2 / groups, cross / groups


def reference_unfold_windows(low_map: torch.Tensor, high_map: torch.Tensor, kernel: int, stride: int, padding: int):
    """Unfold a block's windows by explicit loops: low ``(B*H'*W', kernel**2, K1)`` (zeros where a window reaches
    into the padding), high ``(B*H'*W', K2)``, and ``real (B*H'*W', kernel**2)``: which members lie on the map (the
    others are no members, docs/conventions.md §3)."""
    z = low_map.detach().double()
    batch, k1, height, width = z.shape
    out_h, out_w = high_map.shape[-2:]
    members, highs, real = [], [], []
    for b in range(batch):
        for i in range(out_h):
            for j in range(out_w):
                window, inside = [], []
                for di in range(kernel):
                    for dj in range(kernel):
                        y, x = i * stride + di - padding, j * stride + dj - padding
                        on_map = 0 <= y < height and 0 <= x < width
                        window.append(z[b, :, y, x] if on_map else torch.zeros(k1, dtype=torch.float64))
                        inside.append(on_map)
                members.append(torch.stack(window))
                real.append(torch.tensor(inside))
                highs.append(high_map[b, :, i, j].detach().double())
    return torch.stack(members), torch.stack(highs), torch.stack(real)


def reference_cost(r1: np.ndarray, r2: np.ndarray, cross: np.ndarray, reg: float) -> float:
    """logdet J - logdet A - logdet C with numpy's slogdet."""
    a = r1 + reg * np.eye(r1.shape[0])
    c = r2 + reg * np.eye(r2.shape[0])
    joint = np.block([[a, cross], [cross.T, c]])
    return np.linalg.slogdet(joint)[1] - np.linalg.slogdet(a)[1] - np.linalg.slogdet(c)[1]


def reference_cost_autograd(low: torch.Tensor, high: torch.Tensor, reg: float) -> torch.Tensor:
    """logdet J - logdet A - logdet C of groups ``low (M, L, K1)``, ``high (M, K2)`` from the assembled matrices
    (``torch.linalg.slogdet``): differentiable by autograd's own formulas, no factor blocks, no surrogate."""
    groups, members, k1 = low.shape
    flat = low.reshape(-1, k1)
    r1 = flat.T @ flat / (groups * members)
    r2 = high.T @ high / groups
    cross = low.mean(dim=1).T @ high / groups
    a = r1 + reg * torch.eye(k1, dtype=low.dtype)
    c = r2 + reg * torch.eye(high.shape[1], dtype=high.dtype)
    joint = torch.cat([torch.cat([a, cross], dim=1), torch.cat([cross.T, c], dim=1)], dim=0)
    return torch.linalg.slogdet(joint)[1] - torch.linalg.slogdet(a)[1] - torch.linalg.slogdet(c)[1]


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
        SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=3), num_views=4, batch_size=6, num_workers=0
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


PER_RANK_BATCH = 4


def bn_free_module(internal: bool = False) -> HFMCAModule:
    """BN-free, so per-rank and whole-batch normalisation cannot differ; the costs sync their statistics. With
    ``internal``: internal costs on the backbone's two convolutions too."""
    torch.manual_seed(0)
    head = GridExternalHead(feature_dim=6, grid_height=2, grid_width=2, hidden_dim=8, noise_channels=0)
    head.layers = nn.Sequential(
        *[nn.Identity() if isinstance(layer, nn.BatchNorm2d) else layer for layer in head.layers]
    )
    convolutions = [nn.Conv2d(3, 4, 3, padding=1), nn.Sigmoid(), nn.Conv2d(4, 5, 3, stride=2, padding=1), nn.Sigmoid()]
    return HFMCAModule(
        backbone=nn.Sequential(*convolutions, nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        projector=nn.Sequential(nn.Linear(5, 6), nn.Sigmoid()),
        external_head=head,
        external_cost=HFMCACost(reg=0.1, sync_dist=True, name="external"),
        internal_costs=InternalCosts(["0", "2"], reg=0.1, sync_dist=True) if internal else None,
        optimizer=partial(torch.optim.SGD, lr=0.5),
        lr_scheduler=partial(torch.optim.lr_scheduler.ConstantLR, factor=1.0, total_iters=0),
    )


def ddp_data(batch_size: int, views: ViewPipeline | None = None) -> MultiViewDataModule:
    """The DDP tests' data: 24 images of 16 px, 4 views by ``views`` (default: torchvision's), no workers."""
    source = SyntheticShapes(num_classes=3, train_per_class=8, test_per_class=3, image_size=16)
    return MultiViewDataModule(
        source,
        num_views=4,
        batch_size=batch_size,
        eval_batch_size=4,
        num_workers=0,
        views=views,
    )


class ReleaseProcessGroup(Callback):
    """Destroy the process group at the end of a spawned run. Spawned workers leave through ``os._exit``, so the
    ``atexit`` handler that Lightning registers for this never runs, and gloo's threads, still alive at exit,
    now and then abort the worker ("terminate called without an active exception": about 1 run in 10 of the
    kNN test on a 2-core machine). ``teardown`` is the trainer's last hook; nothing collective follows it."""

    def teardown(self, trainer: Trainer, pl_module, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def ddp_trainer(devices: int, **kwargs) -> Trainer:
    if devices > 1:
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), ReleaseProcessGroup()]
        # A fresh rendezvous port for every spawned group (Lightning would reuse the first one it chose).
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    strategy = "ddp_spawn" if devices > 1 else "auto"
    settings = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, **{**settings, **kwargs})


class PoisonWeightsAtStep(Callback):
    """Simulates a diverging run: sets the first backbone weight to NaN before training step ``step`` (on process
    ``rank`` only, when given)."""

    def __init__(self, step: int = 5, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            with torch.no_grad():
                next(pl_module.backbone.parameters()).fill_(float("nan"))


class PoisonBatchAt(Callback):
    """NaN images in the batch of step ``step``; records the weights after every step and which steps ran."""

    def __init__(self, step: int) -> None:
        self.step, self.weights, self.steps_started = step, [], []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.steps_started.append(trainer.global_step)
        if trainer.global_step == self.step:
            batch[0].fill_(float("nan"))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self.weights.append([p.detach().clone() for p in pl_module.parameters()])


COUNTED_STEPS = range(2, 5)  # after the first steps' one-off work (caches, lazy buffers)


class CountHostReads(Callback):
    """Records host reads in steps ``COUNTED_STEPS``: ``until_optimizer`` from the start of each step (before
    ``training_step``) to the optimizer step (a callback's ``on_before_optimizer_step`` runs before the module's);
    ``whole`` from the start of the first counted step to the start of the step after the last (the module, every
    callback, the progress bar, Lightning's loop)."""

    def __init__(self) -> None:
        self.until_optimizer: list[str] = []
        self.whole = HostReads()
        self._step = HostReads()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        if batch_idx == COUNTED_STEPS.start:
            self.whole.__enter__()
        elif batch_idx == COUNTED_STEPS.stop:
            self.whole.__exit__(None, None, None)
        if batch_idx in COUNTED_STEPS:
            self._step = HostReads()
            self._step.__enter__()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx in COUNTED_STEPS:
            self._step.__exit__(None, None, None)
            self.until_optimizer += self._step.reads or ["(none)"]


# --- Tolerances, from the arithmetic they check ---------------------------------------------------------------------
# Round to nearest: |fl(x) - x| <= u |x|, with the unit roundoff u of each precision. Bounds are worst cases, valid on
# any CPU or BLAS (any summation order); a test states beside its tolerance which bound it uses and with what n.
FLOAT32_UNIT = 2.0**-24
FLOAT64_UNIT = 2.0**-53


def gamma(terms: int, unit: float) -> float:
    """``gamma_n = n u / (1 - n u)``: the largest error of a sum or dot product of ``terms`` rounded terms, relative
    to the sum of the terms' magnitudes, in any order of summation (Higham, *Accuracy and Stability of Numerical
    Algorithms*, §3.1). Two computations of the same sum in different orders differ by at most twice that."""
    return terms * unit / (1 - terms * unit)


def logdet_error(matrix: torch.Tensor) -> float:
    """Bound on the absolute error of ``logdet`` of a symmetric positive definite float64 ``matrix`` from a Cholesky
    factor: the computed factor is exact for ``M + dM`` with ``|dM| <= gamma_{n+1} |M|`` elementwise (Higham,
    Theorem 10.3), and ``|logdet(M + dM) - logdet(M)| ~ |tr(M^-1 dM)| <= n ||M^-1||_2 ||dM||_2``, so at most
    ``n^2 gamma_{n+1} kappa(M)`` (with ``||dM||_2 <= n gamma_{n+1} ||M||_2``)."""
    n = matrix.shape[-1]
    condition = float(torch.linalg.cond(matrix.double()))
    return n * n * gamma(n + 1, FLOAT64_UNIT) * condition


def inverse_error(matrix: torch.Tensor) -> float:
    """Bound on the relative (2-norm) error of the inverse of a symmetric positive definite float64 ``matrix`` from
    its Cholesky factor: ``c n u kappa(M)``, with ``c = 4`` for the factorisation and the two triangular solves
    (Higham, §14.3)."""
    n = matrix.shape[-1]
    return 4 * n * FLOAT64_UNIT * float(torch.linalg.cond(matrix.double()))


def cost_matrices(low: torch.Tensor, high: torch.Tensor, reg: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, C, J)`` of groups ``low (M, L, K1)``, ``high (M, K2)`` in float64, from the plain loops' moments."""
    r1, r2, cross = (torch.from_numpy(moment) for moment in reference_group_moments(low, high))
    a = r1 + reg * torch.eye(r1.shape[0], dtype=torch.float64)
    c = r2 + reg * torch.eye(r2.shape[0], dtype=torch.float64)
    return a, c, torch.cat([torch.cat([a, cross], dim=1), torch.cat([cross.T, c], dim=1)], dim=0)


def cost_error(low: torch.Tensor, high: torch.Tensor, reg: float) -> float:
    """Bound on the absolute float64 error of ``r = logdet J - logdet A - logdet C`` (:func:`logdet_error` of each),
    plus the float64 moments' own rounding (sums of ``M * L`` terms), carried through ``|dr| <= ||J^-1|| ||dJ||``."""
    a, c, joint = cost_matrices(low, high, reg)
    moments = gamma(low.shape[0] * low.shape[1], FLOAT64_UNIT) * sum(
        float(torch.linalg.cond(m)) * m.shape[0] for m in (a, c, joint)
    )
    return logdet_error(joint) + logdet_error(a) + logdet_error(c) + moments


def spectrum_error(low: torch.Tensor, high: torch.Tensor, reg: float, sigma: torch.Tensor) -> float:
    """Bound on the absolute error of ``sum_k log(1 - sigma_k)`` from eigenvalues taken after whitening by
    ``A^-1/2`` and ``C^-1/2`` (Alg. 4): each ``sigma_k`` carries a relative error of at most
    ``4 n u (kappa(A) + kappa(C))`` (the inverse square roots and the SVD, first order), and
    ``|d log(1 - sigma)| = |d sigma| / (1 - sigma)``."""
    a, c, _ = cost_matrices(low, high, reg)
    n = a.shape[0] + c.shape[0]
    relative = 4 * n * FLOAT64_UNIT * (float(torch.linalg.cond(a)) + float(torch.linalg.cond(c)))
    return float((relative * sigma / (1 - sigma)).sum())


def gradient_error(low: torch.Tensor, high: torch.Tensor, reg: float) -> float:
    """Bound on the absolute float64 error of each entry of ``dr/dlow`` and ``dr/dhigh``: the gradient w.r.t. the
    moments is a sum of inverses (``(J^-1)_11 - A^-1``, ``2 (J^-1)_12``, ``(J^-1)_22 - C^-1``), each with relative
    error :func:`inverse_error` times its norm ``1 / lambda_min``; the chain rule to a feature multiplies by at most
    ``2 max |feature| / M`` (each group's moments are means over its ``M`` groups)."""
    a, c, joint = cost_matrices(low, high, reg)
    moments = sum(inverse_error(m) / float(torch.linalg.eigvalsh(m)[0]) for m in (a, c, joint))
    largest = max(float(low.abs().max()), float(high.abs().max()))
    return 4 * moments * largest / low.shape[0]


def eigenvalue_error(stats: CorrelationStatistics, reg: float) -> float:
    """Relative error bound of the whitened cross-correlation ``W = A^-1/2 P C^-1/2`` in one float64 computation:
    ``e = 4 n u (kappa(A) + kappa(C))``. Its singular values then move by at most ``e ||W|| <= e`` (Weyl; ``||W|| < 1``)
    and the eigenvalues ``sigma = s^2`` by at most ``3 e``."""
    a, c, _ = (m.double() for m in stats.means())
    a = a + reg * torch.eye(a.shape[0], dtype=torch.float64)
    c = c + reg * torch.eye(c.shape[0], dtype=torch.float64)
    n = a.shape[0] + c.shape[0]
    return 4 * n * FLOAT64_UNIT * (float(torch.linalg.cond(a)) + float(torch.linalg.cond(c)))


# --- Statistical tolerances: tests that compare distributions draw with fixed seeds, so they are deterministic; the
# tolerances say how far a correct sampler may stray by chance, so that a change of random stream never fails them.
def ks_critical(n: int, m: int, alpha: float = 1e-4) -> float:
    """Two-sample Kolmogorov-Smirnov statistic exceeded with probability ``alpha`` by samples of sizes ``n`` and ``m``
    of one distribution (asymptotic: ``sqrt(-ln(alpha / 2) / 2) sqrt((n + m) / (n m))``)."""
    import math

    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def proportion_tolerance(p: float, n: int, sigmas: float = 5.0) -> float:
    """How far the fraction of ``n`` independent draws with probability ``p`` strays from ``p``: ``sigmas`` standard
    deviations, ``sigmas * sqrt(p (1 - p) / n)``."""
    return sigmas * (p * (1 - p) / n) ** 0.5


def quiet_trainer(**options: object) -> Trainer:
    """A ``Trainer`` for in-process tests: no logger, checkpoints, progress bar, model summary or sanity check, unless
    ``options`` say otherwise."""
    settings: dict = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return Trainer(**{**settings, **options})
