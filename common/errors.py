"""The one exception type for what a user can fix, and the command-line wrapper that prints it.

A ``UserError`` is bad input or a setup the user can change (a configuration field, a data file, a
checkpoint, a package, a launcher's variables, a lost peer, a full disk). ``run_pretraining.py`` and
every ``main`` print it as ``error: ...`` and exit with its ``exit_status``: 2 for bad input, 1 for a
run that failed on the way (``RunFailure``). Any other exception is a bug: its traceback shows.
"""

from __future__ import annotations

import contextlib
import os
import sys


class UserError(Exception):
    """Something the user can fix; the message is one line naming the field or file."""

    exit_status = 2


class ConfigError(UserError):
    """A configuration field (the run's or the model's) that is invalid; the message names it."""


class DataError(UserError):
    """Bad input data: the message names the file and, where it applies, the line or sample."""


class CheckpointError(UserError):
    """A checkpoint or weights file that cannot be used: the message names the file and why."""


class RunFailure(UserError):
    """The run failed on the way (a lost peer, a file that cannot be written): not bad input."""

    exit_status = 1


class OutputError(RunFailure):
    """An output file that cannot be written (no space, no permission); the message names it."""


@contextlib.contextmanager
def writing(path):
    """Turn an OSError raised while writing the output ``path`` into an OutputError naming it."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"{path}: cannot write ({e.strerror or e})") from e


def cli_main(run, argv=None) -> int:
    """Call ``run(argv)``; turn a UserError into one line on stderr and its exit status."""
    try:
        return run(argv) or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (``| head``)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
