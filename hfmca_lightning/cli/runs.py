"""Trained runs as objects: the module and DataModule of a checkpoint, rebuilt from the config inside it.

Shared by ``hfmca analyze`` / ``compare`` / ``linear`` / ``knn`` / ``export``. Any LightningModule of the
package is accepted (:class:`~hfmca_lightning.methods.HFMCAModule` and every baseline): each has a
``backbone`` and a ``forward`` that returns backbone features ``(N, D)``.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentError, set_parsing_settings
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from hfmca_lightning.callbacks.stored_config import saved_config
from hfmca_lightning.cli.config_errors import describe_parser_error
from hfmca_lightning.cli.paths import read_config_file
from hfmca_lightning.cli.trainer_cli import HFMCACLI
from hfmca_lightning.data.datamodule import MultiViewDataModule
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.methods.compatibility import ArchitectureMismatch
from hfmca_lightning.runtime.checkpoint_io import read_checkpoint

__all__ = [
    "TRUSTED_PACKAGES",
    "backbone_of",
    "load_run",
    "run_config",
    "trusted_imports_only",
    "untrusted_config_problem",
]


# Where the classes of a config stored in a checkpoint may come from: a checkpoint from someone else names classes
# to import, and importing a module runs it. A config the user gives (--config) is the user's own, and trusted.
TRUSTED_PACKAGES = ("hfmca_lightning", "torch", "torchvision", "timm", "lightly", "lightning")
# Trainer settings a stored config may carry (how to build the run's model and data does not depend on the others);
# any other only at its default.
HARMLESS_TRAINER_KEYS = frozenset(
    {
        "accelerator", "devices", "num_nodes", "precision", "max_epochs", "min_epochs", "max_steps", "min_steps",
        "max_time", "limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
        "overfit_batches", "val_check_interval", "check_val_every_n_epoch", "num_sanity_val_steps",
        "log_every_n_steps", "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
        "deterministic", "benchmark", "inference_mode", "use_distributed_sampler", "sync_batchnorm",
        "reload_dataloaders_every_n_epochs", "enable_checkpointing", "enable_progress_bar", "enable_model_summary",
        "barebones", "detect_anomaly", "fast_dev_run", "default_root_dir", "logger", "callbacks", "strategy",
        "plugins", "profiler", "model_registry",
    }
)  # fmt: skip
# Of those, the ones whose value may name classes: only None, False or a plain name (no class_path) from a stored
# config; logger and callbacks are replaced by the commands anyway.
_CLASS_VALUED_TRAINER_KEYS = ("strategy", "plugins", "profiler")
# A class or function named by a dotted string without class_path (jsonargparse reads ``model: package.Class`` and
# callables so), where its top-level module exists; file names are not names of code.
_DOTTED_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_FILE_SUFFIXES = frozenset(
    {"png", "jpg", "jpeg", "yaml", "yml", "json", "ckpt", "pt", "pth", "csv", "txt", "npz", "npy", "tar", "gz",
     "zip", "html", "log", "md", "bin"}
)  # fmt: skip


def run_config(
    ckpt_path: str | Path, checkpoint: dict[str, Any], config_path: str | Path | None = None
) -> dict[str, Any]:
    """The run's config: ``config_path`` (the user's own YAML), or the YAML ``hfmca fit`` stored in ``checkpoint``,
    which is data from whoever wrote the file: its classes must come from :data:`TRUSTED_PACKAGES` and its trainer
    settings from :data:`HARMLESS_TRAINER_KEYS`, or it is refused in one line naming the key, before anything is
    imported."""
    if config_path:
        return read_config_file(config_path)
    text = saved_config(checkpoint)
    if text is None:
        raise ConfigurationError(
            f"{ckpt_path} holds no config (it was not written by `hfmca fit`); pass --config with the run's YAML"
        )
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        first = str(error).strip().splitlines()[0]
        raise ConfigurationError(f"{ckpt_path}: the config stored in the checkpoint is not YAML ({first})") from None
    problem = untrusted_config_problem(config)
    if problem is not None:
        raise ConfigurationError(
            f"{ckpt_path}: the config stored in the checkpoint is refused: {problem}. If you trust it, pass it as "
            "your own with --config <the run's YAML>"
        )
    return config


def untrusted_config_problem(config: Any) -> str | None:
    """What a stored config may not carry: a class outside :data:`TRUSTED_PACKAGES` (``class_path`` or a dotted class
    name anywhere), a trainer setting outside :data:`HARMLESS_TRAINER_KEYS`, or a class-valued trainer setting;
    ``None`` when there is nothing."""
    if not isinstance(config, dict):
        return "it is not a mapping of settings"
    for section, forms in (("trainer", dict), ("model", (dict, str)), ("data", (dict, str))):  # model: pkg.Class
        value = config.get(section)
        if value is not None and not isinstance(value, forms):
            return f"{section} is a {type(value).__name__}, not a mapping of settings"
    defaults = _trainer_defaults()
    for key, value in (config.get("trainer") or {}).items():
        if key not in HARMLESS_TRAINER_KEYS and (key not in defaults or value != defaults[key]):
            return f"trainer.{key} is not a setting a stored config may carry"
        if key in _CLASS_VALUED_TRAINER_KEYS and value not in (None, False, "auto") and not _plain_name(value):
            return f"trainer.{key} names {_shown(value)}; a stored config may only leave it unset"
    return _untrusted_class(config, "")


def _trainer_defaults() -> dict[str, Any]:
    """``Trainer``'s arguments and their defaults (a stored config lists every one)."""
    parameters = inspect.signature(Trainer.__init__).parameters.values()
    return {parameter.name: parameter.default for parameter in parameters if parameter.default is not parameter.empty}


