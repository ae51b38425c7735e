"""Every command-line tool runs both ways: ``python -m package.module`` and ``python package/module.py``.

A CLI is any module of the project with an ``if __name__ == "__main__":`` block (found here,
so a new tool is covered without listing it). Run by path, Python puts the script's own
directory first on ``sys.path``, not the repository root; the project is importable all the
same because ``make setup`` installs it (editable, ``pip install -e .``), and no module of the
project edits ``sys.path`` (checked below; a stale copy once did, ten times over). The
``--help`` runs therefore get neither PYTHONPATH nor the repository as working directory: they
see the project as a user's shell does.

All ``--help`` runs share ONE subprocess (torch is imported once): before each run it forgets
the project's modules and restores ``sys.path`` and the environment, so each run resolves its
imports as a fresh interpreter would.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from data.synthetic import write_shards

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "bert", "data", "common", "kernels", "launch")
SYS_PATH_EDITS = ("append", "extend", "insert", "remove", "pop", "clear", "reverse", "sort", "__setitem__")


def _is_main_block(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
    )


def project_files() -> list[Path]:
    return [REPO / "run_pretraining.py"] + [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]


def cli_files() -> list[Path]:
    return [p for p in project_files() if any(_is_main_block(n) for n in ast.parse(p.read_text()).body)]


# Runs in the subprocess: argv[1] is the repository, stdin a JSON list of [how, target].
DRIVER = r"""
import contextlib, io, json, os, runpy, sys
repo, runs = sys.argv[1], json.load(sys.stdin)
base_path, base_env, results = list(sys.path), dict(os.environ), []
for how, target in runs:
    project = ("bench", "bert", "common", "data", "kernels", "launch", "tools", "run_pretraining")
    dirs = tuple(os.path.join(repo, p) + os.sep for p in project[:-1])
    for name in [m for m, mod in sys.modules.items()
                 if m.split(".")[0] in project or (getattr(mod, "__file__", None) or "").startswith(dirs)]:
        del sys.modules[name]
    sys.path[:] = base_path
    os.environ.clear()
    os.environ.update(base_env)
    out, code = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if how == "module":  # python -m target (run from the repository)
                sys.path[0] = repo
                sys.argv = [target, "--help"]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:  # python path/to/script.py (from anywhere): the script's directory comes first
                sys.path[0] = os.path.dirname(target)
                sys.argv = [target, "--help"]
                runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    text = out.getvalue()
    results.append({"how": how, "target": target, "code": code, "usage": "usage:" in text, "output": text[-400:]})
print(json.dumps(results), flush=True)
os._exit(0)  # skip interpreter teardown: modules were dropped and re-imported under it
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Runs by path see the project only through the package ``make setup`` installs
    (editable, from this checkout): say so plainly when this interpreter lacks it."""
    code = "import bert, common; print(bert.__file__); print(common.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path_factory.mktemp("anywhere"), env=env, capture_output=True, text=True
    )
    found = [Path(line).parent.parent for line in out.stdout.split()]
    if out.returncode or found != [REPO, REPO]:
        pytest.fail(
            f"unpadded-bert is not installed from {REPO} in {sys.prefix} (found {found or out.stderr.strip()[-200:]}): "
            "run `make setup`, or `pip install --no-deps --no-build-isolation -e .` in this venv",
            pytrace=False,
        )


def test_console_scripts_are_the_clis_main_functions():
    """Each ``[project.scripts]`` entry (bert-pretrain, ...) calls the ``main(argv=None)`` that
    ``python -m`` of its module runs."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    clis = {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in cli_files()}
    assert {"bert-pretrain", "bert-prepare", "bert-export"} <= set(scripts)
    for name, target in scripts.items():
        module, func = target.split(":")
        assert module in clis, f"{name}: {module} has no __main__ block"
        tree = ast.parse(clis[module].read_text())
        (main_block,) = [n for n in tree.body if _is_main_block(n)]
        calls = {n.id for n in ast.walk(main_block) if isinstance(n, ast.Name)}  # main() or cli_main(main)
        assert func in calls, f"{name}: {module}'s __main__ block does not run {func}"
        (define,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func]
        args = define.args
        assert len(args.args) == 1 and len(args.defaults) == 1, f"{name}: {func} must take argv=None"


