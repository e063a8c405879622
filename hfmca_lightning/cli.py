"""The ``hfmca`` console script: LightningCLI over any LightningModule / LightningDataModule.

    hfmca fit --config configs/cifar10_ss.yaml
    hfmca fit --config configs/cifar10_ss.yaml --ckpt_path last      # resume exactly
    hfmca validate --config configs/cifar10_ss.yaml --ckpt_path last
"""

from __future__ import annotations

import sys

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

from hfmca_lightning.callbacks.run_state import RunState
from hfmca_lightning.errors import ConfigurationError

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


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``hfmca`` console script; configuration errors are one line, exit status 2."""
    try:
        HFMCACLI(args=args)
    except ConfigurationError as error:
        print(f"hfmca: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
