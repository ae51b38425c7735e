"""The kernels compile for a Hopper GPU (sm_90) on a machine without one, without register
spills.

``kernels.compile_check --registers`` runs Triton's whole compiler (down to ptxas and a
cubin) on every supported attention combination (fp16/bf16/fp32 with and without TF32, head
dims 32/64/128, dropout off/on, both tile presets) and the fused ops, reads ptxas's register
report, and fails on any spill; it needs Triton imported in compiled mode, so it runs in a
subprocess (this test process imports Triton in interpreter mode for the other kernel
tests), on two processes.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO as ROOT

pytest.importorskip("triton")


@pytest.mark.slow  # Triton's whole compiler on every kernel
def test_every_kernel_compiles_for_hopper_without_spills(tmp_path):
    out = tmp_path / "compile.json"
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--registers", "--jobs", "2", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    attention = [r for r in records if r["kernel"].startswith("_attn")]
    combos = {(r["dtype"], r["head_dim"], r["dropout"], r["precision"], r["tiles"]) for r in attention}
    for dtype, precisions in (("bfloat16", ["-"]), ("float16", ["-"]), ("float32", ["ieee", "tf32"])):
        for dim in (32, 64, 128):
            for p in (0.0, 0.1):
                for precision in precisions:
                    assert (dtype, dim, p, precision, "default") in combos, (dtype, dim, p, precision)
    assert ("bfloat16", 64, 0.1, "-", "small") in combos
    assert len(attention) == 3 * len(combos)  # forward, dK/dV, dQ each
    assert [r["kernel"] for r in records[len(attention) :]] == [
        "_bias_gelu_fwd",
        "_bias_gelu_bwd",
        "_bdaln_fwd",
        "_bdaln_bwd",
    ]
    if any(r.get("registers") is None for r in records):
        pytest.skip("this Triton ships no ptxas: registers and spills not measured")
    assert all(r["spill_bytes"] == 0 and r["blocks_per_sm"] >= 1 for r in records)
    assert all(0 < r["shared_bytes"] <= 227 * 1024 for r in attention)
