"""The one exception the data pipeline raises for bad input, and the CLIs' wrapper that prints
it as one line with exit status 2. A ``ValueError``, so callers catching that keep working."""

from __future__ import annotations

import os
import sys


class DataError(ValueError):
    """Bad input data: the message names the file and, where it applies, the line or sample."""


def cli_main(run, argv=None) -> int:
    """Call ``run(argv)``; turn a DataError into one line on stderr and exit status 2."""
    try:
        return run(argv) or 0
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (``| head``)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
