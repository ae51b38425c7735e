"""Compile every kernel variant for a Hopper GPU (sm_90) on any machine, GPU or not.

    python -m tools.compile_check [--registers] [--jobs N] [--head-dims 64 128 | --representative] [--json PATH]

The interpreter tests check the kernels' arithmetic, not that Triton can compile them
(types, layouts, shared memory). Here each launcher runs with its launch swapped for
``triton.compile(..., target=sm_90)``, Triton's whole pipeline down to ptxas and a cubin,
for every supported combination of dtype (fp32 both with and without TF32), head dim
(32, 64, 128), dropout (off, on) and tile preset, each plain (no mask: the varlen kernels),
with a window, and with FlashMask bounds (1, 2 or 4, causal or not), and the rotary kernel
(fp32, bf16, fp16; forward and inverse). ``--representative`` compiles only the subset
``make test`` checks (REPRESENTATIVE: each kernel, each switch value once). Prints one line per
kernel: mask, tiles, warps, stages, shared memory, and with ``--registers`` (the report of the
ptxas run that built the cubin) the registers, spill bytes and resident blocks and
warps per SM, then the registers of each kernel plain, windowed and bounded side by side.
Exits 1 if a kernel does not compile, needs more shared memory than a Hopper block can have,
or spills registers. ``--jobs N`` compiles on N processes. Runs in a process of its own:
Triton must be imported in compiled mode, so TRITON_INTERPRET is cleared before it is. A
developer command: nothing in the application imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common.files import write_text

MAX_SHARED = 227 * 1024  # bytes of shared memory a Hopper block can opt into


def _arg_type(value) -> str:
    import torch

    ptr = {
        torch.float16: "*fp16",
        torch.bfloat16: "*bf16",
        torch.float32: "*fp32",
        torch.int32: "*i32",
        torch.int8: "*i8",
        torch.int64: "*i64",
    }
    if isinstance(value, torch.Tensor):
        return ptr[value.dtype]
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    raise TypeError(f"unexpected kernel argument {value!r}")


def _parse_ptxas(log: str) -> dict:
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else None}


def _ptxas_report(ptx: str) -> dict:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            timeout=120,
        ).stderr
    return _parse_ptxas(out)


def _compile_with_log(triton, source, target, options) -> tuple:
    """``triton.compile`` and the report of the ptxas -v it ran (Triton prints it with
    TRITON_DUMP_PTXAS_LOG); "" when it ran none (the kernel came from Triton's cache)."""
    knobs = triton.knobs.nvidia
    dump, knobs.dump_ptxas_log = knobs.dump_ptxas_log, True
    try:
        with contextlib.redirect_stdout(io.StringIO()) as log:
            binary = triton.compile(source, target=target, options=options)
    finally:
        knobs.dump_ptxas_log = dump
    return binary, log.getvalue()


def compiling_launcher(records: list[dict], variant: dict, registers: bool = True):
    """A stand-in for ``triton_jit._launch`` that compiles each kernel for sm_90 instead of
    running it, appending one record per kernel (with ``variant``'s current labels)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)

    def compile_launch(kernel, grid, *args, num_warps=4, num_stages=3, **kwargs):
        values = dict(zip(kernel.arg_names, args), **kwargs)
        constexprs = {p.name: values[p.name] for p in kernel.params if p.is_constexpr}
        signature = {n: "constexpr" if n in constexprs else _arg_type(values[n]) for n in kernel.arg_names}
        options = {"num_warps": num_warps, "num_stages": num_stages}
        binary, log = _compile_with_log(triton, ASTSource(kernel, signature, constexprs), target, options)
        # The report of the ptxas run that built the cubin (one ptxas per kernel, not two: a
        # fifth of a cold compile); a cached kernel ran none, so ptxas runs on its PTX here.
        report = (_parse_ptxas(log) if "Used " in log else _ptxas_report(binary.asm["ptx"])) if registers else {}
        blocks = {k: v for k, v in constexprs.items() if k.startswith("BLOCK")}
        records.append(
            {
                "kernel": kernel.fn.__name__,
                **variant,
                "blocks": blocks,
                "num_warps": num_warps,
                "num_stages": num_stages,
                "shared_bytes": binary.metadata.shared,
                **report,
            }
        )

    return compile_launch


def occupancy(registers: int | None, num_warps: int, shared_bytes: int) -> dict:
    """Resident blocks and warps per SM on sm_90 (64K registers allocated per warp in units of
    256, 228 KB shared memory with 1 KB reserved per block, 64 warps, 32 blocks)."""
    if registers is None:
        return {}
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = 65536 // (per_warp * num_warps)
    by_smem = (228 * 1024) // (shared_bytes + 1024) if shared_bytes else 32
    blocks = max(0, min(by_regs, by_smem, 64 // num_warps, 32))
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * num_warps}


MASKS = ("none", "window", "bounds n=2", "bounds n=4", "bounds n=1 causal", "bounds n=2 causal")


def attention_variants() -> list[tuple]:
    """Every supported (dtype, head dim, dropout, fp32 precision, tile preset, grouped, mask)
    combination: the plain ones (no mask) first, then each default-preset one with a window,
    then the bounded ones (every mask kind with dropout, the packed BERT masks n=2 and n=4 also
    without; head dims 32 and 64 share their tiles)."""
    from kernels.tiles import TILE_PRESETS

    plain, windowed, bounded = [], [], []
    for dtype in ("bfloat16", "float16", "float32"):
        for dim in (32, 64, 128):
            for p in (0.0, 0.1):
                for precision in ("ieee", "tf32") if dtype == "float32" else ("-",):
                    grouped = dtype == "bfloat16" and dim == 64 and p > 0
                    plain.append((dtype, dim, p, precision, "default", grouped, "none"))
                    windowed.append((dtype, dim, p, precision, "default", grouped, "window"))
    for preset in TILE_PRESETS:  # the alternatives bench/gpu_check.sh times at BERT-large's shape
        if preset != "default":
            for dtype in ("bfloat16", "float16"):
                for p in (0.0, 0.1):
                    plain.append((dtype, 64, p, "-", preset, False, "none"))
    for dtype in ("bfloat16", "float16", "float32"):
        for dim in (64, 128):
            for mask in MASKS[2:]:
                for p in (0.0, 0.1) if mask in ("bounds n=2", "bounds n=4") else (0.1,):
                    bounded.append((dtype, dim, p, "ieee" if dtype == "float32" else "-", "default", False, mask))
    return plain + windowed + bounded


# The subset `make test` compiles (`--representative`; `make test-full` compiles every variant):
# each kernel of the family (each variant builds the forward, dK/dV and dQ), every value of
# every switch the full list takes (dtype, head dim, dropout, fp32 precision, tile preset,
# grouped dispatch, each mask kind: window, FlashMask bounds 1 / 2 / 4, causal or not), and the
# kernels nearest the register limit (docs/kernels.md). About a tenth of the full check's compile
# time (tests/kernels/test_kernels_compile.py checks it covers every value of the full list).
REPRESENTATIVE = (
    ("bfloat16", 64, 0.1, "-", "default", True, "none"),  # BERT-large training, grouped dispatch
    ("float32", 128, 0.1, "tf32", "default", False, "none"),  # TF32; its forward is the fp32 register peak
    ("float16", 64, 0.0, "-", "small", False, "none"),  # the small tile preset
    ("float32", 32, 0.0, "ieee", "default", False, "window"),  # fp32's own tiles at head dim 32
    ("bfloat16", 64, 0.0, "-", "default", False, "bounds n=2"),  # the packed BERT-large mask (evaluation)
    ("float16", 64, 0.1, "-", "default", False, "bounds n=4"),  # 4 bounds: the forward's own tile
    ("float32", 128, 0.1, "ieee", "default", False, "bounds n=1 causal"),  # fp32 with bounds
    ("bfloat16", 128, 0.1, "-", "default", False, "bounds n=2 causal"),  # 16-bit head dim 128 with bounds
)
# (dtype, head dim, inverse) of the rotary kernel: each dtype, head dim and direction once.
REPRESENTATIVE_ROTARY = (("float32", 64, False), ("bfloat16", 128, True), ("float16", 64, True))


def _compile_attention(variant: tuple, registers: bool) -> list[dict]:
    import torch

    from kernels import runtime

    dtype_name, dim, p, precision, preset, grouped, mask = variant
    module = runtime.load(interpret=False)
    records: list[dict] = []
    labels = dict(dtype=dtype_name, head_dim=dim, dropout=p, precision=precision, tiles=preset)
    module._launch = compiling_launcher(records, dict(labels, grouped=bool(grouped), mask=mask), registers)
    module.TILE_PRESET = preset
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    dtype = getattr(torch, dtype_name)

    def meta(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    t, h, b, s = 4096, 16, 8, 512
    rng = meta(2, dtype=torch.int64)  # the device (seed, offset) pair the kernels load
    q, k, v = meta(t, 3, h, dim, dtype=dtype).unbind(1)  # the model's packed projection
    out, dout = meta(t, h, dim, dtype=dtype), meta(t, h, dim, dtype=dtype)
    lse = meta(t, h, dtype=torch.float32)
    cu = meta(b + 1, dtype=torch.int32)
    order = meta(b, dtype=torch.int32) if grouped else None
    seqs = module.Sequences(cu, order, 0, b, s, window=128 if mask == "window" else None)
    if mask.startswith("bounds"):  # packed rows of s, one bound tensor broadcast over heads
        n = int(mask.split("=")[1][0])
        block_n = module.bounded_key_block(q)
        bounds = meta(b, 1, s, n, dtype=torch.int32)
        bmm = meta(b, 1, s // block_n, n, 2, dtype=torch.int32)
        seqs = seqs._replace(bounds=bounds, block_minmax=bmm, causal=mask.endswith("causal"))
    module.attn_fwd(q, k, v, out, lse, seqs, dim**-0.5, p, rng)
    grads = [meta(t, h, dim, dtype=dtype) for _ in range(3)]
    module.attn_bwd(dout, q, k, v, lse, lse, *grads, seqs, dim**-0.5, p, rng)
    return records


def _compile_fused(registers: bool) -> list[dict]:
    import torch

    from kernels import runtime
    from kernels.ops import fused as fused_ops

    module = runtime.load(interpret=False, source=fused_ops.JIT_SOURCE)
    records: list[dict] = []
    module._launch = compiling_launcher(records, {"dtype": "bfloat16 in, float32 params", "dropout": 0.1}, registers)

    def meta(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    rng = meta(2, dtype=torch.int64)  # the device (seed, offset) pair the kernels load
    r, n, i = 4096, 1024, 4096
    x_i, b_i = meta(r, i, dtype=torch.bfloat16), meta(i, dtype=torch.float32)
    module.bias_gelu_fwd(x_i, b_i, meta(r, i, dtype=torch.bfloat16))
    module.bias_gelu_bwd(meta(r, i, dtype=torch.bfloat16), x_i, b_i, meta(r, i, dtype=torch.bfloat16))
    x, res, vec = meta(r, n, dtype=torch.bfloat16), meta(r, n, dtype=torch.float32), meta(n, dtype=torch.float32)
    y, hid, stats = meta(r, n, dtype=torch.float32), meta(r, n, dtype=torch.float32), meta(r, dtype=torch.float32)
    module.bdaln_fwd(x, vec, res, vec, vec, y, hid, stats, stats, 1e-12, 0.1, rng)
    module.bdaln_bwd(
        y, hid, vec, stats, stats, meta(r, n, dtype=torch.bfloat16), meta(r, n, dtype=torch.float32), 0.1, rng
    )
    return records


ROTARY_HEAD_DIMS = (64, 128)  # ModernBERT's 64 (base and large), and 128


def rotary_variants(head_dims: tuple[int, ...] = ROTARY_HEAD_DIMS) -> list[tuple]:
    """(dtype, head dim, inverse) of every rotary build: each dtype q and k reach the kernel in
    (fp32; bf16 and fp16 under autocast), forward and inverse (its backward)."""
    return [(d, dim, inv) for d in ("float32", "bfloat16", "float16") for dim in head_dims for inv in (False, True)]


def _compile_rotary(registers: bool, variants: tuple[tuple, ...]) -> list[dict]:
    """The rotary kernel (``kernels.ops.rotary_jit``) in each (dtype, head dim, inverse) of
    ``variants``, on the strided q view of the fused QKV projection and int64 positions, as the
    model calls it."""
    import torch

    from kernels import runtime
    from kernels.ops import rotary

    module = runtime.load(interpret=False, source=rotary.JIT_SOURCE)
    records: list[dict] = []
    t, h = 4096, 16
    for dtype_name, dim, inverse in variants:
        dtype = getattr(torch, dtype_name)
        labels = {"dtype": dtype_name, "head_dim": dim, "dropout": 0.0}
        module._launch = compiling_launcher(records, dict(labels, inverse=inverse), registers)
        x = torch.empty(t, 3, h, dim, dtype=dtype, device="meta")[:, 0]
        out = torch.empty(t, h, dim, dtype=dtype, device="meta")
        pos = torch.empty(t, dtype=torch.int64, device="meta")
        cos = torch.empty(8192, dim // 2, dtype=torch.float32, device="meta")
        module.rotary_fwd(x, out, pos, cos, cos, inverse)
    return records


def side_by_side(records: list[dict]) -> list[str]:
    """Lines of registers (spill bytes) of each attention kernel under each mask, by (dtype,
    head dim, dropout, precision), for the default preset; '-' where not compiled."""
    table: dict[tuple, dict[str, str]] = {}
    for r in records:
        if "mask" in r and r.get("tiles") == "default" and r.get("registers") is not None:
            key = (r["kernel"], r["dtype"], r["head_dim"], r["dropout"], r["precision"])
            cell = f"{r['registers']}" + (f"({r['spill_bytes']}B)" if r["spill_bytes"] else "")
            table.setdefault(key, {})[r["mask"] + (" grouped" if r["grouped"] else "")] = cell
    columns = [m for m in MASKS if any(m in row for row in table.values())]
    if not columns:
        return []
    lines = ["registers (spill) per kernel: " + " | ".join(columns)]
    for (kernel, dtype, dim, p, precision), row in sorted(table.items()):
        label = f"{dtype}{'/' + precision if precision != '-' else ''}"
        cells = [row.get(m) or row.get(m + " grouped") or "-" for m in columns]
        lines.append(f"  {kernel:16s} {label:14s} D={dim:<4d} p={p}: " + " | ".join(f"{c:>8s}" for c in cells))
    return lines


def _job(item: tuple, registers: bool) -> list[dict]:
    os.environ["TRITON_INTERPRET"] = "0"  # a spawned worker: before it imports Triton
    if item[0] == "rotary":
        return _compile_rotary(registers, item[1])
    return _compile_fused(registers) if item == ("fused",) else _compile_attention(item, registers)


def run_all(
    registers: bool = False,
    jobs: int = 1,
    head_dims: tuple[int, ...] | None = None,
    representative: bool = False,
) -> list[dict]:
    """Compile all variants (those of ``head_dims`` only, if given; then no fused ops; or with
    ``representative`` the subset REPRESENTATIVE and REPRESENTATIVE_ROTARY, with the fused ops),
    on ``jobs`` processes; returns one record per kernel compiled, in a fixed order: the plain
    attention kernels, the fused ops, the windowed and the bounded attention kernels, the rotary
    kernel (at the head dims of ROTARY_HEAD_DIMS among ``head_dims``)."""
    from kernels import runtime

    if runtime.triton_interpreted():
        raise RuntimeError("Triton was imported in interpreter mode; run with TRITON_INTERPRET=0")
    if representative:
        chosen = set(REPRESENTATIVE)  # in the full list's order: plain, windowed, bounded
        items = [v for v in attention_variants() if v in chosen]
        rotary = tuple(REPRESENTATIVE_ROTARY)
    else:
        items = [v for v in attention_variants() if head_dims is None or v[1] in head_dims]
        rotary = tuple(rotary_variants(tuple(d for d in ROTARY_HEAD_DIMS if head_dims is None or d in head_dims)))
    if head_dims is None:  # the fused ops right after the plain attention kernels
        items.insert(sum(v[-1] == "none" for v in items), ("fused",))
    items.append(("rotary", rotary))
    if jobs <= 1:
        results = [_job(item, registers) for item in items]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_job, items, [registers] * len(items)))
    records = [r for batch in results for r in batch]
    for r in records:
        r.update(occupancy(r.get("registers"), r["num_warps"], r["shared_bytes"]))
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the records here as JSON")
    parser.add_argument(
        "--registers",
        action="store_true",
        help="report registers, spills and occupancy (ptxas -v); any spill fails the check",
    )
    parser.add_argument("--jobs", type=int, default=1, help="compile on this many processes (default 1)")
    parser.add_argument("--head-dims", type=int, nargs="+", help="only the attention variants of these head dims")
    parser.add_argument(
        "--representative",
        action="store_true",
        help="only the subset `make test` compiles: each kernel and each switch value once (REPRESENTATIVE)",
    )
    args = parser.parse_args(argv)
    if args.representative and args.head_dims:
        parser.error("--representative and --head-dims: choose one")
    try:
        head_dims = tuple(args.head_dims) if args.head_dims else None
        records = run_all(args.registers, max(1, args.jobs), head_dims, args.representative)
    except Exception as e:  # a compile error: one line, non-zero exit
        print(
            f"compile_check: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}",
            file=sys.stderr,
        )
        return 1
    for r in records:
        extra = (
            ""
            if r.get("registers") is None
            else f" regs {r['registers']} spill {r['spill_bytes']}B"
            f" blocks/SM {r['blocks_per_sm']} warps/SM {r['warps_per_sm']}"
        )
        label = f"{r.get('dtype', '')}{'/' + r['precision'] if r.get('precision', '-') != '-' else ''}"
        tiles = f" tiles={r['tiles']}" if r.get("tiles", "default") != "default" else ""
        mask = f" {r['mask']}{' grouped' if r['grouped'] else ''}" if "mask" in r else ""
        print(
            f"{r['kernel']:16s} {label:28s} D={r.get('head_dim', '-')!s:4s} p={r['dropout']}{mask}{tiles} "
            f"{r['blocks']} warps {r['num_warps']} stages {r['num_stages']} shared {r['shared_bytes']}B{extra}"
        )
    for line in side_by_side(records):
        print(line)
    if args.json:
        write_text(args.json, json.dumps(records, indent=1))
    failed = 0
    big = [r for r in records if r["shared_bytes"] > MAX_SHARED]
    if big:
        print(
            f"compile_check: {len(big)} kernel(s) need more than {MAX_SHARED} bytes of shared memory", file=sys.stderr
        )
        failed = 1
    spills = [r for r in records if r.get("spill_bytes")]
    if spills:
        names = ", ".join(
            f"{r['kernel']} {r['dtype']} D={r.get('head_dim')} p={r['dropout']} {r.get('mask', '')}" for r in spills
        )
        print(f"compile_check: {len(spills)} kernel(s) spill registers: {names}", file=sys.stderr)
        failed = 1
    return failed


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # before Triton is imported
    sys.exit(main())
