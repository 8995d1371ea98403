"""The command lines' error boundary and signal handling, for every part's CLI (`eagle-tap`, and the collector's
own `python -m collector_service`, which must not import `eagle_tap`). Standard library only.

What must hold: `run_command` is the one error boundary. An ordinary mistake (bad input or settings, a missing
file, a server that does not answer) ends the command with one line `eagle-tap COMMAND: error: ...` on stderr
and exit status 2; code below it raises typed errors (ValueError and its subclasses, OSError, and the errors a
caller names as ordinary) and never prints them itself. A traceback only with `--debug` (or EAGLE_TAP_DEBUG=1).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "error_line", "ignore_further_signals", "interrupt_on_signals",
           "ordinary_errors", "run_command"]

EXIT_USAGE = 2
"""Exit status of an ordinary mistake, as argparse uses for a bad command line."""
EXIT_INTERRUPTED = 130


def ignore_further_signals() -> None:
    """Ignore Ctrl-C and TERM from now on (e.g. `timeout` forwarding one more): they must not cut a stop short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _interrupt(signum: int, frame: object) -> None:
    ignore_further_signals()
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Inside: Ctrl-C and TERM raise KeyboardInterrupt once (so `kill` unwinds and stops child processes like
    Ctrl-C) and are ignored after that, until the stops are done. The previous handlers come back on exit."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def ordinary_errors(more: Callable[[], tuple[type[BaseException], ...]] | None = None) -> tuple[type[BaseException], ...]:
    """The exceptions that mean a mistake in input, settings or environment, not a bug.

    ValueError covers the project's typed errors (CaptureFormatError, SpanError, ...) and pydantic's
    ValidationError; httpx's errors count where the command imported httpx; `more` names a caller's own."""
    errors: list[type[BaseException]] = [ValueError, OSError]
    if "httpx" in sys.modules:
        errors.append(sys.modules["httpx"].HTTPError)
    return (*errors, *(more() if more is not None else ()))


def error_line(error: BaseException) -> str:
    """One line that names what is wrong: pydantic's errors by field, OSError by file."""
    if hasattr(error, "errors") and type(error).__name__ == "ValidationError":  # pydantic, without importing it
        return "; ".join(f"{'.'.join(str(part) for part in item['loc']) or 'settings'}: "
                         f"{item['msg'].removeprefix('Value error, ')}" for item in error.errors())
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    return " ".join(str(error).split()) or type(error).__name__


def _command_name(args: argparse.Namespace) -> str:
    return " ".join(str(part) for part in (args.command, getattr(args, "shards_command", None)) if part)


def run_command(args: argparse.Namespace,
                more_errors: Callable[[], tuple[type[BaseException], ...]] | None = None) -> int:
    """Runs the parsed command (`args.run(args)`) inside the error boundary (see the module docstring)."""
    debug = getattr(args, "debug", False) or os.environ.get("EAGLE_TAP_DEBUG", "") not in ("", "0")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"eagle-tap {_command_name(args)}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        if debug or not isinstance(error, ordinary_errors(more_errors)):
            raise
        print(f"eagle-tap {_command_name(args)}: error: {error_line(error)}", file=sys.stderr)
        return EXIT_USAGE
