"""``hfmca export``: a trained backbone as plain weights that load without this package.

    hfmca export --ckpt_path runs/cifar10_ss/checkpoints/last.ckpt --out exported/cifar10_ss
    hfmca export --ckpt_path ... --out ... --embeddings train test     # + features and labels (npz)
    hfmca export --ckpt_path ... --out exported/cifar10_ss --overwrite  # replace an earlier export there

Writes ``backbone.pt`` (a ``state_dict``: tensors and plain extra state such as SpectrumCNN's layout;
``torch.load(..., weights_only=True)``), ``backbone.json`` (library, architecture, stem, feature dimension, input
normalisation, how to load it, the SHA-256 of each file written with it) and, with ``--embeddings``,
``embeddings_<split>.npz`` (``features (N, D)`` float32, ``labels (N,)``).

A non-empty ``--out`` is refused unless ``--overwrite`` is given; with it, an ``embeddings_<split>.npz`` of an
earlier export that this one does not write is removed (its features are another checkpoint's). Every file is written
in full beside its target before any is renamed into place, ``backbone.json`` last, and the earlier embeddings are
removed only once every new file is in place: a full disk or a crash mid-way leaves the previous export as it was
(:class:`~hfmca_lightning.runtime.files.StagedFiles`).

torchvision backbones (``CIFARResNet18``, ``TorchvisionBackbone``) load into the stock torchvision model
with its classifier replaced by ``nn.Identity()`` (and, for the CIFAR stem, a 3x3 stride-1 ``conv1`` and
no max-pool); timm backbones into ``timm.create_model(name, num_classes=0)``; the package's own small
backbones (``SmallConvNet``, ``SpectrumCNN``) into their class with the ``init_args`` in the JSON.
"""

from __future__ import annotations

import hashlib
import json
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from hfmca_lightning.cli import options
from hfmca_lightning.cli.paths import OVERWRITE_HELP, check_out, read_config_file
from hfmca_lightning.cli.runs import backbone_of, load_run, run_config
from hfmca_lightning.cli.verbosity import progress
from hfmca_lightning.data.datamodule import BANK, QUERIES
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation import extract_features
from hfmca_lightning.runtime.checkpoint_io import check_checkpoint_path, read_checkpoint
from hfmca_lightning.runtime.files import StagedFiles

__all__ = ["export_backbone", "backbone_description", "run_export_command"]

SPLITS = ("train", "test")

TORCHVISION_LOAD = """import torch, torchvision
from torch import nn
net = torchvision.models.{architecture}()
{stem}net.{classifier} = nn.Identity()
net.load_state_dict(torch.load("backbone.pt", weights_only=True))
net.eval()  # net(images) -> (N, {feature_dim}) features of images normalised with mean/std below
"""
CIFAR_STEM = (
    "net.conv1 = nn.Conv2d(3, net.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)\n"
    "net.maxpool = nn.Identity()\n"
)
TIMM_LOAD = """import timm, torch
net = timm.create_model("{architecture}", num_classes=0{kwargs})
net.load_state_dict(torch.load("backbone.pt", weights_only=True))
net.eval()  # net(images) -> (N, {feature_dim}) features
"""
PACKAGE_LOAD = """import torch
from {module} import {name}
net = {name}(**{init_args!r})
net.load_state_dict(torch.load("backbone.pt", weights_only=True))
net.eval()  # net(images) -> (N, {feature_dim}) features
"""


def _python_path(module_path: str) -> str:
    """``classifier.2`` -> ``classifier[2]`` (Sequential entries are indexed, not attributes)."""
    return "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in module_path.split(".")).lstrip(".")