@dataclass
class _Visited:
    """What the check has read: containers (a YAML alias meets one again, a recursive one forever) and files."""

    nodes: set[int] = field(default_factory=set)
    files: set[Path] = field(default_factory=set)


def _untrusted_class(node: Any, where: str, base: Path | None = None, visited: _Visited | None = None) -> str | None:
    """The first value under ``node`` (at ``where``) naming code outside :data:`TRUSTED_PACKAGES`, read as jsonargparse
    reads values; ``base``: the folder of the config file ``node`` came from (relative paths in it start there)."""
    visited = _Visited() if visited is None else visited
    if isinstance(node, (dict, list)):
        if id(node) in visited.nodes:
            return None
        visited.nodes.add(id(node))
    if isinstance(node, dict):
        for key, value in node.items():
            at = f"{where}.{key}" if where else str(key)
            if key == "class_path" and not _trusted(value):
                return f"{at} names {_shown(value)}, outside {', '.join(TRUSTED_PACKAGES)}"
            if key == "class_path" and (why := _not_a_trusted_class(value)) is not None:
                return f"{at} names {_shown(value)}, {why}"
            found = _untrusted_class(value, at, base, visited)
            if found is not None:
                return found
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found = _untrusted_class(value, f"{where}[{index}]", base, visited)
            if found is not None:
                return found
    elif isinstance(node, str):
        text = node.strip()
        # jsonargparse reads a string given for a class or callable as YAML (``"class_path: ..."``, ``{...}``,
        # ``'pkg.Class'``) or as the path of a config file: what either holds is checked
        held = _parsed(text)
        if isinstance(held, (dict, list)) or (isinstance(held, str) and held.strip() != text):
            return _untrusted_class(held, where, base, visited)
        for path in _paths(text, base):
            try:
                resolved = path.resolve(strict=True)
                status = resolved.stat()
            except (OSError, RuntimeError):  # a dangling or looping link: nothing to read
                continue
            if stat.S_ISDIR(status.st_mode):
                continue
            if not stat.S_ISREG(status.st_mode) or str(resolved).startswith(_SYSTEM_FOLDERS):
                # jsonargparse would read it as a config file: a device, pipe, socket or file of the system's folders
                # (/proc/kmsg reports size 0 and never ends) can make that read hang
                return (
                    f"{where} names {_shown(node)}, a device, pipe or system file, which a stored config may not name"
                )
            if resolved not in visited.files:
                visited.files.add(resolved)
                found = _untrusted_class(_file_settings(resolved, status.st_size), where, resolved.parent, visited)
                if found is not None:
                    return found
        if (
            _DOTTED_NAME.match(text)
            and text.rsplit(".", 1)[-1].lower() not in _FILE_SUFFIXES
            and not _trusted(text)
            and _importable(text)
        ):
            return f"{where} names {_shown(node)}, code outside {', '.join(TRUSTED_PACKAGES)}"
        if _DOTTED_NAME.match(text) and _trusted(text) and (why := _not_a_trusted_class(text)) is not None:
            return f"{where} names {_shown(node)}, {why}; a stored config may name classes only"
    return None


