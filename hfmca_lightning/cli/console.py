"""The ``hfmca`` console script.

    hfmca fit --config configs/cifar10_ss.yaml
    hfmca fit --config configs/cifar10_ss.yaml --ckpt_path last      # resume exactly
    hfmca validate --config configs/cifar10_ss.yaml --ckpt_path last
    hfmca analyze --ckpt_path runs/demo/checkpoints/last.ckpt --out analysis/demo
    hfmca linear --ckpt_path runs/demo/checkpoints/last.ckpt                         # linear evaluation
    hfmca knn --ckpt_path runs/demo/checkpoints/last.ckpt --k 20 200 --temperature 0.07 0.1
    hfmca export --ckpt_path runs/demo/checkpoints/last.ckpt --out exported/demo      # plain weights
    hfmca dashboard --entity E --project P                           # the W&B eigenvalue-dynamics view

A mistake in the configuration, the data or a checkpoint ends the command before training with one line,
``hfmca: error: <what, where, how to fix>``, and exit status 2. A run that fails mid-way (a NaN, a failed
factorisation) prints one line and exits with status 1; a run stopped by SIGTERM saves a checkpoint and
exits with status 143.

On Linux with glibc and no CUDA device the command first sets malloc to keep freed memory
(:mod:`hfmca_lightning.runtime.cpu_memory`); ``HFMCA_KEEP_FREED_MEMORY=0`` turns that off, ``=1`` applies it anywhere.
"""

from __future__ import annotations

import sys
from argparse import ArgumentError

from lightning.pytorch.utilities.exceptions import SIGTERMException

from hfmca_lightning.cli.config_errors import describe_parser_error
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.losses.hfmca_cost import CostFactorisationError
from hfmca_lightning.runtime.cpu_memory import keep_freed_memory_for_cpu_runs

__all__ = ["main"]

EXIT_CONFIGURATION, EXIT_FAILED, EXIT_SIGTERM = 2, 1, 128 + 15
ANALYSIS_COMMANDS = ("analyze", "compare")
EVALUATION_COMMANDS = ("linear", "knn")


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``hfmca`` console script.

    ``fit`` / ``validate`` / ``test`` go to LightningCLI; ``analyze`` and ``compare`` to
    :mod:`hfmca_lightning.cli.analyze`; ``linear`` and ``knn`` to :mod:`hfmca_lightning.cli.evaluate`; ``export`` to
    :mod:`hfmca_lightning.cli.export`. Configuration errors: one line, exit status 2; a run that fails:
    one line, exit status 1; SIGTERM: checkpoint written, exit status 143.
    """
    argv = sys.argv[1:] if args is None else args
    keep_freed_memory_for_cpu_runs()  # CPU steps without page faults (hfmca_lightning.runtime.cpu_memory)
    if argv[:1] in (["-h"], ["--help"]):
        print(
            "hfmca analyze --help / hfmca compare --help: figures from trained checkpoints.\n"
            "hfmca linear --help / hfmca knn --help: linear and kNN evaluation of a checkpoint.\n"
            "hfmca export --help: a trained backbone as plain torchvision / timm weights.\n"
            "hfmca dashboard --help: create the W&B eigenvalue-dynamics view of a project.\n"
        )
    try:
        if argv and argv[0] in ANALYSIS_COMMANDS:
            from hfmca_lightning.cli.analyze import run_analysis_command

            run_analysis_command(argv)
            return
        if argv and argv[0] in EVALUATION_COMMANDS:
            from hfmca_lightning.cli.evaluate import run_evaluation_command

            run_evaluation_command(argv)
            return
        if argv and argv[0] == "export":
            from hfmca_lightning.cli.export import run_export_command

            run_export_command(argv[1:])
            return
        if argv and argv[0] == "dashboard":
            from hfmca_lightning.cli.dashboard import run_dashboard_command

            run_dashboard_command(argv[1:])
            return
        from hfmca_lightning.cli.trainer_cli import HFMCACLI

        HFMCACLI(args=args)
    except ConfigurationError as error:
        _exit(f"hfmca: error: {_original_message(error)}", EXIT_CONFIGURATION)
    except ArgumentError as error:
        _exit(f"hfmca: error: {describe_parser_error(str(error))}", EXIT_CONFIGURATION)
    except CostFactorisationError as error:
        # Under DDP every process raises the same error (the checks are all-reduced): process 0 says it.
        _exit(f"hfmca: error: {error}" if _is_rank_zero() else "", EXIT_FAILED)
    except SIGTERMException:
        _exit("hfmca: stopped by SIGTERM; continue with the same command and `--ckpt_path last`.", EXIT_SIGTERM)


def _original_message(error: BaseException) -> str:
    """The error's own message, also when a DataLoader worker raised it (the main process re-raises it with
    the worker's traceback in the message)."""
    text = str(error)
    if "Original Traceback" not in text:
        return text
    prefix = f"{type(error).__name__}: "
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return lines[-1][len(prefix) :] if lines else text.strip().splitlines()[-1]


def _is_rank_zero() -> bool:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def _exit(message: str, status: int) -> None:
    if message:
        print(message, file=sys.stderr)
    raise SystemExit(status) from None


if __name__ == "__main__":
    main()
