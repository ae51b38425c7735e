"""The kernels compile for a Hopper GPU (sm_90) on a machine without one, without register spills.

``tools.compile_check --registers`` runs Triton's whole compiler (down to ptxas and a cubin)
and reads ptxas's register report, failing on any spill; it needs Triton imported in compiled
mode, so it runs in a subprocess (this test process imports Triton in interpreter mode for the
other kernel tests).

- ``make test`` compiles the representative subset (``--representative``, one process, about a
  tenth of the compile time): each kernel of the family (forward, dK/dV, dQ), every value of
  every switch (dtype, head dim, dropout, fp32 precision, tile preset, grouped dispatch, window,
  FlashMask bounds 1 / 2 / 4, causal or not), the kernels nearest the register limit, the fused
  ops and the rotary kernel in each dtype, head dim and direction. A test here checks that the
  subset still covers every value of the full list.
- ``make test-full`` (marker ``full_matrix``) compiles every supported combination (fp16/bf16/
  fp32 with and without TF32, head dims 32/64/128, dropout off/on, both tile presets), each
  plain, with a window and with FlashMask bounds, the fused ops and the rotary kernel (fp32,
  bf16, fp16, forward and inverse), on two processes: 5 min of one worker on a cold Triton
  cache (issue 43).
"""

import json
import sys

import pytest

from tests.helpers import REPO as ROOT
from tests.helpers import clean_env, run_launched
from tools.compile_check import REPRESENTATIVE, REPRESENTATIVE_ROTARY, attention_variants, rotary_variants

pytest.importorskip("triton")

AXES = ("dtype", "head_dim", "dropout", "precision", "tiles", "grouped", "mask")
FUSED = ["_bias_gelu_fwd", "_bias_gelu_bwd", "_bdaln_fwd", "_bdaln_bwd"]
ATTENTION = ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq")


def _compile(tmp_path, *args, timeout: float) -> tuple[list[dict], str]:
    """The records and the output of one run (its worker processes killed with it on a timeout)."""
    out = tmp_path / "compile.json"
    cmd = [sys.executable, "-m", "tools.compile_check", "--registers", *args, "--json", str(out)]
    output = run_launched(cmd, timeout, env=clean_env(TRITON_INTERPRET="0"), cwd=ROOT, what="tools.compile_check")
    return json.loads(out.read_text()), output


def _variant(record: dict) -> tuple:
    return tuple(record[axis] for axis in AXES)


def _check_records(records: list[dict], stdout: str, variants: list[tuple], rotary: list[tuple]) -> None:
    """The records of one run: the three attention kernels of each variant (plain, then the fused
    ops, windowed, bounded; as the variants come), the rotary builds last, no spill."""
    attention = [r for r in records if r["kernel"].startswith("_attn")]
    assert [r["kernel"] for r in attention] == list(ATTENTION) * len(variants)
    assert [_variant(r) for r in attention[::3]] == variants
    for i in range(0, len(attention), 3):
        assert len({_variant(r) for r in attention[i : i + 3]}) == 1, attention[i : i + 3]
    plain = sum(v[-1] == "none" for v in variants)
    assert [r["kernel"] for r in records[3 * plain : 3 * plain + 4]] == FUSED
    rotary_records = records[-len(rotary) :]
    assert all(r["kernel"] == "_rotary_kernel" for r in rotary_records)
    assert [(r["dtype"], r["head_dim"], r["inverse"]) for r in rotary_records] == rotary
    assert len(records) == len(attention) + len(FUSED) + len(rotary)
    assert "registers (spill) per kernel: none | window | bounds n=2" in stdout  # side by side
    if any(r.get("registers") is None for r in records):
        pytest.skip("this Triton ships no ptxas: registers and spills not measured")
    assert all(r["spill_bytes"] == 0 and r["blocks_per_sm"] >= 1 for r in records)
    assert all(0 < r["shared_bytes"] <= 227 * 1024 for r in attention)


def test_the_representative_subset_takes_every_value_of_every_switch():
    full = attention_variants()
    assert set(REPRESENTATIVE) <= set(full) and len(set(REPRESENTATIVE)) == len(REPRESENTATIVE)
    for i, axis in enumerate(AXES):
        assert {v[i] for v in REPRESENTATIVE} == {v[i] for v in full}, axis
    assert ("bfloat16", 64, 0.1, "-", "default", True, "none") in REPRESENTATIVE  # BERT-large training
    assert ("bfloat16", 64, 0.0, "-", "default", False, "bounds n=2") in REPRESENTATIVE  # its packed mask
    every = rotary_variants()
    assert set(REPRESENTATIVE_ROTARY) <= set(every)
    for i in range(3):
        assert {v[i] for v in REPRESENTATIVE_ROTARY} == {v[i] for v in every}


@pytest.mark.slow  # Triton's whole compiler on 31 kernels, about a minute of one core cold
def test_representative_kernels_compile_for_hopper_without_spills(tmp_path):
    records, stdout = _compile(tmp_path, "--representative", "--jobs", "1", timeout=300)
    variants = [v for v in attention_variants() if v in set(REPRESENTATIVE)]
    _check_records(records, stdout, variants, list(REPRESENTATIVE_ROTARY))


@pytest.mark.full_matrix  # make test-full: 5 min of Triton's compiler on a cold cache
@pytest.mark.slow
@pytest.mark.timeout(960)  # past run_launched's, which kills the compiling processes
def test_every_kernel_compiles_for_hopper_without_spills(tmp_path):
    records, stdout = _compile(tmp_path, "--jobs", "2", timeout=900)
    full = attention_variants()
    _check_records(records, stdout, full, rotary_variants())
    attention = [r for r in records if r["kernel"].startswith("_attn") and r["mask"] == "none"]
    combos = {(r["dtype"], r["head_dim"], r["dropout"], r["precision"], r["tiles"]) for r in attention}
    for dtype, precisions in (("bfloat16", ["-"]), ("float16", ["-"]), ("float32", ["ieee", "tf32"])):
        for dim in (32, 64, 128):
            for p in (0.0, 0.1):
                for precision in precisions:
                    assert (dtype, dim, p, precision, "default") in combos, (dtype, dim, p, precision)
    assert ("bfloat16", 64, 0.1, "-", "small") in combos
    rotary = [r for r in records if r["kernel"] == "_rotary_kernel"]
    assert len(rotary) == 12  # forward and inverse at 3 dtypes x 2 head dims
    masked = [r for r in records if r.get("mask", "none") != "none"]
    windowed = {(r["dtype"], r["head_dim"], r["dropout"], r["precision"]) for r in masked if r["mask"] == "window"}
    assert windowed == {c[:4] for c in combos if c[4] == "default"}  # every plain default combination
    assert any(r["mask"] == "window" and r["grouped"] for r in masked)  # grouped dispatch with a window
    bounded = {(r["dtype"], r["head_dim"], r["mask"], r["dropout"]) for r in masked if r["mask"] != "window"}
    for mask in ("bounds n=2", "bounds n=4", "bounds n=1 causal", "bounds n=2 causal"):
        for dtype in ("bfloat16", "float16", "float32"):
            assert {(dtype, 64, mask, 0.1), (dtype, 128, mask, 0.1)} <= bounded, (dtype, mask)
    assert ("bfloat16", 64, "bounds n=2", 0.0) in bounded  # the packed BERT-large mask, also in evaluation
    assert len(masked) == 3 * (len(windowed) + len(bounded))  # forward, dK/dV, dQ each
