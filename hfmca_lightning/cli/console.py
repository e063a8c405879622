"""The ``hfmca`` console script.

    hfmca fit --config configs/cifar10_ss.yaml
    hfmca fit --config configs/cifar10_ss.yaml --ckpt_path last      # resume exactly
    hfmca validate --config configs/cifar10_ss.yaml --ckpt_path last
    hfmca analyze --ckpt_path runs/demo/checkpoints/last.ckpt --out analysis/demo
    hfmca linear --ckpt_path runs/demo/checkpoints/last.ckpt                         # linear evaluation
    hfmca knn --ckpt_path runs/demo/checkpoints/last.ckpt --k 20 200 --temperature 0.07 0.1
    hfmca export --ckpt_path runs/demo/checkpoints/last.ckpt --out exported/demo      # plain weights
    hfmca dashboard --entity E --project P                           # the W&B eigenvalue-dynamics view
    hfmca -q fit ... / hfmca -v analyze ...                          # quieter / more talkative
    hfmca --version

Exit status: 0 after the command's output; 2 for a mistake in the command line, the configuration, the data or a
checkpoint, an input file that is missing, an output folder that cannot be written or (without ``--overwrite``)
already holds files, or a checkpoint folder another live ``fit`` writes into (one line ``hfmca: error: <what, where,
how to fix>``, before any training or other work; a missing or unknown command: the commands there are and the
closest one); 1 for a command that fails mid-way (a NaN, a failed factorisation, a full disk or another
operating-system error: one line naming the file; files are replaced whole, so what was there before stays); 130
after Ctrl-C (SIGINT: one line ``hfmca: interrupted``; ``fit`` first shuts down as Lightning does); 143 after
SIGTERM (``fit`` first writes a checkpoint). In every case the command's data-loader workers are stopped before it
exits (:mod:`hfmca_lightning.runtime.workers`).

Output: ``fit`` prints Lightning's usual lines (without its advertisements), a bar on a terminal and a line per
epoch in a log; the commands that train nothing print only their own lines and results (``validate`` / ``test``: a
table of their metrics), with a progress bar per long stage when standard error is a terminal, a line per stage
otherwise. ``-q`` leaves only warnings and errors (and the results), ``-v`` shows Lightning's lines in every
command.

On Linux with glibc and no CUDA device the command first sets malloc to keep freed memory
(:mod:`hfmca_lightning.runtime.cpu_memory`); ``HFMCA_KEEP_FREED_MEMORY=0`` turns that off, ``=1`` applies it anywhere.
"""

from __future__ import annotations

import difflib
import os
import re
import signal
import sys
import threading
from argparse import ArgumentError
from types import FrameType

from lightning.pytorch.utilities.exceptions import SIGTERMException

import hfmca_lightning.cli.verbosity as verbosity
from hfmca_lightning.callbacks.health import CollapseError
from hfmca_lightning.cli.config_errors import describe_parser_error
from hfmca_lightning.cli.paths import describe_os_error
from hfmca_lightning.errors import ConfigurationError
from hfmca_lightning.evaluation.linear import NonFiniteLossError
from hfmca_lightning.losses.hfmca_cost import CostFactorisationError
from hfmca_lightning.methods.update_guard import NonFiniteStepError
from hfmca_lightning.runtime.cpu_memory import keep_freed_memory_for_cpu_runs
from hfmca_lightning.runtime.workers import shutdown_workers

__all__ = ["main"]

EXIT_CONFIGURATION, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_SIGTERM = 2, 1, 128 + 2, 128 + 15
ANALYSIS_COMMANDS = ("analyze", "compare")
EVALUATION_COMMANDS = ("linear", "knn")
LIGHTNING_COMMANDS = ("fit", "validate", "test")  # run by LightningCLI
COMMANDS = (*LIGHTNING_COMMANDS, *ANALYSIS_COMMANDS, *EVALUATION_COMMANDS, "export", "dashboard")
PACKAGE = "hfmca_lightning"
_NO_SUBCOMMAND = re.compile(r'^expected "subcommand" to be one of .* but it was not provided')
_INVALID_SUBCOMMAND = re.compile(r"^argument subcommand: invalid choice: '([^']*)'")
_NO_MODEL_OR_DATA = re.compile(r"^the following arguments are required: (\w+)\.(?:data|model)\b")


