"""torchrun, ending a failed run with one line: ``python launch/torchrun.py [torchrun's arguments]``
(what launch/run_torchrun.sh runs). Each rank prints its own error; torchrun's log lines and
``ChildFailedError`` traceback become one line naming the rank that failed first, whose exit
status this process returns. ``LOGLEVEL=INFO`` shows torchrun's log again.
"""

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main


def run(argv=None) -> int:
    if "LOGLEVEL" not in os.environ:
        for name in ("torch.distributed.elastic", "torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        main(argv)
    except ChildFailedError as e:
        rank, first = e.get_first_failure()
        code = first.exitcode
        how = f"exited with status {code}" if code >= 0 else f"was ended by signal {-code}"
        print(f"torchrun: {len(e.failures)} rank(s) failed, rank {rank} first: it {how}", file=sys.stderr)
        return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
