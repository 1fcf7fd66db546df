"""User errors: a mistake in the config or the data ends a stage with one line naming what to fix.

A `UserError` message names the source, file, key or row and what to do; `cli` turns it into that one
line on stderr (several problems: one line each) and exit status 1, with no traceback (a traceback means
a bug; `--verbose` shows it anyway).
"""

from __future__ import annotations

import errno
import faulthandler
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path


class UserError(Exception):
    """A mistake the user fixes (config, data, disk), not a bug: reported as one line."""


def disk_full(e: BaseException) -> bool:
    """ENOSPC, from Python (errno) or from pyarrow (which keeps only the message)."""
    return isinstance(e, OSError) and (e.errno == errno.ENOSPC or "No space left on device" in str(e))


def disk_full_error(path) -> UserError:
    return UserError(f"{path}: no space left on device; free space there (or move results/) and rerun")


# Set by the workflow (workflow/rules/common.smk) to the snakemake command that reruns it as started.
RERUN_ENV = "FLASHDRAFT_RERUN"


def rerun_command() -> str:
    """The command a message tells the user to rerun after fixing what it names."""
    return os.environ.get(RERUN_ENV, "snakemake --cores all")


# How long a script that ends by an exception (an error, a stop, sys.exit) may take to exit before it is
# ended: a thread or a worker pool stuck at shutdown must not keep the process, and its GPU.
EXIT_GRACE_S = 120


# The stop signal (SIGTERM, SIGINT) whose handler raised SystemExit in this process (io.exit_on_stop_signals),
# if any: code it interrupts may turn that SystemExit into an error of its own (an import interrupted in a
# class body raises RuntimeError from __set_name__, Inductor wraps what its compile raised).
stopped_by: int | None = None


# Set by a stage once it has read its config (memory.on_oom): the one line an out-of-memory error ends the
# stage with (the stage, its predicted peak, the card, the keys to lower).
oom_line: Callable[[], str] | None = None


def out_of_memory(e: BaseException) -> bool:
    """torch's OutOfMemoryError, also as Inductor or a compile wraps it (its message kept)."""
    return type(e).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(e)


def oom_exit(e: BaseException, name: str) -> None:
    """An out-of-memory error as one line (`oom_line`'s) and exit status 1."""
    try:
        line = oom_line() if oom_line else "ran out of GPU memory"
    except Exception as explain:  # the line is a courtesy: never hide the error behind a second one
        line = f"ran out of GPU memory ({type(explain).__name__} while explaining it)"
    sys.exit(f"{name}: error: {line}")


def cli(main):
    """Wrap a script's `main(argv)`: a UserError (or a full disk, or running out of GPU memory) exits with
    one line; `--verbose` in the arguments re-raises it with its traceback. Once an exception leaves the
    program's `main` (argv None), the process has EXIT_GRACE_S to exit; then every thread's stack goes to
    stderr and it exits with 1."""

    def name() -> str:
        return Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else main.__module__

    @functools.wraps(main)
    def run(argv=None):
        entry = argv is None  # the program's own main, not a call from Python (a test)
        argv = list(sys.argv[1:] if argv is None else argv)
        verbose = "--verbose" in argv
        argv = [a for a in argv if a != "--verbose"]
        try:
            try:
                return main(argv)
            except (UserError, OSError) as e:
                if verbose or not (isinstance(e, UserError) or disk_full(e)):
                    raise
                if not isinstance(e, UserError):
                    e = disk_full_error(e.filename or "a file being written")
                sys.exit("\n".join(f"{name()}: error: {line}" for line in str(e).splitlines()))  # one a line
        except BaseException as e:
            if entry:
                faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)
            if stopped_by and not isinstance(e, SystemExit) and not verbose:  # the stop, wrapped on its way
                print(f"{name()}: stopped by signal {stopped_by} ({type(e).__name__} on the way out)",
                      file=sys.stderr)
                sys.exit(128 + stopped_by)
            if out_of_memory(e) and not verbose:
                oom_exit(e, name())
            raise

    return run
