"""How a command ends when it does not succeed: the error a configuration raises when it cannot run (imported by the
modules that check configurations), a run left unfinished by its machine, a stopping signal, and the one line each
ends with."""

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


class RunIncomplete(RuntimeError):
    """Runs that ended with samples left unanswered by a failure of the machine (memory, disk, device), not of the
    samples: their directories say ``incomplete``, and rerunning the same command answers the rest."""


class Stopped(KeyboardInterrupt):
    """The process was asked to stop (SIGINT is Ctrl-C, SIGTERM a scheduler's or ``kill``'s request)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM raises :class:`Stopped` as Ctrl-C raises KeyboardInterrupt, so that a terminated run closes its
    directory as an interrupted one does instead of dying with it saying ``running``."""

    def stop(signum, frame) -> NoReturn:
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's code for a process ended by a signal: 128 + its number (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + (interrupt.signum if isinstance(interrupt, Stopped) else signal.SIGINT)


def fail(error: Exception) -> NoReturn:
    """End the command with a run failure's one line and exit code 1 (a refusal is 2)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"error: {error}", file=sys.stderr)
    sys.exit(1)


def refuse(error: ConfigError) -> NoReturn:
    """End the command with the refusal's one line and exit code 2, for single runs and sweeps alike; with
    HYDRA_FULL_ERROR=1 (Hydra's own switch for full tracebacks) raise it instead, traceback and all."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
