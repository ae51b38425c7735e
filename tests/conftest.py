"""Suite-wide settings, applied before any test module imports Triton.

Triton fixes interpreter-or-compiled mode when it is first imported, so the choice has to be
made here, not in the kernel test modules (a test that imports torch.compile's inductor could
otherwise import Triton first, compiled). On CPU-only machines the Triton kernels run in the
interpreter; bench/gpu_check.sh sets TRITON_INTERPRET=0 to test the compiled kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
