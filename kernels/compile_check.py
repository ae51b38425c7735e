"""Compile every kernel variant for a Hopper GPU (sm_90) on any machine, GPU or not.

    python -m kernels.compile_check [--registers] [--json PATH]

The interpreter tests check the kernels' arithmetic, not that Triton can compile them
(types, layouts, shared memory). Here each launcher runs with its launch swapped for
``triton.compile(..., target=sm_90)``, Triton's whole pipeline down to ptxas and a cubin,
on BERT-large shapes and the other supported head dims and dtypes. Prints one line per
kernel: tiles, warps, stages, shared memory, and with ``--registers`` (running the ptxas
that Triton ships once more per kernel) the registers and spill bytes. Exits 1 if a kernel does not compile or needs more shared memory
than a Hopper block can have. Runs in a process of its own: Triton must be imported in
compiled mode, so TRITON_INTERPRET is cleared before it is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run by path: import the project from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

MAX_SHARED = 227 * 1024  # bytes of shared memory a Hopper block can opt into


def _arg_type(value) -> str:
    import torch

    ptr = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
           torch.int8: "*i8", torch.int64: "*i64"}
    if isinstance(value, torch.Tensor):
        return ptr[value.dtype]
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    raise TypeError(f"unexpected kernel argument {value!r}")


def _ptxas_report(ptx: str) -> dict:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, timeout=120).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else None}


def compiling_launcher(records: list[dict], variant: dict, registers: bool = True):
    """A stand-in for ``jit_kernels._launch`` that compiles each kernel for sm_90 instead of
    running it, appending one record per kernel (with ``variant``'s current labels)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)

    def compile_launch(kernel, grid, *args, num_warps=4, num_stages=3, **kwargs):
        values = dict(zip(kernel.arg_names, args), **kwargs)
        constexprs = {p.name: values[p.name] for p in kernel.params if p.is_constexpr}
        signature = {n: "constexpr" if n in constexprs else _arg_type(values[n]) for n in kernel.arg_names}
        binary = triton.compile(ASTSource(kernel, signature, constexprs), target=target,
                                options={"num_warps": num_warps, "num_stages": num_stages})
        blocks = {k: v for k, v in constexprs.items() if k.startswith("BLOCK")}
        records.append({"kernel": kernel.fn.__name__, **variant, "blocks": blocks, "num_warps": num_warps,
                        "num_stages": num_stages, "shared_bytes": binary.metadata.shared,
                        **(_ptxas_report(binary.asm["ptx"]) if registers else {})})

    return compile_launch


def run_all(registers: bool = False) -> list[dict]:
    """Compile all variants; returns one record per kernel compiled."""
    import torch
    from kernels import runtime

    if runtime.triton_interpreted():
        raise RuntimeError("Triton was imported in interpreter mode; run with TRITON_INTERPRET=0")
    module = runtime.load(interpret=False)
    records: list[dict] = []
    variant: dict = {}

    module._launch = compiling_launcher(records, variant, registers)

    def meta(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    t, h, b, seed, offset = 4096, 16, 8, 2**40 + 3, 12345
    for dtype, dim, p, grouped in [(torch.bfloat16, 64, 0.1, True), (torch.bfloat16, 64, 0.0, False),
                                   (torch.float16, 64, 0.1, False), (torch.float16, 128, 0.0, False),
                                   (torch.bfloat16, 32, 0.1, False), (torch.float32, 64, 0.1, False)]:
        variant.clear()
        variant.update(dtype=str(dtype).removeprefix("torch."), head_dim=dim, dropout=p, grouped=grouped)
        q, k, v = meta(t, 3, h, dim, dtype=dtype).unbind(1)  # the model's packed projection
        out, dout = meta(t, h, dim, dtype=dtype), meta(t, h, dim, dtype=dtype)
        lse = meta(t, h, dtype=torch.float32)
        cu = meta(b + 1, dtype=torch.int32)
        order = meta(b, dtype=torch.int32) if grouped else None
        module.attn_fwd(q, k, v, out, lse, cu, order, 0, b, 512, dim ** -0.5, p, seed, offset)
        grads = [meta(t, h, dim, dtype=dtype) for _ in range(3)]
        module.attn_bwd(dout, q, k, v, lse, lse, *grads, cu, order, 0, b, 512, dim ** -0.5, p, seed, offset)
    variant.clear()
    variant.update(dtype="bfloat16 in, float32 params", dropout=0.1)
    r, n, i = 4096, 1024, 4096
    x_i, b_i = meta(r, i, dtype=torch.bfloat16), meta(i, dtype=torch.float32)
    module.bias_gelu_fwd(x_i, b_i, meta(r, i, dtype=torch.bfloat16))
    module.bias_gelu_bwd(meta(r, i, dtype=torch.bfloat16), x_i, b_i, meta(r, i, dtype=torch.bfloat16))
    x, res, vec = meta(r, n, dtype=torch.bfloat16), meta(r, n, dtype=torch.float32), meta(n, dtype=torch.float32)
    y, hid, stats = meta(r, n, dtype=torch.float32), meta(r, n, dtype=torch.float32), meta(r, dtype=torch.float32)
    module.bdaln_fwd(x, vec, res, vec, vec, y, hid, stats, stats, 1e-12, 0.1, seed, 7)
    module.bdaln_bwd(y, hid, vec, stats, stats, meta(r, n, dtype=torch.bfloat16), meta(r, n, dtype=torch.float32),
                     0.1, seed, 7)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the records here as JSON")
    parser.add_argument("--registers", action="store_true", help="report registers and spills (ptxas -v)")
    args = parser.parse_args(argv)
    try:
        records = run_all(args.registers)
    except Exception as e:  # a compile error: one line, non-zero exit
        print(f"compile_check: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}",
              file=sys.stderr)
        return 1
    bad = [r for r in records if r["shared_bytes"] > MAX_SHARED]
    for r in records:
        extra = "" if r.get("registers") is None else f" regs {r['registers']} spill {r['spill_bytes']}B"
        print(f"{r['kernel']:16s} {r.get('dtype', ''):28s} D={r.get('head_dim', '-')!s:4s} p={r['dropout']} "
              f"{r['blocks']} warps {r['num_warps']} stages {r['num_stages']} shared {r['shared_bytes']}B{extra}")
    if args.json:
        path = Path(args.json)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(records, indent=1))
        tmp.rename(path)
    if bad:
        print(f"compile_check: {len(bad)} kernel(s) need more than {MAX_SHARED} bytes of shared memory", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # before Triton is imported
    sys.exit(main())