def test_every_cli_shows_help_as_module_and_as_script(tmp_path, installed):
    files = cli_files()
    assert {"bench/throughput.py", "data/prepare/shards.py", "launch/summarize.py"} <= {
        f.relative_to(REPO).as_posix() for f in files
    }
    runs = []
    for f in files:
        module = ".".join(f.relative_to(REPO).with_suffix("").parts)
        runs += [["module", module], ["path", str(f)]]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(REPO)],
        input=json.dumps(runs),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(runs)
    failed = [
        f"{r['how']} {r['target']}: exit {r['code']!r}\n{r['output']}"
        for r in results
        if r["code"] not in (0, None) or not r["usage"]
    ]
    assert not failed, "\n\n".join(failed)


def sys_path_edits(source: str) -> list[int]:
    """Lines of ``source`` that change ``sys.path``: assigning it or an item or slice of it,
    deleting from it, calling a mutating method on it, or ``site.addsitedir``. Reading it is fine."""

    def is_sys_path(node: ast.AST) -> bool:
        while isinstance(node, ast.Subscript):
            node = node.value
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(is_sys_path(t) for t in targets):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in SYS_PATH_EDITS and is_sys_path(node.func.value):
                lines.append(node.lineno)
            elif node.func.attr == "addsitedir":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            lines.append(node.lineno)  # `from sys import path` then `path.insert(...)`
    return sorted(lines)


def test_no_project_module_edits_sys_path():
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {path.read_text().splitlines()[line - 1].strip()}"
        for path in project_files()
        for line in sys_path_edits(path.read_text())
    ]
    assert not offenders, "sys.path edits in the project (it is installed: `make setup`):\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "source, lines",
    [
        (
            'if __package__ in (None, ""):\n    sys.path[0] = str(Path(__file__).resolve().parents[1])\n',
            [2],
        ),
        ("import sys\nsys.path.insert(0, '.')\nsys.path.append('x')\n", [2, 3]),
        ("sys.path = ['.'] + sys.path\nsys.path[:0] = ['.']\nsys.path += ['y']\ndel sys.path[0]\n", [1, 2, 3, 4]),
        ("import site\nsite.addsitedir('/x')\nfrom sys import path\n", [2, 3]),
        ("import sys\nprint(sys.path)\nfirst = sys.path[0]\n# sys.path.insert(0, '.') in a comment\n", []),
    ],
)
def test_sys_path_check_catches_every_kind_of_edit(source, lines):
    assert sys_path_edits(source) == lines


def test_data_loading_bench_takes_the_sequence_length_from_the_data(tmp_path):
    # 512-token samples: padding to the bench's own --max-seq-length default (128) failed.
    write_shards(tmp_path / "train", [24, 24], seed=5, layout="varlength", max_seq_length=512)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.data_loading",
            "--data",
            str(tmp_path),
            "--skip-prepare",
            "--global-batch",
            "8",
            "--world-size",
            "2",
            "--steps",
            "3",
            "--no-dali",
            "--all-cores",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max_seq_length 512 (from the data)" in proc.stdout
    assert "loader + collate_padded" in proc.stdout


def test_data_loading_bench_without_shards_is_one_line(tmp_path, installed):
    (tmp_path / "train").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "data_loading.py"),
            "--data",
            str(tmp_path),
            "--skip-prepare",
            "--no-dali",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'train'}: no .hdf5 files in this directory"]


def test_overrides_may_come_anywhere_on_the_command_line():
    from run_pretraining import parse_args

    for argv in (
        ["--config", "c.yaml", "a.b=1", "--output-dir", "d", "x.y=2"],
        ["a.b=1", "--config", "c.yaml", "x.y=2", "--output-dir", "d"],
        ["--config", "c.yaml", "--output-dir", "d", "a.b=1", "x.y=2"],
    ):
        args = parse_args(argv)
        assert (args.config, args.output_dir, args.overrides) == ("c.yaml", "d", ["a.b=1", "x.y=2"]), argv
