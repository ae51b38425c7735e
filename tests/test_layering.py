"""Imports run downhill only (DESIGN.md, "Layout").

The allowed order is written once, in ``LAYERS``: a module may import its own package and
any package in a LOWER layer, never one in its own layer or above. So:

- ``bench/`` (benchmarks) may import everything below, ``run_pretraining`` included;
- ``run_pretraining.py`` (the entry point) and ``tools/`` (developer and test tools) may import
  ``bert``, ``kernels``, ``data``, ``launch``, and not each other;
- ``bert/`` (the model, trainer, logging) may import ``kernels``, ``data``, ``launch``;
- ``kernels/``, ``data/`` and ``launch/`` form the bottom layer and import NONE of each
  other: the attention interface lives in ``kernels``, batch types in ``data``, process
  setup in ``launch``, and the code that needs two of them lives in ``bert`` or above;
- ``fileio/`` (files published whole, streamed digests) lies below them all and imports
  nothing of the project, so every package can publish its files through it.

Inside a package listed in ``MODULE_LAYERS`` the same holds between its modules: a module may
import only modules of a lower layer of its package, so the package has no import circle (for
``kernels/``: the interface at the bottom, the registry at the top).

Every import statement counts, wherever it is (lazy imports inside functions included), as do
``__import__("pkg.mod")`` and ``importlib.import_module("pkg.mod")`` with a literal name.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Top-level package (or module) -> layer. Higher layers may import lower ones only.
LAYERS = {
    "bench": 3,
    "run_pretraining": 2,
    "tools": 2,  # developer and test tools (device_reads, compile_check): never imported by the application
    "bert": 1,
    "kernels": 0,
    "data": 0,
    "launch": 0,
    "fileio": -1,
}

# Package -> {module: layer} inside it. A module imports only modules of a lower layer; every
# module of the package must be listed (a new module is placed here on purpose).
MODULE_LAYERS = {
    "kernels": {
        "__init__": 0,  # imports nothing
        "interface": 0,  # layouts, AttentionFn, BackendUnavailable, settings: imports nothing of the project
        "gemm_epilogue": 0,  # the FFN-in GEMM with bias+GELU in its epilogue: imports nothing of the project
        "masks": 1,  # FlashMask semantics and builders, pure PyTorch
        "tiles": 1,
        "grouped": 1,
        "runtime": 1,  # compiled or interpreted Triton
        "reference": 2,  # the reference and padded backends
        "triton_jit": 2,  # the device code of the attention kernel family
        "fused_ops_jit": 2,  # the fused ops' device code (shares the family's dropout mask)
        "rotary_jit": 2,  # device code of the rotary embedding
        "varlen_attention": 3,  # the Triton backends
        "fused_ops": 3,
        "rotary": 3,  # rotary embedding: Triton kernel and PyTorch reference
        "library_backends": 3,
        "flashmask": 4,  # shares the varlen kernels' dropout seeds
        "registry": 5,  # every backend by name
        "context_parallel": 6,  # attention over documents split across ranks: wraps a registry backend
    },
}

# module path -> top-level modules it must not import at all (beyond the layer rule).
FORBIDDEN = {
    # The plan is pure: the simulator and the plan tests run without process groups.
    "data/rebalance_plan.py": ("torch", "data.rebalance"),
    "bench/rebalance_sim.py": ("torch", "data.rebalance"),
}


def project_modules(root: Path) -> list[Path]:
    files = [root / f"{name}.py" for name in LAYERS if (root / f"{name}.py").is_file()]
    for name in LAYERS:
        if (root / name).is_dir():
            files += sorted((root / name).rglob("*.py"))
    return files


def imported_names(tree: ast.Module, package: str, with_names: bool = False) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in ``tree``; ``package`` resolves relative ones.
    ``with_names``: ``from a import b`` gives ``a.b`` (b may be a module of package a)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: stays inside the own package (or climbs out of it)
                base = package.split(".")[: max(len(package.split(".")) - node.level + 1, 0)]
                name = ".".join(base + ([node.module] if node.module else [])) or "."
            else:
                name = node.module
            if with_names:
                found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, name))
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called in ("__import__", "import_module"):
                found.append((node.lineno, node.args[0].value))
    return found


def violations(root: Path) -> list[str]:
    problems = []
    for path in project_modules(root):
        rel = path.relative_to(root)
        own = rel.parts[0].removesuffix(".py")
        package = ".".join(rel.with_suffix("").parts[:-1]) or own
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in imported_names(tree, package):
            top = name.split(".")[0]
            if top in LAYERS and top != own and LAYERS[top] >= LAYERS[own]:
                where = "the same layer" if LAYERS[top] == LAYERS[own] else "a higher layer"
                problems.append(f"{rel}:{line}: {own} imports {name} ({where})")
            for banned in FORBIDDEN.get(rel.as_posix(), ()):
                if name == banned or name.startswith(banned + "."):
                    problems.append(f"{rel}:{line}: imports {name}, which this module must not")
    return problems


def module_violations(root: Path) -> list[str]:
    """Imports inside a package of MODULE_LAYERS that do not run downhill, and unlisted modules."""
    problems = []
    for package, layers in MODULE_LAYERS.items():
        for path in sorted((root / package).glob("*.py")):
            rel = path.relative_to(root)
            own = path.stem
            if own not in layers:
                problems.append(f"{rel}: not in MODULE_LAYERS[{package!r}]; give it a layer")
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, name in imported_names(tree, package, with_names=True):
                parts = name.split(".")
                if parts[0] != package or len(parts) < 2 or parts[1] not in layers or parts[1] == own:
                    continue
                target = parts[1]
                if layers[target] >= layers[own]:
                    where = "the same layer" if layers[target] == layers[own] else "a higher layer"
                    problems.append(
                        f"{rel}:{line}: {package}.{own} (layer {layers[own]}) imports {package}.{target} "
                        f"(layer {layers[target]}: {where})"
                    )
    return problems


def test_imports_run_downhill():
    problems = violations(REPO)
    assert not problems, "upward or sideways imports:\n" + "\n".join(problems)


def test_imports_inside_packages_run_downhill():
    problems = module_violations(REPO)
    assert not problems, "imports inside a package that do not run downhill:\n" + "\n".join(problems)


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages <= set(LAYERS), f"packages without a layer in LAYERS: {sorted(packages - set(LAYERS))}"


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from bert.model import X\n", "kernels/bad.py:1: kernels imports bert.model (a higher layer)"),
        (
            "def f():\n    import bench.data_loading\n",
            "kernels/bad.py:2: kernels imports bench.data_loading (a higher layer)",
        ),
        ("from data import batch\n", "kernels/bad.py:1: kernels imports data (the same layer)"),
        ("x = __import__('bert.trainer')\n", "kernels/bad.py:1: kernels imports bert.trainer (a higher layer)"),
        (
            "import importlib\nimportlib.import_module('run_pretraining')\n",
            "kernels/bad.py:2: kernels imports run_pretraining (a higher layer)",
        ),
        ("from .attention import Layout\nimport torch\n", None),
    ],
)
def test_checker_names_file_and_line(tmp_path, source, expected):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "bad.py").write_text(source)
    assert violations(tmp_path) == ([expected] if expected else [])


@pytest.mark.parametrize(
    "module, source, expected",
    [
        (
            "interface",
            "import torch\nfrom kernels.registry import get_backend\n",
            "kernels/interface.py:2: kernels.interface (layer 0) imports kernels.registry (layer 5: a higher layer)",
        ),
        (
            "masks",
            "def f():\n    from kernels import runtime\n",
            "kernels/masks.py:2: kernels.masks (layer 1) imports kernels.runtime (layer 1: the same layer)",
        ),
        (
            "flashmask",
            "from . import registry\n",
            "kernels/flashmask.py:1: kernels.flashmask (layer 4) imports kernels.registry (layer 5: a higher layer)",
        ),
        (
            "runtime",
            "import importlib\nimportlib.import_module('kernels.reference')\n",
            "kernels/runtime.py:2: kernels.runtime (layer 1) imports kernels.reference (layer 2: a higher layer)",
        ),
        (
            "registry",
            "from kernels.interface import Layout\nfrom .masks import to_dense\nimport kernels.runtime\n",
            None,
        ),
    ],
)
def test_module_checker_names_file_and_line(tmp_path, module, source, expected):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "kernels" / f"{module}.py").write_text(source)
    assert module_violations(tmp_path) == ([expected] if expected else [])


def test_module_checker_wants_every_module_placed(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "newcomer.py").write_text("import torch\n")
    assert module_violations(tmp_path) == ["kernels/newcomer.py: not in MODULE_LAYERS['kernels']; give it a layer"]


def test_checker_catches_forbidden_module(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rebalance_plan.py").write_text("import numpy\nimport torch.distributed as dist\n")
    assert violations(tmp_path) == ["data/rebalance_plan.py:2: imports torch.distributed, which this module must not"]


def test_rebalance_plan_and_simulator_load_no_exchange_and_no_torch():
    code = (
        "import sys, bench.rebalance_sim, data.rebalance_plan; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m == 'data.rebalance'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
