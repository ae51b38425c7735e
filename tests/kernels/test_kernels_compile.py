"""The kernels compile for a Hopper GPU (sm_90) on a machine without one.

``kernels.compile_check`` runs Triton's whole compiler (down to ptxas and a cubin) on every
kernel variant; it needs Triton imported in compiled mode, so it runs in a subprocess
(this test process imports Triton in interpreter mode for the other kernel tests).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO as ROOT

pytest.importorskip("triton")


@pytest.mark.slow  # Triton's whole compiler on every kernel
def test_every_kernel_compiles_for_hopper(tmp_path):
    out = tmp_path / "compile.json"
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    kernels = [r["kernel"] for r in records]
    # 6 attention variants x (forward, dK/dV, dQ), then the four fused-op kernels.
    assert kernels == ["_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"] * 6 + \
        ["_bias_gelu_fwd", "_bias_gelu_bwd", "_bdaln_fwd", "_bdaln_bwd"]
    assert all(0 < r["shared_bytes"] <= 227 * 1024 for r in records if r["kernel"].startswith("_attn"))
