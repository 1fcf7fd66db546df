"""User errors: a mistake in the config or the data ends a stage with one line naming what to fix.

A `UserError` message names the source, file, key or row and what to do; `cli` turns it into that one
line on stderr (several problems: one line each) and exit status 1, with no traceback (a traceback means
a bug; `--verbose` shows it anyway). A job that fails in the workflow is that line on its console, once,
with its log (`FailureConsole`).
"""

from __future__ import annotations

import errno
import faulthandler
import functools
import logging
import os
import re
import signal
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
                print(
                    f"{name()}: stopped by signal {stopped_by} ({type(e).__name__} on the way out)",
                    file=sys.stderr,
                )
                sys.exit(128 + stopped_by)
            if out_of_memory(e) and not verbose:
                oom_exit(e, name())
            raise

    return run


# ---- a failed job on the workflow's console ----

# A script's one-line error (`cli`), also behind a rank's prefix (`[rank0]: `), which torchrun may add.
RANK_PREFIX = re.compile(r"^\[[^\]]*\]: ")
ERROR_LINE = re.compile(r"^[\w.-]+: error: ")
# What of a job's log is read for its error: its end (a long training's log is megabytes).
LOG_TAIL_BYTES = 1 << 16


def log_tail(path, size: int = LOG_TAIL_BYTES) -> list[str]:
    """The last lines of a job's log as a terminal shows them (of a line a progress bar redrew with \\r, its
    last state), without a rank's prefix and blank lines; [] when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = (RANK_PREFIX.sub("", line.rsplit("\r", 1)[-1]).rstrip() for line in text.split("\n"))
    return [line for line in lines if line.strip()]


def log_error(lines: list[str]) -> tuple[list[str], bool]:
    """What a failed job's log (`lines`, log_tail's) says ended it: the scripts' one-line errors (each
    once: every rank prints its own), else the exception line of the last traceback (a crash); the bool
    says which. ([], False) when it has neither."""
    errors = list(dict.fromkeys(line for line in lines if ERROR_LINE.match(line)))
    if errors:
        return errors, False
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if starts:
        after = [line for line in lines[starts[-1] + 1 :] if not line[:1].isspace()]
        if after:
            return after[:1], True
    return [], False


def exit_cause(message: str | None) -> str | None:
    """How a job's command ended, from Snakemake's message on it (its CalledProcessError): None for exit
    status 1 (the error line says the rest), else the status, with the signal that killed it (a shell
    gives 128 + its number)."""
    found = re.search(r"returned non-zero exit status (\d+)", message or "")
    if found:
        status = int(found.group(1))
        if status == 1:
            return None
        try:
            return f"exit status {status}: killed by {signal.Signals(status - 128).name}"
        except ValueError:
            return f"exit status {status}"
    found = re.search(r"died with <Signals\.(\w+)", message or "")
    return f"killed by {found.group(1)}" if found else None


def job_failure(rule: str, logs: list[str], cause: str | None = None, note: str | None = None) -> str:
    """A failed job on the console: `rule` failed, with the error its log (the first of `logs`) ends with
    (log_error; a log without one: its last line), then the logs; `cause` (exit_cause) and `note` (the
    executor's own message: a SLURM job's state) where there are."""
    lines = log_tail(logs[0]) if logs else []
    said, crash = log_error(lines)
    how = [cause] if cause else []
    if crash:
        how.append("a crash: the traceback is in its log")
    elif not said:
        said = [f"its log ends: {lines[-1]}"] if lines else ["nothing in its log"] if logs else []
    head = f"rule {rule} failed" + (f" ({'; '.join(how)})" if how else "")
    body = [head + (f": {said[0]}" if len(said) == 1 else ":" if said else "")]
    body += [f"  {line}" for line in (said if len(said) > 1 else [])]
    body += [f"  {note}"] if note else []
    body += [f"  log: {', '.join(logs)}"] if logs else []
    return "\n".join(body)


# Snakemake's exception at the end of a run in which a job failed.
RUN_FAILED = "At least one job did not complete successfully"


class FailureConsole(logging.Formatter):
    """Snakemake's console formatter (`inner`) with a failed job said once, in job_failure's lines, as it
    fails. What Snakemake says of it besides (its exception, which holds the job's whole command line; the
    job's error block, with the command again and the whole log; both again when the run ends; the
    run's end as an exception) goes only to the run's complete log (.snakemake/log/), whose path the
    workflow's last lines give (`summarized` set): records are matched on Snakemake's log events."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner
        self.failed: dict = {}  # jobid: rule, of the failed jobs said
        self.commands: list[str] = []  # Snakemake's messages on failed commands, not yet matched to a job
        self.summarized = False

    def format(self, record: logging.LogRecord) -> str:
        event, text = getattr(record, "event", None), str(record.msg)
        if (
            event == "error"
            and getattr(record, "exception", None) == "RuleException"
            and "CalledProcessError" in text
        ):
            self.commands.append(text)
            return ""  # an empty message is not written
        if event == "job_error":
            if record.jobid in self.failed:
                return ""
            self.failed[record.jobid] = record.rule_name
            logs = [str(log) for log in record.log]
            command = next((c for c in reversed(self.commands) if any(log in c for log in logs)), None)
            if command is not None:
                self.commands.remove(command)
            return job_failure(record.rule_name, logs, exit_cause(command), record.rule_msg)
        if self.failed and text.startswith("Exiting because a job execution failed"):
            return ""
        said_at_end = text.startswith("Complete log(s): ") or event == "error" and RUN_FAILED in text
        if self.summarized and said_at_end:
            return ""
        return self.inner.format(record)