_RESEND_AFTER_S = 0.05  # a signal Python dropped is sent again once the code that dropped it has returned


class Terminated(BaseException):
    """SIGTERM in a command that trains nothing: raised where the command is, so that it cleans up on the way out."""


class _Signals:
    """SIGINT and SIGTERM as exceptions in the main thread (Ctrl-C: ``KeyboardInterrupt``, as Python does; SIGTERM:
    :class:`Terminated`), remembering that they came: Lightning turns Ctrl-C during ``fit`` into its graceful shutdown
    and ``SystemExit(1)``, which the command still reports as an interruption.

    Where Python cannot raise them (a signal that arrives during ``fork`` runs its handler in an at-fork callback; one
    in a finaliser), Python reports the exception as unraisable and drops it: :meth:`_unraisable` sends the signal
    again a moment later, from a thread (sent from the hook itself, it would be handled inside the hook). A
    data-loader worker between its fork and its ``worker_init_fn``
    (:func:`~hfmca_lightning.runtime.workers.leave_signals_to_the_main_process`) ignores them: the main process stops
    it. Once a signal has come, a finaliser that fails (an object the signal cut short while it was built: a
    DataLoader iterator) prints nothing; the command says in one line what happened."""

    def __init__(self) -> None:
        self.interrupted = False
        self.terminating = False
        self.pid = os.getpid()

    def install(self, sigterm: bool = True) -> None:
        """Handle SIGINT, and SIGTERM unless ``sigterm`` is False (``fit`` / ``validate`` / ``test``: Lightning's own
        SIGTERM handling lets the step finish and writes the preemption checkpoint; a handler installed first would
        join its chain and raise mid-step)."""
        signal.signal(signal.SIGINT, self._on_sigint)
        if sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:  # a worker not yet started
            return
        self.interrupted = True
        sys.unraisablehook = self._unraisable
        raise KeyboardInterrupt

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid or self.terminating:  # a worker not yet started; or the clean-up is under way
            return
        self.terminating = True
        sys.unraisablehook = self._unraisable
        raise Terminated

    def _unraisable(self, unraisable: sys.UnraisableHookArgs) -> None:
        """``sys.unraisablehook`` once a signal came: the signal whose exception Python dropped is sent again; a
        finaliser's failure is not printed; anything else is, as Python does."""
        if unraisable.exc_type in (Terminated, KeyboardInterrupt):
            if unraisable.exc_type is Terminated:
                self.terminating = False
            again = signal.SIGTERM if unraisable.exc_type is Terminated else signal.SIGINT
            resend = threading.Timer(_RESEND_AFTER_S, os.kill, (self.pid, again))
            resend.daemon = True
            resend.start()
        elif getattr(unraisable.object, "__name__", None) != "__del__":
            sys.__unraisablehook__(unraisable)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``hfmca`` console script.

    ``fit`` / ``validate`` / ``test`` go to LightningCLI; ``analyze`` and ``compare`` to
    :mod:`hfmca_lightning.cli.analyze`; ``linear`` and ``knn`` to :mod:`hfmca_lightning.cli.evaluate`; ``export`` to
    :mod:`hfmca_lightning.cli.export`; ``dashboard`` to :mod:`hfmca_lightning.cli.dashboard`. Exit statuses as the
    module says.
    """
    argv = list(sys.argv[1:] if args is None else args)
    level = verbosity.DEFAULT
    while argv[:1] in (["-q"], ["--quiet"], ["-v"], ["--verbose"]):
        level = verbosity.QUIET if argv.pop(0) in ("-q", "--quiet") else verbosity.VERBOSE
    command = argv[0] if argv else ""
    if command == "--version":
        print(f"hfmca {_version()}")
        return
    if not command or not (command.startswith("-") or command in COMMANDS):
        _exit(f"hfmca: error: {_unknown_command(command)}", EXIT_CONFIGURATION)
    verbosity.configure(level, trains=command == "fit")
    keep_freed_memory_for_cpu_runs()  # CPU steps without page faults (hfmca_lightning.runtime.cpu_memory)
    if argv[:1] in (["-h"], ["--help"]):
        print(
            "hfmca [-q | -v] <command>: -q warnings, errors and results only; -v Lightning's lines in every command.\n"
            "hfmca analyze --help / hfmca compare --help: figures from trained checkpoints.\n"
            "hfmca linear --help / hfmca knn --help: linear and kNN evaluation of a checkpoint.\n"
            "hfmca export --help: a trained backbone as plain torchvision / timm weights.\n"
            "hfmca dashboard --help: create the W&B eigenvalue-dynamics view of a project.\n"
        )
    signals = _Signals()
    if args is None:  # the console script: the process is ours (not a test calling main in-process)
        signals.install(sigterm=command not in LIGHTNING_COMMANDS)
    try:
        _run(command, argv, args)
    except ConfigurationError as error:
        # Raised during set-up under DDP, every process raises it: process 0 says it (before the processes are
        # joined, each is alone and says its own).
        line = f"hfmca: error: {_original_message(error)}"
        _exit(line if _is_rank_zero() or not _distributed() else "", EXIT_CONFIGURATION)
    except ArgumentError as error:
        _exit(f"hfmca: error: {_describe_argument_error(str(error), argv)}", EXIT_CONFIGURATION)
    except (CostFactorisationError, NonFiniteStepError, NonFiniteLossError, CollapseError) as error:
        # Under DDP every process raises the same error (the checks are all-reduced): process 0 says it.
        _exit(f"hfmca: error: {error}" if _is_rank_zero() else "", EXIT_FAILED)
    except OSError as error:  # mid-way: a full disk, a file size limit, a file removed under the command
        _stop_if_one_process_failed(error, command)
        _exit(f"hfmca: error: {describe_os_error(error)}", EXIT_FAILED)
    except (SIGTERMException, Terminated):
        after = "continue with the same command and `--ckpt_path last`" if command == "fit" else "nothing was written"
        _exit(f"hfmca: stopped by SIGTERM; {after}." if _is_rank_zero() else "", EXIT_SIGTERM)
    except KeyboardInterrupt:
        _exit(_interrupted_line(command), EXIT_INTERRUPTED)
    except Exception as error:
        _stop_if_one_process_failed(error, command)
        raise
    except SystemExit:
        if signals.interrupted:  # Lightning's graceful shutdown after Ctrl-C ends in SystemExit(1)
            _exit(_interrupted_line(command), EXIT_INTERRUPTED)
        raise
    finally:
        shutdown_workers()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "(version unknown: the package is not installed)"


def _unknown_command(command: str) -> str:
    """What to say for a missing or unknown command: the closest command, and all of them."""
    usage = f"usage: hfmca [-q | -v] <command> [options], with <command> one of {', '.join(COMMANDS)}"
    after = " (`hfmca <command> --help` lists its options; `hfmca --version` the version)."
    if not command:
        return f"no command given; {usage}{after}"
    if command == "predict":  # Lightning's; no module of the package predicts
        return (
            "hfmca has no predict command: `hfmca export --ckpt_path <checkpoint> --out <folder> --embeddings train "
            "test` writes the backbone's features and the labels of each split (embeddings_<split>.npz)"
        )
    close = difflib.get_close_matches(command, COMMANDS, n=1)
    hint = f"; did you mean {close[0]}?" if close else "."
    return f"unknown command {command!r}{hint} Commands: {', '.join(COMMANDS)}{after}"


def _describe_argument_error(message: str, argv: list[str]) -> str:
    """One line for a mistake in the command line; a missing or unknown command (options before it) lists all."""
    if _NO_SUBCOMMAND.match(message):
        return _unknown_command("")
    if match := _INVALID_SUBCOMMAND.match(message):
        return _unknown_command(match.group(1))
    if match := _NO_MODEL_OR_DATA.match(message):
        if any(arg in ("-c", "--config") or arg.startswith("--config=") for arg in argv):
            return f"{message.strip()}: the configs given set no model: or data: section; add them (--model, --data)"
        return (
            f"{message.strip()}: give the run's config, hfmca {match.group(1)} --config <run.yaml> (the repository's "
            "configs/demo.yaml is one), or the model and data with --model and --data"
        )
    return describe_parser_error(message)


def _run(command: str, argv: list[str], args: list[str] | None) -> None:
    if command in ANALYSIS_COMMANDS:
        from hfmca_lightning.cli.analyze import run_analysis_command

        run_analysis_command(argv)
    elif command in EVALUATION_COMMANDS:
        from hfmca_lightning.cli.evaluate import run_evaluation_command

        run_evaluation_command(argv)
    elif command == "export":
        from hfmca_lightning.cli.export import run_export_command

        run_export_command(argv[1:])
    elif command == "dashboard":
        from hfmca_lightning.cli.dashboard import run_dashboard_command

        run_dashboard_command(argv[1:])
    else:
        from hfmca_lightning.cli.trainer_cli import HFMCACLI

        if args is None:  # the console script: LightningCLI reads the command line (less -q / -v)
            sys.argv = [sys.argv[0], *argv]
            HFMCACLI(args=None)
        else:
            HFMCACLI(args=argv)


def _stop_if_one_process_failed(error: Exception, command: str) -> None:
    """In a multi-process run that one process failed alone: it says why in one line, and every process stops
    (:mod:`hfmca_lightning.runtime.ranks`); process 0 whose collective failed because a child failed says nothing.
    Elsewhere, nothing."""
    from hfmca_lightning.runtime.ranks import a_child_failed, processes, stop_other_ranks

    if command not in LIGHTNING_COMMANDS or processes() < 2:
        return
    child_failed = _rank() == 0 and a_child_failed()
    stop_other_ranks()
    if child_failed:
        _exit("", EXIT_FAILED)
    first = (_original_message(error).strip().splitlines() or [""])[0]
    after = (
        "; continue from the last checkpoint with the same command and `--ckpt_path last`" if command == "fit" else ""
    )
    _exit(
        f"hfmca: error: process {_rank()} of {processes()} failed: {type(error).__name__}: {first}{after}.", EXIT_FAILED
    )


def _interrupted_line(command: str) -> str:
    if command == "fit":
        return "hfmca: interrupted; continue from the last checkpoint with the same command and `--ckpt_path last`."
    return "hfmca: interrupted."


def _original_message(error: BaseException) -> str:
    """The error's own message, also when a DataLoader worker raised it (the main process re-raises it with
    the worker's traceback in the message)."""
    text = str(error)
    if "Original Traceback" not in text:
        return text
    kind = type(error)
    prefixes = (f"{kind.__module__}.{kind.__qualname__}: ", f"{kind.__name__}: ")  # as tracebacks name it
    for line in reversed(text.splitlines()):
        for prefix in prefixes:
            if line.startswith(prefix):
                return line[len(prefix) :]
    return text.strip().splitlines()[-1]


def _distributed() -> bool:
    import torch.distributed

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return int(getattr(rank_zero_only, "rank", 0))


def _is_rank_zero() -> bool:
    return _rank() == 0


def _exit(message: str, status: int) -> None:
    if message:
        sys.stdout.flush()  # what Lightning printed comes first
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(status) from None


if __name__ == "__main__":
    main()
