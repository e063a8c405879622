"""``HFMCACLI``: LightningCLI with the project's defaults, used by ``hfmca fit`` and by ``hfmca analyze``.

Any LightningModule / LightningDataModule by ``class_path``; exact resume (:class:`RunState`), the resolved
config in every checkpoint (:class:`StoredConfig`), atomic checkpoint files; configuration mistakes come
out as :class:`~hfmca_lightning.errors.ConfigurationError` naming the config key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union, get_args, get_origin

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from hfmca_lightning.callbacks.progress import CostProgressBar
from hfmca_lightning.callbacks.run_state import RunState, saved_wandb_run_id
from hfmca_lightning.callbacks.stored_config import StoredConfig
from hfmca_lightning.cli.config_errors import describe_instantiation_error
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.loggers import OfflineSafeWandbLogger
from hfmca_lightning.runtime.checkpoint_io import AtomicCheckpointIO, read_checkpoint
from hfmca_lightning.runtime.ranks import watch_ranks

__all__ = ["HFMCACLI"]

SUBCOMMANDS = ("fit", "validate", "test", "predict")
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


class HFMCACLI(LightningCLI):
    """LightningCLI with the project's defaults: any module / data module by ``class_path``, exact resume,
    atomic checkpoint files, and configuration mistakes raised as :class:`ConfigurationError`."""

    def __init__(self, args: list[str] | dict[str, Any] | None = None, run: bool = True) -> None:
        no_exit = {"exit_on_error": False}
        super().__init__(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults={"callbacks": [RunState(), StoredConfig()]},
            save_config_kwargs={"overwrite": True},
            parser_kwargs={**no_exit, **{name: no_exit for name in SUBCOMMANDS}},
            auto_configure_optimizers=False,
            args=args,
            run=run,
        )

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
            self.config = parser.parse_args(args)
        else:
            super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path is not None and str(ckpt_path) not in NAMED_CHECKPOINTS:
            read_checkpoint(ckpt_path)  # missing / corrupt / foreign: one line, before anything is built

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
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except MisconfigurationException as error:
            raise ConfigurationError(f"trainer: {error}") from None
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        watch_ranks(trainer, failed_exit_status=1)  # the hfmca command's status for a failed run
        return trainer

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        # The costs on the bar without a host read per step (CostProgressBar), unless the config has a bar of its own.
        given = config.get("callbacks") or []
        configured = [*(given if isinstance(given, list) else [given]), *callbacks]
        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(callback, ProgressBar) for callback in configured
        ):
            callbacks = [*callbacks, CostProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def before_fit(self) -> None:
        """Resolve and check the checkpoint to resume, store the resolved config in checkpoints (for
        ``hfmca analyze``), and point W&B at the checkpoint's run before Lightning starts a new one."""
        config = self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False)
        for callback in self.trainer.callbacks:
            if isinstance(callback, StoredConfig):
                callback.config = config
        checkpoint_path = self._resume_checkpoint()
        if checkpoint_path is None:
            return
        checkpoint = read_checkpoint(checkpoint_path)
        self.config_init[self.subcommand]["ckpt_path"] = str(checkpoint_path)  # what was checked is what loads
        run_id = saved_wandb_run_id(checkpoint)
        if run_id:
            for logger in self.trainer.loggers:
                if isinstance(logger, OfflineSafeWandbLogger):
                    logger.resume_run(run_id)

    def _resume_checkpoint(self) -> Path | None:
        """The file ``--ckpt_path`` names; for ``last``, the newest ``last*.ckpt`` of the checkpoint folders."""
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt_path is None or str(ckpt_path) in ("best", "hpc"):
            return None
        if str(ckpt_path) != "last":
            return Path(ckpt_path)
        folders = {
            Path(c.dirpath) for c in self.trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath
        }
        candidates = [
            path
            for folder in folders
            for path in folder.glob(f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}*{ModelCheckpoint.FILE_EXTENSION}")
        ]
        if not candidates:
            where = ", ".join(str(folder) for folder in sorted(folders)) or "no ModelCheckpoint dirpath is configured"
            rank_zero_info(f"hfmca: no last checkpoint in {where}; starting a new run.")
            self.config_init[self.subcommand]["ckpt_path"] = None
            return None
        return max(candidates, key=lambda path: path.stat().st_mtime)
