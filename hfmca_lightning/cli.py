"""The ``hfmca`` console script: LightningCLI over any LightningModule / LightningDataModule.

    hfmca fit --config configs/cifar10_ss.yaml
    hfmca fit --config configs/cifar10_ss.yaml --ckpt_path last      # resume exactly
    hfmca validate --config configs/cifar10_ss.yaml --ckpt_path last
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from hfmca_lightning.callbacks.run_state import RunState, saved_wandb_run_id
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.loggers import OfflineSafeWandbLogger

__all__ = ["HFMCACLI", "main"]


class HFMCACLI(LightningCLI):
    """LightningCLI with the project's defaults: any module / data module by ``class_path``, exact resume."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults={"callbacks": [RunState()]},
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=args,
            run=run,
        )

    def before_fit(self) -> None:
        """Store the resolved config in checkpoints (for ``hfmca analyze``); on resume, point W&B at the
        checkpoint's run before Lightning starts a new one."""
        config = self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False)
        for callback in self.trainer.callbacks:
            if isinstance(callback, RunState):
                callback.config = config
        wandb_loggers = [logger for logger in self.trainer.loggers if isinstance(logger, OfflineSafeWandbLogger)]
        checkpoint = self._resume_checkpoint()
        if wandb_loggers and checkpoint is not None:
            run_id = saved_wandb_run_id(torch.load(checkpoint, map_location="cpu", weights_only=True))
            if run_id:
                for logger in wandb_loggers:
                    logger.resume_run(run_id)

    def _resume_checkpoint(self) -> Path | None:
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt_path is None:
            return None
        if ckpt_path != "last":
            return Path(ckpt_path) if Path(ckpt_path).is_file() else None
        for callback in self.trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                last = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
                if last.is_file():
                    return last
        return None


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``hfmca`` console script; configuration errors are one line, exit status 2.

    ``fit`` / ``validate`` / ``test`` go to LightningCLI; ``analyze`` and ``compare`` to
    :mod:`hfmca_lightning.analyze`.
    """
    argv = sys.argv[1:] if args is None else args
    if argv[:1] in (["-h"], ["--help"]):
        print("hfmca analyze --help / hfmca compare --help: figures from trained checkpoints.\n")
    try:
        if argv and argv[0] in ("analyze", "compare"):
            from hfmca_lightning.analyze import run_analysis_command

            run_analysis_command(argv)
            return
        HFMCACLI(args=args)
    except ConfigurationError as error:
        print(f"hfmca: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
