"""The kernels compile for a Hopper GPU (sm_90) on a machine without one, without register spills.

``tools.compile_check --registers`` runs Triton's whole compiler (down to ptxas and a cubin)
on every supported attention combination (fp16/bf16/fp32 with and without TF32, head dims
32/64/128, dropout off/on, both tile presets), each plain, with a window and with FlashMask
bounds (the kernel family's switches), the fused ops and the rotary kernel (fp32, bf16, fp16,
forward and inverse), reads ptxas's register report, and fails on any spill; it needs Triton
imported in compiled mode, so it runs in a subprocess (this test process imports Triton in
interpreter mode for the other kernel tests), on two processes. (The FlashMask kernels' own
compile test, from before they joined the family, is the bounded part here.)
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
        [sys.executable, "-m", "tools.compile_check", "--registers", "--jobs", "2", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    attention = [r for r in records if r["kernel"].startswith("_attn") and r["mask"] == "none"]
    combos = {(r["dtype"], r["head_dim"], r["dropout"], r["precision"], r["tiles"]) for r in attention}
    for dtype, precisions in (("bfloat16", ["-"]), ("float16", ["-"]), ("float32", ["ieee", "tf32"])):
        for dim in (32, 64, 128):
            for p in (0.0, 0.1):
                for precision in precisions:
                    assert (dtype, dim, p, precision, "default") in combos, (dtype, dim, p, precision)
    assert ("bfloat16", 64, 0.1, "-", "small") in combos
    assert len(attention) == 3 * len(combos)  # forward, dK/dV, dQ each
    assert [r["kernel"] for r in records[len(attention) : len(attention) + 4]] == [
        "_bias_gelu_fwd",
        "_bias_gelu_bwd",
        "_bdaln_fwd",
        "_bdaln_bwd",
    ]
    masked = [r for r in records if r.get("mask", "none") != "none"]
    rotary = [r for r in records if r["kernel"] == "_rotary_kernel"]
    assert records[-len(rotary) :] == rotary  # last, after the bounded attention kernels
    assert {(r["dtype"], r["head_dim"], r["inverse"]) for r in rotary} == {
        (dtype, dim, inverse)
        for dtype in ("float32", "bfloat16", "float16")
        for dim in (64, 128)
        for inverse in (False, True)
    }
    assert len(records) == len(attention) + 4 + len(masked) + len(rotary)
    assert len(rotary) == 12  # forward and inverse at 3 dtypes x 2 head dims
    windowed = {(r["dtype"], r["head_dim"], r["dropout"], r["precision"]) for r in masked if r["mask"] == "window"}
    assert windowed == {c[:4] for c in combos if c[4] == "default"}  # every plain default combination
    assert any(r["mask"] == "window" and r["grouped"] for r in masked)  # grouped dispatch with a window
    bounded = {(r["dtype"], r["head_dim"], r["mask"], r["dropout"]) for r in masked if r["mask"] != "window"}
    for mask in ("bounds n=2", "bounds n=4", "bounds n=1 causal", "bounds n=2 causal"):
        for dtype in ("bfloat16", "float16", "float32"):
            assert {(dtype, 64, mask, 0.1), (dtype, 128, mask, 0.1)} <= bounded, (dtype, mask)
    assert ("bfloat16", 64, "bounds n=2", 0.0) in bounded  # the packed BERT-large mask, also in evaluation
    assert len(masked) == 3 * (len(windowed) + len(bounded))  # forward, dK/dV, dQ each
    assert "registers (spill) per kernel: none | window | bounds n=2" in proc.stdout  # side by side
    if any(r.get("registers") is None for r in records):
        pytest.skip("this Triton ships no ptxas: registers and spills not measured")
    assert all(r["spill_bytes"] == 0 and r["blocks_per_sm"] >= 1 for r in records)
    assert all(0 < r["shared_bytes"] <= 227 * 1024 for r in attention + masked)
