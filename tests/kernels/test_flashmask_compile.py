"""The FlashMask kernels compile for a Hopper GPU (sm_90) on a machine without one.

``python -m kernels.compile_check --flashmask`` runs Triton's whole compiler (down to ptxas
and a cubin) on every kernel variant the model and the benchmark use; Triton must be imported
in compiled mode for that, so it runs in a subprocess (the other kernel tests import Triton in
interpreter mode).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO as ROOT

pytest.importorskip("triton")


@pytest.mark.slow  # Triton's whole compiler on every variant
def test_flashmask_kernels_compile_for_hopper(tmp_path):
    out = tmp_path / "compile.json"
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--flashmask", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [r["kernel"] for r in records] == ["_fm_fwd", "_fm_bwd_dkdv", "_fm_bwd_dq"] * 5
    assert all(0 < r["shared_bytes"] <= 227 * 1024 for r in records)
    # The packed BERT-large case (bf16, head dim 64, bidirectional document mask, dropout).
    assert {(r["dtype"], r["head_dim"], r["causal"], r["n"], r["dropout"]) for r in records[:3]} == {
        ("bfloat16", 64, False, 2, 0.1)
    }
