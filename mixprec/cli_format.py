"""How the ``mixprec`` command talks: one line per error or warning, on stderr.

- an argument mistake (argparse's own, or one of the argument types below):
  ``mixprec: error: argument --steps: must be a whole number of at least 1, got '0' (see
  'mixprec advise --help')``, exit status 2, no usage dump; a misspelt command or choice
  says the close match (``mixprec bakends``: ``did you mean 'backends'?``);
- a refused input (any :class:`~mixprec.errors.MixprecError` a command raises):
  ``mixprec: error: <message>``, exit status 2, no traceback;
- Ctrl-C: ``mixprec: interrupted``, exit status 130 (128 + SIGINT, as a shell reports it),
  no traceback, even when it lands inside a finaliser (a ``__del__`` or weakref callback,
  where Python prints "Exception ignored" and runs on: it is delivered again);
- a warning: ``mixprec: warning: <message>`` (other libraries' warnings keep their class
  name: ``mixprec: warning: UserWarning: ...``), instead of Python's ``file:line`` and
  source-line format.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import difflib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TextIO

from mixprec.dtypes import canonical_dtype
from mixprec.errors import MixprecError, MixprecWarning, PolicyError

__all__ = ["NON_FLOATING", "CliParser", "cli_messages", "dtype_list", "positive_int"]

PROG = "mixprec"
#: The exit status of a command stopped by Ctrl-C: 128 + SIGINT, what a shell reports.
INTERRUPTED = 130

#: How long after a swallowed Ctrl-C it is delivered again (the finaliser has returned).
_REDELIVERY_DELAY_S = 0.01

#: dtype names an op's inputs may have that take no part in its decision.
NON_FLOATING = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
)


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose mistakes are one line, and whose help keeps its layout
    (the examples of each command's epilog)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print ``mixprec: error: <message> (see '<prog> --help')`` and exit with 2."""
        self.exit(2, f"{PROG}: error: {message} (see '{self.prog} --help')\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own check, with the close match of a misspelt command or choice
        choices = action.choices
        if choices is not None and isinstance(value, str) and value not in choices:
            names = [str(choice) for choice in choices]
            close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
            if close:
                raise argparse.ArgumentError(
                    action,
                    f"invalid choice: {value!r}; did you mean {close[0]!r}? "
                    f"(choose from {', '.join(map(repr, names))})",
                )
        super()._check_value(action, value)


def dtype_list(text: str) -> list[str]:
    """``--inputs``: comma-separated dtypes, floating ones in their canonical spelling.

    :raises argparse.ArgumentTypeError: an empty item, or a name that is neither a dtype
        mixprec knows nor an integer/bool dtype (the message has the close matches).
    """
    names = []
    for item in text.split(","):
        name = item.strip()
        if not name:
            raise argparse.ArgumentTypeError(
                f"empty dtype in {text!r}; write them comma-separated, e.g. float16,float32"
            )
        if name.lower().rpartition(".")[2] in NON_FLOATING:
            names.append(name)
            continue
        try:
            names.append(canonical_dtype(name))
        except PolicyError as exc:
            raise argparse.ArgumentTypeError(
                f"{exc}. Integer and bool inputs ({', '.join(sorted(NON_FLOATING))}) are "
                "accepted too and take no part"
            ) from None
    return names


def positive_int(text: str) -> int:
    """A count such as ``--steps``: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    kind = "" if issubclass(category, MixprecWarning) else f"{category.__name__}: "
    print(f"{PROG}: warning: {kind}{message}", file=file or sys.stderr)


@contextlib.contextmanager
def _interrupts_in_finalisers_delivered() -> Iterator[None]:
    """A Ctrl-C that lands while the garbage collector runs a finaliser is swallowed by
    Python ("Exception ignored in ..."), and the command ran on to its end. Inside: such a
    KeyboardInterrupt is delivered again a moment later, from a short-lived thread (Python
    checks for signals at its next instruction: raised from the hook, it would land in the
    hook and be swallowed again)."""
    previous_hook = sys.unraisablehook
    active = True

    def deliver_later() -> None:
        time.sleep(_REDELIVERY_DELAY_S)
        if active:
            _thread.interrupt_main()

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _thread.start_new_thread(deliver_later, ())
        else:
            previous_hook(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        active = False
        sys.unraisablehook = previous_hook


@contextlib.contextmanager
def cli_messages() -> Iterator[Callable[[Callable[[], int]], int]]:
    """Inside: warnings print as ``mixprec: warning: ...``. Yields ``report(run)``, which
    calls ``run()`` and turns a :class:`MixprecError` into ``mixprec: error: ...`` and 2,
    Ctrl-C into ``mixprec: interrupted`` and 130 (and output piped into a command that
    stopped reading, ``mixprec policies | head``, into a quiet exit)."""

    def report(run: Callable[[], int]) -> int:
        try:
            with _interrupts_in_finalisers_delivered():
                return run()
        except MixprecError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return INTERRUPTED
        except BrokenPipeError:
            # what is left in stdout's buffer would fail again at exit: point it at devnull
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1

    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        yield report
