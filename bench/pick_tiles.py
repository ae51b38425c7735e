"""Which attention tile preset ran faster: the ``tiles`` stage of bench/gpu_check.sh.

    python bench/pick_tiles.py DEFAULT.json SMALL.json [--json PATH]

Reads two bench/attention.py reports of the same batches, one run with the default tiles
and one with ``KERNELS_ATTENTION_TILES=small`` (kernels/tiles.py), and reports, for
``triton`` and ``triton_grouped``, each preset's median forward+backward milliseconds and
the faster one. Without timings (a CPU run) it says so and writes ``faster: null``. Exit
status 2 when a report cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.files import write_text

PRESETS = ("default", "small")


def pick(reports: dict[str, dict]) -> dict:
    out = {}
    for backend in ("triton", "triton_grouped"):
        times = {p: reports[p].get("results", {}).get(backend, {}).get("median_ms") for p in PRESETS}
        timed = {p: t for p, t in times.items() if t is not None}
        faster = min(timed, key=timed.get) if len(timed) == len(PRESETS) else None
        out[backend] = {
            "median_ms": times,
            "faster": faster,
            "speedup_small_vs_default": (times["default"] / times["small"]) if faster else None,
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("default_report")
    parser.add_argument("small_report")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    reports = {}
    for preset, path in zip(PRESETS, (args.default_report, args.small_report)):
        try:
            reports[preset] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"bench/pick_tiles.py: cannot read the {preset} report {path}: {e}", file=sys.stderr)
            return 2
    result = pick(reports)
    for backend, r in result.items():
        if r["faster"] is None:
            print(f"{backend:15s} no timings in both reports (CPU run?): nothing to pick")
        else:
            print(
                f"{backend:15s} default {r['median_ms']['default']:.3f} ms, small {r['median_ms']['small']:.3f} ms: "
                f"faster = {r['faster']} (KERNELS_ATTENTION_TILES={r['faster']})"
            )
    if args.json:
        write_text(Path(args.json), json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
