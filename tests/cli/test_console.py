"""The console script's signal handling in-process (hfmca_lightning/cli/console.py): a signal whose exception Python
drops (its handler ran in an at-fork callback or a finaliser) is sent again and stops the command; after a signal, an
object it cut short while it was built fails in its finaliser without a traceback, while anything else unraisable is
still printed; a forked worker not yet started leaves signals to the main process."""

from __future__ import annotations

import os
import signal
import sys
import time
import weakref
from collections.abc import Iterator

import pytest

from hfmca_lightning.cli import console


@pytest.fixture
def python_signal_state(monkeypatch) -> Iterator[None]:
    """Python's own unraisable hook during the test (not pytest's), the SIGINT and SIGTERM handlers restored after."""
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    yield
    for number, handler in handlers.items():
        signal.signal(number, handler)


class HalfBuilt:
    """As a DataLoader iterator whose ``__init__`` a signal interrupted: ``__del__`` reads what was never set."""

    def __del__(self) -> None:
        self._shutdown  # noqa: B018 - AttributeError, as torch's iterator raises


class SignalledInFinaliser:
    """A finaliser during which the process gets ``number``: the handler's exception is raised inside ``__del__``,
    where Python can only drop it."""

    def __init__(self, number: int) -> None:
        self.number = number

    def __del__(self) -> None:
        os.kill(os.getpid(), self.number)
        time.sleep(0.01)  # the handler runs here


def _abandon_half_built() -> None:
    HalfBuilt.__new__(HalfBuilt)  # built without __init__, dropped at once: its __del__ runs


def _fail_in_a_callback() -> None:
    target = type("Plain", (), {})()
    reference = weakref.ref(target, lambda _: 1 / 0)  # noqa: F841 - the callback raises when target goes
    del target


@pytest.mark.parametrize(
    ("number", "raised"), [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, console.Terminated)]
)
def test_a_signal_whose_exception_python_dropped_is_sent_again(number, raised, python_signal_state, capsys):
    signals = console._Signals()
    signals.install()
    with pytest.raises(raised):
        SignalledInFinaliser(number)  # dropped at once: the exception raised in its __del__ is lost
        time.sleep(2)  # the signal sent again arrives here
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("handler", ["_on_sigint", "_on_sigterm"])
def test_after_a_signal_a_half_built_objects_finaliser_prints_no_traceback(handler, python_signal_state, capsys):
    _abandon_half_built()
    assert "Exception ignored" in capsys.readouterr().err  # before a signal: printed, as Python does
    with pytest.raises((KeyboardInterrupt, console.Terminated)):
        getattr(console._Signals(), handler)(signal.SIGINT, None)
    _abandon_half_built()
    assert capsys.readouterr().err == ""
    _fail_in_a_callback()
    assert "ZeroDivisionError" in capsys.readouterr().err  # not a finaliser: still printed


@pytest.mark.parametrize("handler", ["_on_sigint", "_on_sigterm"])
def test_a_forked_worker_not_yet_started_leaves_signals_to_the_main_process(handler, python_signal_state):
    signals = console._Signals()
    signals.pid = os.getpid() + 1  # as in a child forked from the main process, before its worker_init_fn
    assert getattr(signals, handler)(signal.SIGTERM, None) is None
    assert not signals.interrupted and not signals.terminating and sys.unraisablehook is sys.__unraisablehook__
