"""Makes the packages named in BLOCKED_IMPORTS (comma-separated top-level names) fail to import,
as on a machine without them: with this folder on PYTHONPATH every Python process started
(pytest, bench/gpu_check.sh's stages, launched ranks) raises ModuleNotFoundError for them.
tests/test_optional_packages.py runs the GPU check and the GPU test files this way."""

import os
import sys
from importlib.abc import MetaPathFinder

BLOCKED = {name.strip() for name in os.environ.get("BLOCKED_IMPORTS", "").split(",") if name.strip()}


class _Blocker(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named '{fullname}' (blocked: BLOCKED_IMPORTS)", name=fullname)
        return None


if BLOCKED:
    sys.meta_path.insert(0, _Blocker())