@contextmanager
def trusted_imports_only() -> Iterator[None]:
    """While a stored config is parsed and its objects built, jsonargparse imports nothing a value names outside
    :data:`TRUSTED_PACKAGES` (whatever the process allowed before) and builds no class given where any value is
    accepted: the second guard, behind :func:`untrusted_config_problem`, against whatever way of naming code a check of
    the YAML does not know. The settings are global in jsonargparse; they are put back afterwards."""
    from jsonargparse import _common  # the settings have a setter that adds to them, but no getter or reset

    saved = {key: _common.parsing_settings[key] for key in _IMPORT_SETTINGS}
    try:
        _common.parsing_settings["import_path_verdicts"] = dict.fromkeys(_common.default_import_path_denylist, False)
        set_parsing_settings(
            import_path_denylist=["*"],
            import_path_allowlist=list(TRUSTED_PACKAGES),
            instantiate_subclass_spec_in_any=False,
        )
        yield
    finally:
        _common.parsing_settings.update(saved)


_IMPORT_SETTINGS = ("import_path_verdicts", "import_paths_enforced", "instantiate_subclass_spec_in_any")


def _parsed(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        return None


_CONFIG_FILE_BYTES = 1 << 20
_SYSTEM_FOLDERS = ("/proc/", "/sys/", "/dev/")


def _paths(text: str, base: Path | None) -> list[Path]:
    """Where jsonargparse could find a config file named ``text``: from the working directory and, for a value read
    from a config file, from that file's folder; the paths that exist."""
    if not text or "\n" in text or "\0" in text:
        return []
    candidates = [Path(text)] if base is None or Path(text).is_absolute() else [Path(text), base / text]
    try:
        return [path for path in candidates if os.path.lexists(path)]
    except (OSError, ValueError):  # a name too long
        return []


def _file_settings(path: Path, size: int) -> Any:
    """The YAML of the regular file at ``path`` of ``size`` bytes if at most 1 MiB (read without waiting, at most that
    much), else None."""
    if not 0 < size <= _CONFIG_FILE_BYTES:
        return None
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            data = os.read(descriptor, _CONFIG_FILE_BYTES + 1)
        finally:
            os.close(descriptor)
        return _parsed(data.decode()) if len(data) <= _CONFIG_FILE_BYTES else None
    except (OSError, ValueError):  # a file that is no text
        return None


def _trusted(path: Any) -> bool:
    return isinstance(path, str) and path.split(".", 1)[0] in TRUSTED_PACKAGES and "." in path


# Parts of the trusted packages that load native code or pickles, compile, or reach other processes: a stored config
# may name nothing in them.
_CODE_LOADING_MODULES = (
    "torch.ops", "torch.classes", "torch.hub", "torch.jit", "torch.package", "torch.serialization", "torch.library",
    "torch.utils.cpp_extension", "torch.distributed.rpc", "torch.distributed.elastic", "torch.distributed.run",
    "torch.distributed.launch", "torch.multiprocessing", "torch.compiler", "torch._",
)  # fmt: skip
# Routines a stored config may name: the defaults a full config dump holds (torchvision's image-folder data sets'
# `loader`), which read an image file as PIL does.
_TRUSTED_ROUTINES = frozenset({"torchvision.datasets.folder.default_loader", "torchvision.datasets.folder.pil_loader"})


def _not_a_trusted_class(path: str) -> str | None:
    """Why a dotted name of the trusted packages may not come from a stored config (None: it names a class of them,
    outside :data:`_CODE_LOADING_MODULES`): the name of a function or an object is refused, since a routine given for
    a callable setting (a data set's image ``loader``) runs with the values the config gives it."""
    if path.startswith(_CODE_LOADING_MODULES):
        return "which loads code"
    if path in _TRUSTED_ROUTINES:
        return None
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))  # of a trusted package
        except ImportError:
            continue
        except Exception:  # noqa: BLE001 - a module of a trusted package that fails to import: not a class to build
            return "which cannot be imported"
        for name in parts[cut:]:
            found = getattr(found, name, None)
        if found is None:
            return None  # no such name: jsonargparse refuses it in its own words
        if not inspect.isclass(found):
            return f"a {type(found).__name__}, not a class"
        module = getattr(found, "__module__", "") or ""
        return "which loads code" if module.startswith(_CODE_LOADING_MODULES) else None
    return None


