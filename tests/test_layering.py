"""Imports run downhill only (DESIGN.md, "Layout"), as each package's opening lines say.

Three rules, each written once here:

- ``LAYERS``: a top-level package may import only packages of a LOWER layer: ``bench`` > the
  entry point and ``tools`` > ``bert`` > ``kernels``, ``data``, ``launch`` (which import none
  of each other) > ``common`` (which imports nothing of the project).
- Every package's ``__init__.py`` docstring has an ``Imports:`` paragraph naming, in double
  backticks, what its modules may import outside the package itself; an import leaving the
  package that it does not name (or a prefix of) is a violation. So the contract a reader sees
  is the one enforced (``bert.model`` may not import the trainer, nor ``data`` anything of ``bert``).
- No import circles anywhere in the application, even inside one folder; and inside
  ``kernels/`` (``MODULE_LAYERS``) each module imports only modules of a lower layer.

Every import statement counts, wherever it is (lazy imports inside functions included), as do
``__import__("pkg.mod")`` and ``importlib.import_module("pkg.mod")`` with a literal name.
"""

from __future__ import annotations

import ast
import os
import re
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
    "common": -1,
}
APPLICATION = ("bert", "data", "kernels", "launch", "common")

# Package -> {module: layer} inside it. A module imports only modules of a lower layer; every
# module of the package must be listed (a new module is placed here on purpose).
MODULE_LAYERS = {
    "kernels": {
        "__init__": 0,  # imports nothing
        "interface": 0,  # layouts, AttentionFn, BackendUnavailable, settings: imports nothing of the project
        "masks": 1,  # FlashMask semantics and builders, pure PyTorch
        "tiles": 1,
        "grouped": 1,
        "runtime": 1,  # compiled or interpreted Triton
        "reference": 2,  # the reference and padded backends
        "triton_jit": 2,  # the device code of the attention kernel family
        "varlen_attention": 3,  # the Triton backends
        "library_backends": 3,
        "flashmask": 4,  # shares the varlen kernels' dropout seeds
        "registry": 5,  # every backend by name
        "ops": 2,  # the fused elementwise ops (a sub-package): interface and runtime only
        "context_parallel": 6,  # attention over documents split across ranks: wraps a registry backend
    },
}

# module path -> top-level modules it must not import at all (beyond the layer rule).
FORBIDDEN = {
    # The plan is pure: the simulator and the plan tests run without process groups.
    "data/rebalance/plan.py": ("torch", "data.rebalance.exchange"),
    "bench/rebalance_sim.py": ("torch", "data.rebalance.exchange"),
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


def package_contract(init: Path) -> list[str] | None:
    """The project names of the ``Imports:`` paragraph of a package's docstring (None: no paragraph)."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    match = re.search(r"^Imports:(.*?)(?:\n\n|\Z)", doc, re.M | re.S)
    if match is None:
        return None
    return [n for n in re.findall(r"``([\w.]+)``", match.group(1)) if n.split(".")[0] in LAYERS]


def contract_violations(root: Path) -> list[str]:
    """Imports that leave a package for a name its ``Imports:`` paragraph does not allow."""
    problems = []
    for init in sorted(p for top in APPLICATION for p in (root / top).rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(root).parts)
        allowed = package_contract(init)
        if allowed is None:
            problems.append(f"{init.relative_to(root)}: no 'Imports:' paragraph in its docstring")
            continue
        for path in sorted(init.parent.glob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, name in imported_names(tree, package):
                if name.split(".")[0] not in LAYERS or name == package or name.startswith(package + "."):
                    continue
                if not any(name == a or name.startswith(a + ".") for a in allowed):
                    problems.append(
                        f"{path.relative_to(root)}:{line}: imports {name}, which {package}'s Imports: omits"
                    )
    return problems


def import_circles(root: Path) -> list[list[str]]:
    """Every set of application modules that import each other, directly or around a circle."""
    modules = {}
    for top in APPLICATION:
        for path in (root / top).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = imported_names(ast.parse(path.read_text()), package, with_names=True)
        found += imported_names(ast.parse(path.read_text()), package)
        graph[name] = {n for _, n in found if n in modules and n != name}
    index, low, stack, circles, counter = {}, {}, [], [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_every_package_keeps_its_imports_contract():
    problems = contract_violations(REPO)
    assert not problems, "imports a package's docstring does not allow:\n" + "\n".join(problems)


def test_no_import_circles():
    assert import_circles(REPO) == []


def test_contract_checker_names_file_and_line(tmp_path):
    (tmp_path / "data" / "prepare").mkdir(parents=True)
    (tmp_path / "data" / "__init__.py").write_text('"""Data.\n\nImports: ``common`` only.\n"""\n')
    (tmp_path / "data" / "prepare" / "__init__.py").write_text('"""Offline.\n\nImports: ``data.samples``.\n"""\n')
    (tmp_path / "data" / "prepare" / "x.py").write_text("from data.samples import S\nfrom data.loader import L\n")
    (tmp_path / "data" / "y.py").write_text("from common.files import f\nimport bert\n")
    assert contract_violations(tmp_path) == [
        "data/y.py:2: imports bert, which data's Imports: omits",
        "data/prepare/x.py:2: imports data.loader, which data.prepare's Imports: omits",
    ]


def test_circle_checker_finds_a_circle_inside_one_folder(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "__init__.py").write_text("")
    (tmp_path / "data" / "a.py").write_text("from data.b import x\n")
    (tmp_path / "data" / "b.py").write_text("def f():\n    from data import a\n")
    (tmp_path / "data" / "c.py").write_text("from data import a\n")
    assert import_circles(tmp_path) == [["data.a", "data.b"]]


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
        (
            "x = __import__('bert.train.trainer')\n",
            "kernels/bad.py:1: kernels imports bert.train.trainer (a higher layer)",
        ),
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
    (tmp_path / "data" / "rebalance").mkdir(parents=True)
    (tmp_path / "data" / "rebalance" / "plan.py").write_text("import numpy\nimport torch.distributed as dist\n")
    assert violations(tmp_path) == ["data/rebalance/plan.py:2: imports torch.distributed, which this module must not"]


def test_rebalance_plan_and_simulator_load_no_exchange_and_no_torch():
    code = (
        "import sys, bench.rebalance_sim, data.rebalance.plan; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m == 'data.rebalance.exchange'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
