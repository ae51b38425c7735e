"""Progress bars for long data work (preparation, conversion): tqdm with rate and ETA on a
terminal, silent when the stream is not one (logs, CI, tests), so output files stay clean."""

from __future__ import annotations

import sys


def progress(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it", stream=None):
    """A ``tqdm`` bar on ``stream`` (default stderr), disabled unless it is a terminal; ``unit="B"``
    scales to kB/MB."""
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        file=stream,
        disable=not stream.isatty(),
        dynamic_ncols=True,
        leave=False,
        mininterval=0.5,
    )
