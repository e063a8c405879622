"""``HFMCACLI``: LightningCLI with the project's defaults, used by ``hfmca fit`` and by ``hfmca analyze``.

Any LightningModule / LightningDataModule by ``class_path``; exact resume (:class:`RunState`), the resolved
config in every checkpoint (:class:`StoredConfig`), atomic checkpoint files and ``config.yaml``, one ``fit`` per
checkpoint folder at a time (:class:`~hfmca_lightning.runtime.run_lock.RunFolderLock`); configuration mistakes come
out as :class:`~hfmca_lightning.errors.ConfigurationError` naming the config key.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

import hfmca_lightning.cli.verbosity as verbosity
from hfmca_lightning.callbacks.checkpoint import PreemptionCheckpoint, noted_checkpoint
from hfmca_lightning.callbacks.optimizer_settings import ConfiguredOptimizerSettings
from hfmca_lightning.callbacks.progress import CostProgressBar, EpochLines
from hfmca_lightning.callbacks.run_state import RunState, saved_csv_log_dirs, saved_wandb_run_id
from hfmca_lightning.callbacks.stored_config import StoredConfig
from hfmca_lightning.cli.config_errors import describe_instantiation_error
from hfmca_lightning.cli.options import SEED_RANGE
from hfmca_lightning.cli.paths import check_config_files
from hfmca_lightning.data import MultiViewDataModule
from hfmca_lightning.errors import ConfigurationError, HFMCAWarning
from hfmca_lightning.loggers import OfflineSafeWandbLogger, continue_csv_log, rewrite_csv_log_atomically
from hfmca_lightning.methods.compatibility import check_strategy
from hfmca_lightning.runtime.checkpoint_io import AtomicCheckpointIO, check_resumable, is_local, read_checkpoint
from hfmca_lightning.runtime.files import write_text_atomically
from hfmca_lightning.runtime.ranks import watch_ranks
from hfmca_lightning.runtime.run_lock import RunFolderLock

__all__ = ["HFMCACLI", "AtomicSaveConfig", "checkpoint_folders", "newest_last_checkpoint"]

SUBCOMMANDS = ("fit", "validate", "test")  # not Lightning's predict: no module of the package predicts
NAMED_CHECKPOINTS = ("last", "best", "hpc")
# Trainer options where an integer is a count (of batches or steps) and a number with a decimal point a fraction.
INT_OR_FRACTION = (
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
    "val_check_interval",
    "overfit_batches",
)


def integers_first(typehint: Any) -> Any:
    """``typehint`` with ``int`` tried before ``float`` if it is a union of both. jsonargparse tries a union's types in
    order, and typing caches unions by their set of types: once any module has built ``Optional[Union[float, int]]``,
    Lightning's ``Optional[Union[int, float]]`` is that object, and ``1`` would be read as ``1.0`` (100 %)."""
    arguments = get_args(typehint)
    if get_origin(typehint) is not Union or int not in arguments or float not in arguments:
        return typehint
    ordered = (int, *(argument for argument in arguments if argument is not int))
    return Union.__getitem__(ordered)  # a union of types known at run time only