def backbone_description(
    backbone: nn.Module, backbone_config: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What ``backbone.json`` says about ``backbone`` and the ``state_dict`` to save (keys as the library's model has
    them)."""
    feature_dim = int(getattr(backbone, "feature_dim", 0)) or None
    state = {
        key: value.detach().cpu().contiguous() if isinstance(value, torch.Tensor) else value
        for key, value in backbone.state_dict().items()
    }
    architecture = getattr(backbone, "architecture", None)
    if architecture is not None and hasattr(backbone, "cifar_stem"):  # TorchvisionBackbone / CIFARResNet18
        state = {key.removeprefix("net."): value for key, value in state.items()}
        stem = "cifar" if backbone.cifar_stem else "standard"
        classifier_path = cast(str, backbone.classifier_path)  # a plain attribute; nn.Module's stubs: Tensor | Module
        classifier = _python_path(classifier_path)
        load = TORCHVISION_LOAD.format(
            architecture=architecture,
            stem=CIFAR_STEM if backbone.cifar_stem else "",
            classifier=classifier,
            feature_dim=feature_dim,
        )
        return {
            "library": "torchvision",
            "architecture": architecture,
            "stem": stem,
            "classifier": f"{classifier_path} replaced by nn.Identity()",
            "feature_dim": feature_dim,
            "load": load,
        }, state
    if architecture is not None and hasattr(backbone, "model_kwargs"):  # TimmBackbone
        state = {key.removeprefix("net."): value for key, value in state.items()}
        model_kwargs = cast(dict[str, Any], backbone.model_kwargs)  # a plain attribute, as classifier_path
        kwargs = "".join(f", {key}={value!r}" for key, value in model_kwargs.items())
        load = TIMM_LOAD.format(architecture=architecture, kwargs=kwargs, feature_dim=feature_dim)
        return {
            "library": "timm",
            "architecture": architecture,
            "model_kwargs": model_kwargs,
            "stem": "standard",
            "feature_dim": feature_dim,
            "load": load,
        }, state
    module_name, class_name = type(backbone).__module__, type(backbone).__name__
    init_args = dict((backbone_config or {}).get("init_args") or {})
    load = PACKAGE_LOAD.format(module=module_name, name=class_name, init_args=init_args, feature_dim=feature_dim)
    description = {
        "library": "hfmca_lightning",
        "architecture": f"{module_name}.{class_name}",
        "init_args": init_args,
        "stem": "n/a",
        "feature_dim": feature_dim,
        "load": load,
    }
    return description, state


def export_backbone(
    ckpt_path: str | Path,
    out: str | Path,
    *,
    embeddings: list[str] | None = None,
    device: str = "cpu",
    config_path: str | Path | None = None,
) -> Path:
    """Write ``backbone.pt``, ``backbone.json`` and, for each split in ``embeddings`` (``train``: the labelled
    training split; ``test``), ``embeddings_<split>.npz``; all of them or, on failure, none (the files there before
    stay). An ``embeddings_<split>.npz`` already in ``out`` that is not written now goes with the earlier export.
    Returns the JSON's path."""
    ckpt_path, out = Path(ckpt_path), Path(out)
    checkpoint = read_checkpoint(ckpt_path)
    module, datamodule = load_run(ckpt_path, config_path, checkpoint=checkpoint)
    backbone = backbone_of(module)
    backbone_config = ((run_config(ckpt_path, checkpoint, config_path).get("model") or {}).get("init_args") or {}).get(
        "backbone"
    )
    description, state = backbone_description(backbone, backbone_config)
    source = datamodule.source
    description.update(
        normalisation={
            "mean": list(source.mean),
            "std": list(source.std),
            "pixel_range": "[0, 1] before normalisation",
        },
        image_size=source.image_size,
        eval_resize=getattr(source, "eval_resize", None) or source.image_size,
        method=type(module).__name__,
        checkpoint=str(ckpt_path),
        epoch=checkpoint.get("epoch"),
        global_step=checkpoint.get("global_step"),
        torch_version=torch.__version__,
    )
    with StagedFiles() as files:
        written = {"backbone.pt": files.write(out / "backbone.pt", lambda handle: torch.save(state, handle))}
        if embeddings:
            if datamodule.evaluation_splits is None:
                raise ConfigurationError(
                    "the run's data has no labelled evaluation splits to embed; leave out --embeddings"
                )
            module.to(device)
            for split in embeddings:
                loader = datamodule.evaluation_loader({"train": BANK, "test": QUERIES}[split], tuples=True)
                batches = progress(loader, f"embeddings of the {split} split", total=len(loader))
                features, labels = extract_features(module, batches, device)
                name = f"embeddings_{split}.npz"
                save = partial(np.savez, features=features.numpy(), labels=labels.numpy())
                written[name] = files.write(out / name, save)
        description["sha256"] = {name: _sha256(path) for name, path in written.items()}
        files.write_text(out / "backbone.json", json.dumps(description, indent=1))  # last: it describes the others
    for split in SPLITS:  # an earlier export's embeddings, of another checkpoint: gone once the new files are in place
        if f"embeddings_{split}.npz" not in written:
            (out / f"embeddings_{split}.npz").unlink(missing_ok=True)
    return out / "backbone.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_export_command(argv: list[str]) -> None:
    """Parse and run ``export ...``."""
    parser = options.OneLineParser(
        prog="hfmca export", description="A trained backbone as plain weights (torchvision / timm / state_dict)."
    )
    parser.add_argument("--ckpt_path", required=True)
    parser.add_argument(
        "--out",
        required=True,
        help="output folder (backbone.pt, backbone.json, embeddings_<split>.npz); must be empty unless --overwrite",
    )
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    parser.add_argument(
        "--embeddings",
        nargs="*",
        choices=list(SPLITS),
        default=None,
        help="also write features and labels of these splits (no value: both)",
    )
    parser.add_argument("--config", default=None, help="the run's YAML, for checkpoints not written by `hfmca fit`")
    parser.add_argument("--device", type=options.device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.config is not None:
        read_config_file(args.config)  # a file that is no YAML mapping: one line, before any work
    check_checkpoint_path(args.ckpt_path)  # missing, or a folder: one line, before the output folder is made
    check_out(args.out, args.overwrite)
    splits = list(SPLITS) if args.embeddings == [] else args.embeddings
    splits = None if splits is None else list(dict.fromkeys(splits))  # `train train`: one file, written once
    path = export_backbone(args.ckpt_path, args.out, embeddings=splits, device=args.device, config_path=args.config)
    print(f"wrote {path.parent}")