def _importable(path: str) -> bool:
    """Whether the top-level module of a dotted path could be imported (found, not imported: module names of a
    model, ``blocks.L1``, are no modules)."""
    try:
        return importlib.util.find_spec(path.split(".", 1)[0]) is not None
    except (ImportError, ValueError):
        return False


def _plain_name(value: Any) -> bool:
    return isinstance(value, str) and "." not in value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_run(
    ckpt_path: str | Path, config_path: str | Path | None = None, checkpoint: dict[str, Any] | None = None
) -> tuple[LightningModule, MultiViewDataModule]:
    """Rebuild the module (with the checkpoint's weights, in float32, in eval mode) and the DataModule of a run.

    The config is the one ``hfmca fit`` stored in the checkpoint, or ``config_path`` for checkpoints
    written elsewhere. The DataModule is set up (its splits are read). ``checkpoint``: the file's contents
    when the caller has already read it.
    """
    ckpt_path = Path(ckpt_path)
    if checkpoint is None:
        checkpoint = read_checkpoint(ckpt_path)
    config = {
        key: value
        for key, value in run_config(ckpt_path, checkpoint, config_path).items()
        if key in ("seed_everything", "trainer", "model", "data")
    }
    # Built in float32 whatever the run trained in ("64-true" builds float64 weights): the commands feed float32
    # images, and the checkpoint's weights are copied into the float32 ones.
    config.setdefault("trainer", {}).update(logger=False, callbacks=[], enable_progress_bar=False, precision="32-true")
    try:
        with nullcontext() if config_path else trusted_imports_only():
            cli = HFMCACLI(args=config, run=False)
    except ArgumentError as error:
        if config_path:
            raise
        denied = re.search(r"Importing '([^']+)' is not allowed", str(error))
        reason = f"it names {denied.group(1)!r}" if denied else describe_parser_error(str(error))
        raise ConfigurationError(
            f"{ckpt_path}: the config stored in the checkpoint is refused: {reason}, and only classes of "
            f"{', '.join(TRUSTED_PACKAGES)} are built from it. If you trust it, pass it as your own with --config "
            "<the run's YAML>"
        ) from None
    module, datamodule = cli.model, cli.datamodule
    if not isinstance(datamodule, MultiViewDataModule):
        raise ConfigurationError(
            f"{ckpt_path}: the run's data is a {type(datamodule).__name__}; evaluation and analysis need a "
            "MultiViewDataModule"
        )
    backbone_of(module)
    where = f"the config {config_path}" if config_path else "the config stored in it"
    remedy = (
        "pass the config of the run that wrote the checkpoint" if config_path else "pass --config with the run's YAML"
    )
    try:
        module.on_load_checkpoint(checkpoint)  # as Lightning restores: the hook, then the state (checked)
        module.load_state_dict(checkpoint["state_dict"])
    except ArchitectureMismatch as error:
        raise ConfigurationError(f"{ckpt_path} does not fit the model of {where} ({error.details}); {remedy}") from None
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        detail = " ".join(lines[1:2] or lines[:1])  # torch's first line only says where: the next says what
        detail = detail if len(detail) <= 300 else detail[:297] + "..."
        raise ConfigurationError(f"{ckpt_path} does not fit the model of {where} ({detail}); {remedy}") from None
    module.eval()
    datamodule.setup("fit")
    return module, datamodule


def backbone_of(module: LightningModule) -> nn.Module:
    """The module's backbone (every method of the package has one under ``backbone``)."""
    backbone = getattr(module, "backbone", None)
    if not isinstance(backbone, nn.Module):
        raise ConfigurationError(
            f"{type(module).__name__} has no `backbone` module; evaluation, export and analysis need one"
        )
    return backbone