class AtomicSaveConfig(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` in the run's log folder, written atomically (a temporary file beside it,
    flushed to disk, renamed over it): a kill while it is written leaves the previous file or the new one."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = trainer.log_dir  # broadcasts rank 0's folder: every process calls it
        if log_dir is None or self.multifile or not is_local(log_dir):
            super().setup(trainer, pl_module, stage)
            return
        config_path = Path(log_dir) / self.config_filename
        if not self.overwrite:
            exists = trainer.strategy.broadcast(config_path.is_file() if trainer.is_global_zero else False)
            if exists:
                raise ConfigurationError(
                    f"{config_path} exists: this log folder belongs to an earlier run; give the logger another "
                    "version or save_dir"
                )
        if trainer.is_global_zero:
            write_text_atomically(config_path, self.parser.dump(self.config, skip_none=False))
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)


# Lightning's own code: a MisconfigurationException raised there alone (its checks of limit_*_batches, of the
# loaders, of a callback's needs such as LearningRateMonitor's logger) is about the run's settings.
_LIGHTNING = ("/lightning/pytorch/", "/lightning/fabric/", "/lightning_fabric/", "/pytorch_lightning/")


def _raised_by_lightning_alone(error: BaseException) -> bool:
    """Whether ``error`` was raised by Lightning's code alone below the command (every frame after
    :meth:`HFMCACLI._run_subcommand` in Lightning): a setting's error, not a module's or a callback's code's."""
    frames = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(error.__traceback__)]
    own = next((index for index, name in enumerate(frames) if name.endswith("/cli/trainer_cli.py")), -1)
    below = [name for name in frames[own + 1 :] if not name.endswith("/cli/trainer_cli.py")]
    return bool(below) and all(any(part in name for part in _LIGHTNING) for name in below)


def progress_report() -> tuple[bool, list[Callback]]:
    """``(enable_progress_bar, callbacks)`` of a trainer an ``hfmca`` command runs: on a terminal the costs on the bar
    without a host read per step (:class:`CostProgressBar`); in a log file or a pipe, where a bar's redraws pile up, a
    line per epoch (:class:`EpochLines`); nothing with ``-q``."""
    if verbosity.quiet():
        return False, []
    return True, [CostProgressBar() if verbosity.draws_bars(sys.stdout) else EpochLines()]


def _check_writable(folder: Path, what: str, instead: str) -> None:
    """One line before training when ``folder`` (or, not made yet, the nearest folder above it) cannot be written:
    else the first checkpoint or log row fails, an epoch later."""
    existing = next(part for part in (folder, *folder.parents) if part.exists())
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == folder else f" (it would be made in {existing})"
        raise ConfigurationError(f"{what} {folder} cannot be written{where}: {instead}, or change its permissions")


def checkpoint_folders(trainer: Trainer, last_only: bool = False) -> dict[Path, ModelCheckpoint]:
    """The local checkpoint folders the run's ``ModelCheckpoint`` callbacks write into, known before training (with
    ``last_only``: those where ``--ckpt_path last`` looks, of the callbacks that write ``last.ckpt`` or, a
    :class:`PreemptionCheckpoint` without ``save_last``, the checkpoint of a SIGTERM): each callback's ``dirpath``;
    without one, ``<default_root_dir>/checkpoints`` when the trainer has no logger. (With a logger and no ``dirpath``,
    Lightning writes into the first logger's version folder, known only once the run starts: a new one for a new run,
    the checkpoint's for a resumed one whose first logger is a CSV logger.)"""
    return _folders(trainer, _writes_resume_point if last_only else lambda callback: True)


def _writes_resume_point(callback: ModelCheckpoint) -> bool:
    return bool(callback.save_last) or _notes_newest(callback)


def _notes_newest(callback: ModelCheckpoint) -> bool:
    """Whether the callback, writing no ``last.ckpt``, names the newest checkpoint it saved in its folder
    (:func:`~hfmca_lightning.callbacks.checkpoint.noted_checkpoint`)."""
    return isinstance(callback, PreemptionCheckpoint) and not callback.save_last


def _folders(trainer: Trainer, keep: Callable[[ModelCheckpoint], bool]) -> dict[Path, ModelCheckpoint]:
    """:func:`checkpoint_folders` of the callbacks ``keep`` keeps, each folder with the first of them."""
    folders: dict[Path, ModelCheckpoint] = {}
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or not keep(callback):
            continue
        if callback.dirpath is not None:
            folder = str(callback.dirpath)
        elif not trainer.loggers:
            folder = os.path.join(trainer.default_root_dir, "checkpoints")
        else:
            continue
        if is_local(folder):
            folders.setdefault(Path(os.path.abspath(folder)), callback)
    return folders


def _is_last_checkpoint(path: Path, callback: ModelCheckpoint) -> bool:
    """Whether ``path`` is a ``last.ckpt`` the callback writes: its last name, or that name with the version
    Lightning adds when the name is taken (``last-v1.ckpt``)."""
    return path.is_file() and _is_last_checkpoint_name(path, callback)


def _is_last_checkpoint_name(path: Path, callback: ModelCheckpoint) -> bool:
    if path.suffix != callback.FILE_EXTENSION:
        return False
    name = re.escape(callback.CHECKPOINT_NAME_LAST)
    name = re.sub(r"\\\{.*?\\\}", ".*", name)  # a name with metrics in it: {epoch}-last
    return re.fullmatch(rf"{name}(?:{re.escape(callback.CHECKPOINT_JOIN_CHAR)}v\d+)?", path.stem) is not None


def newest_last_checkpoint(trainer: Trainer) -> Path | None:
    """What ``--ckpt_path last`` resumes: the newest of the ``last.ckpt`` (or ``last-vN.ckpt``) files in the folders of
    the trainer's callbacks that write one (``save_last``) and the newest checkpoint a :class:`PreemptionCheckpoint`
    without ``save_last`` saved into its folder (on SIGTERM or as it saves; named in the folder's
    :data:`~hfmca_lightning.callbacks.checkpoint.NEWEST_NOTE`), never a file of another folder or another callback's
    checkpoint; None when there is none.

    Where there is none but a ``last.ckpt`` link whose file is gone (``save_last: link``: Lightning deletes the file it
    linked to before it links the new one, so a kill in between leaves the link dangling), the newest checkpoint file
    of that folder, with a warning: the run goes on from there instead of starting over."""
    folders = _folders(trainer, lambda callback: bool(callback.save_last))
    listed = {folder: list(folder.iterdir()) if folder.is_dir() else [] for folder in folders}
    candidates = [
        path for folder, paths in listed.items() for path in paths if _is_last_checkpoint(path, folders[folder])
    ]
    candidates += filter(None, (noted_checkpoint(folder) for folder in _folders(trainer, _notes_newest)))
    if candidates:
        return max(candidates, key=lambda path: path.stat().st_mtime)
    for folder, paths in listed.items():
        dangling = [
            path
            for path in paths
            if path.is_symlink() and not path.exists() and _is_last_checkpoint_name(path, folders[folder])
        ]
        files = [path for path in paths if path.suffix == folders[folder].FILE_EXTENSION and path.is_file()]
        if dangling and files:
            newest = max(files, key=lambda path: path.stat().st_mtime)
            rank_zero_warn(
                f"{dangling[0]} links to {os.readlink(dangling[0])}, which is gone (the run stopped while replacing "
                f"it); resuming from the newest checkpoint of that folder, {newest.name}",
                category=HFMCAWarning,
            )
            return newest
    return None


class HFMCACLI(LightningCLI):
    """LightningCLI with the project's defaults: any module / data module by ``class_path``, exact resume,
    atomic checkpoint files, one ``fit`` per checkpoint folder at a time, and configuration mistakes raised as
    :class:`ConfigurationError`."""

    def __init__(self, args: list[str] | dict[str, Any] | None = None, run: bool = True) -> None:
        no_exit = {"exit_on_error": False}
        self.run_folders = RunFolderLock()
        super().__init__(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults={"callbacks": [RunState(), StoredConfig(), ConfiguredOptimizerSettings()]},
            save_config_callback=AtomicSaveConfig,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={**no_exit, **{name: no_exit for name in SUBCOMMANDS}},
            auto_configure_optimizers=False,
            args=args,
            run=run,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's subcommands but ``predict`` (:data:`SUBCOMMANDS`)."""
        return {name: skipped for name, skipped in LightningCLI.subcommands().items() if name in SUBCOMMANDS}

    def add_arguments_to_parser(self, parser: Any) -> None:
        for action in parser._actions:
            name = action.dest.split(".", 1)[-1]
            if action.dest.startswith("trainer.") and name in INT_OR_FRACTION and hasattr(action, "_typehint"):
                action._typehint = integers_first(action._typehint)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        # Arguments given in Python (main(args), hfmca analyze's dict) are the whole command: the process's
        # own sys.argv (pytest's, a notebook kernel's) is not ours to compare them with.
        if isinstance(args, dict):
            self.config = parser.parse_object(args)
        elif args is not None:
            check_config_files(args)
            self.config = parser.parse_args(args)
        else:
            check_config_files(sys.argv[1:])
            super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        seed = (self.config[subcommand] if subcommand else self.config).get("seed_everything")
        if isinstance(seed, int) and not isinstance(seed, bool) and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise ConfigurationError(
                f"seed_everything must be in [0, 2**32 - 1], or true for a random seed; got {seed}"
            )
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if str(ckpt_path) == "best":  # Lightning's best is the best of a fit in the same process
            raise ConfigurationError(
                "--ckpt_path best names the best checkpoint of a fit earlier in the same process, and a new hfmca "
                "command has none: give the checkpoint's path (`hfmca fit` prints it as `best checkpoint:`), or last"
            )
        if ckpt_path is not None and str(ckpt_path) not in NAMED_CHECKPOINTS:
            # missing / corrupt / foreign, or weights alone to continue a run from: one line, before anything is built
            checkpoint = read_checkpoint(ckpt_path, missing_hint=" (or use `--ckpt_path last`: the run's newest)")
            if subcommand == "fit":
                check_resumable(checkpoint, ckpt_path)

    def _parse_ckpt_path(self) -> None:
        """Nothing: Lightning would merge the ``--ckpt_path`` checkpoint's hyper-parameters over the command's config
        here, importing and building the classes they name, and a checkpoint from others may name any code. The
        command's ``--config`` is the run's; the checkpoint gives tensors only (docs/trust.md)."""

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:
            described = describe_instantiation_error(
                error, self.config.get(self.subcommand) if self.subcommand else self.config
            )
            if described is None:
                raise
            raise ConfigurationError(described) from None

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        settings = self.config[self.subcommand] if self.subcommand else self.config
        if isinstance(named := settings["trainer"].get("strategy"), str):  # before Lightning's advice for the name
            check_strategy(self.model, named, command=True)
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ImportError) as error:  # an accelerator whose package is missing, ...
            hint = " (no GPU is visible to this process: set trainer.accelerator to cpu or auto)"
            raise ConfigurationError(f"trainer: {error}{hint if 'gpu backend' in str(error) else ''}") from None
        except RuntimeError as error:
            if not str(error).startswith("Found more than one stateful callback"):
                raise
            message = f"trainer: {error} (trainer.callbacks+= adds to the config's callbacks)"
            raise ConfigurationError(message, parameter="callbacks") from None
        fitting = self.subcommand == "fit"  # the only command that converts BatchNorm layers
        if fitting and settings["trainer"].get("sync_batchnorm") and isinstance(trainer.accelerator, CPUAccelerator):
            raise ConfigurationError(
                "trainer.sync_batchnorm: torch's SyncBatchNorm runs on GPUs only; leave it out for a run on CPUs"
            )
        check_strategy(self.model, trainer.strategy, command=True)  # a class_path strategy (names: above)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        watch_ranks(trainer, failed_exit_status=1)  # the hfmca command's status for a failed run
        return trainer

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        # Unless the config has a bar of its own: progress_report's.
        given = config.get("callbacks") or []
        configured = [*(given if isinstance(given, list) else [given]), *callbacks]
        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(callback, ProgressBar) for callback in configured
        ):
            enable_progress_bar, reports = progress_report()
            config, callbacks = {**config, "enable_progress_bar": enable_progress_bar}, [*callbacks, *reports]
        return super()._instantiate_trainer(config, callbacks)

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            with warnings.catch_warnings():  # the filters a run sets (before_fit) end with it
                super()._run_subcommand(subcommand)
        except MisconfigurationException as error:
            if not _raised_by_lightning_alone(error):  # raised by code (a module's, a callback's): its traceback
                raise
            raise ConfigurationError(f"trainer: {error}") from None
        except ValueError as error:  # --ckpt_path hpc without an HPC checkpoint
            if "ckpt_path=" not in str(error) or not _raised_by_lightning_alone(error):
                raise
            raise ConfigurationError(f"trainer: {error}") from None
        finally:
            self.run_folders.release()  # in-process runs (tests, notebooks): the next run may use the folder

    def before_fit(self) -> None:
        """Lock the run's checkpoint folders, resolve and check the checkpoint to resume, store the resolved config in
        checkpoints (for ``hfmca analyze``), and point W&B and the CSV loggers at the checkpoint's run before Lightning
        starts new ones."""
        config = self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False)
        for callback in self.trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer
            if isinstance(callback, StoredConfig):
                callback.config = config
        self._lock_checkpoint_folders()
        self._check_log_folders()
        self._prepare_resume()
        self._atomic_csv_logs()

    def _prepare_resume(self) -> None:
        """Resuming (``--ckpt_path``): the checkpoint found and checked, W&B and the CSV loggers pointed at its run."""
        named = str(self.config_init[self.subcommand].get("ckpt_path")) in NAMED_CHECKPOINTS  # `last`: found here
        checkpoint_path = self._resume_checkpoint()
        if checkpoint_path is None:
            return
        checkpoint = read_checkpoint(checkpoint_path, check_weights=named)  # a path's weights: checked when parsed
        check_resumable(checkpoint, checkpoint_path)
        # Resuming, the checkpoint folder holds this run's own checkpoints; the data module's state (not the loader's)
        # resumes a stopped epoch exactly (docs/resume.md), which Lightning cannot see.
        for folder in checkpoint_folders(self.trainer):
            warnings.filterwarnings(
                "ignore", message=rf"Checkpoint directory {re.escape(str(folder))} exists and is not"
            )
        if isinstance(self.datamodule, MultiViewDataModule):
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        self.config_init[self.subcommand]["ckpt_path"] = str(checkpoint_path)  # what was checked is what loads
        run_id = saved_wandb_run_id(checkpoint)
        for logger in self.trainer.loggers:
            if run_id and isinstance(logger, OfflineSafeWandbLogger):
                logger.resume_run(run_id)
            elif isinstance(logger, CSVLogger):  # metrics.csv goes on in the resumed run's folder
                continue_csv_log(
                    logger,
                    saved_csv_log_dirs(checkpoint),
                    int(checkpoint.get("global_step", 0)),
                    writes=self.trainer.is_global_zero,
                )

    def _atomic_csv_logs(self) -> None:
        """The CSV loggers of process 0 that no resume continues: ``metrics.csv`` replaced whole when a column is
        added (:func:`~hfmca_lightning.loggers.rewrite_csv_log_atomically`)."""
        if not self.trainer.is_global_zero:
            return
        for logger in self.trainer.loggers:
            if isinstance(logger, CSVLogger):
                rewrite_csv_log_atomically(logger)

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if subcommand in ("validate", "test"):  # Lightning's table repeats epoch-level metrics under every loader
            kwargs["verbose"] = False
        return kwargs

    def after_validate(self) -> None:
        self._print_metrics("validate")

    def after_test(self) -> None:
        self._print_metrics("test")

    def _print_metrics(self, stage: str) -> None:
        """The metrics of ``validate`` / ``test``, each once: a name and a value per line."""
        if not self.trainer.is_global_zero:
            return
        metrics = {
            name: float(value) for name, value in sorted(self.trainer.callback_metrics.items()) if value.numel() == 1
        }
        if not metrics:
            return
        width = max([len(f"{stage} metric"), *(len(name) for name in metrics)])
        print(f"{stage + ' metric':<{width}}  value")
        for name, value in metrics.items():
            print(f"{name:<{width}}  {value:.6g}")

    def after_fit(self) -> None:
        """Say where the run's checkpoints are: the last one to continue from, and the best one (where a metric picks
        it; else the newest kept)."""
        if not self.trainer.is_global_zero:
            return
        for callback in self.trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                best = "best checkpoint" if callback.monitor else "checkpoint"
                for kind, path in (("last checkpoint", callback.last_model_path), (best, callback.best_model_path)):
                    if path:
                        verbosity.stage(f"{kind}: {path}")

    def _lock_checkpoint_folders(self) -> None:
        """One ``fit`` per checkpoint folder: process 0 (the one that launches the others under DDP) locks every
        folder the run writes checkpoints into, or the command ends in one line if a live run holds one."""
        if not self.trainer.is_global_zero:
            return
        for folder in sorted(checkpoint_folders(self.trainer)):
            if folder.exists() and not folder.is_dir():  # else found when the first checkpoint is written
                raise ConfigurationError(
                    f"checkpoint folder {folder} is a file: give ModelCheckpoint a dirpath that is a folder, or move "
                    "the file"
                )
            _check_writable(folder, "checkpoint folder", "give ModelCheckpoint another dirpath")
            self.run_folders.acquire(folder)

    def _check_log_folders(self) -> None:
        """A logger's local ``save_dir`` with a file on its path is one line before training (else the logger's first
        write fails with an operating-system error)."""
        for logger in self.trainer.loggers:
            folder = getattr(logger, "save_dir", None)
            if not isinstance(folder, (str, Path)) or not is_local(folder):
                continue
            path = Path(folder).absolute()
            blocking = next((part for part in (path, *path.parents) if part.exists() and not part.is_dir()), None)
            if blocking is not None:
                raise ConfigurationError(
                    f"{type(logger).__name__} save_dir {folder}: {blocking} is a file, not a folder; give the logger "
                    "another save_dir, or move the file"
                )
            _check_writable(path, f"{type(logger).__name__} save_dir", "give the logger another save_dir")

    def _resume_checkpoint(self) -> Path | None:
        """The file ``--ckpt_path`` names; for ``last``, :func:`newest_last_checkpoint`: the newest ``last.ckpt`` (or
        ``last-vN.ckpt``, or SIGTERM checkpoint) in the folders of this run's callbacks, never another folder's."""
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt_path is None or str(ckpt_path) in ("best", "hpc"):
            return None
        if str(ckpt_path) != "last":
            return Path(ckpt_path)
        newest = newest_last_checkpoint(self.trainer)
        if newest is None:
            rank_zero_info(f"hfmca: no last checkpoint in {self._last_folders()}; starting a new run.")
            self.config_init[self.subcommand]["ckpt_path"] = None
        return newest

    def _last_folders(self) -> str:
        """Where ``--ckpt_path last`` looks, in words."""
        return (
            ", ".join(str(folder) for folder in sorted(checkpoint_folders(self.trainer, last_only=True)))
            or "no checkpoint folder of this run: none of its ModelCheckpoint callbacks has both a dirpath and "
            "save_last: true, nor is a PreemptionCheckpoint with a dirpath"
        )

    def before_validate(self) -> None:
        """``--ckpt_path last``: the run's newest ``last.ckpt``, checked as a path is; without one, one line (Lightning
        would score the untrained weights and exit 0)."""
        self._atomic_csv_logs()
        if str(self.config_init[self.subcommand].get("ckpt_path")) != "last":
            return
        newest = newest_last_checkpoint(self.trainer)
        if newest is None and not checkpoint_folders(self.trainer, last_only=True):
            return  # no local folder to look in (a remote dirpath, a logger's version folder): Lightning's lookup
        if newest is None:
            raise ConfigurationError(
                f"--ckpt_path last: no last checkpoint in {self._last_folders()}; {self.subcommand} scores a "
                "checkpoint: give its path, or fit first"
            )
        read_checkpoint(newest, check_weights=True)
        self.config_init[self.subcommand]["ckpt_path"] = str(newest)

    def before_test(self) -> None:
        self.before_validate()
