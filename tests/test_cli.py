"""Every command-line tool runs both ways: ``python -m package.module`` and ``python package/module.py``.

A CLI is any module of the project with an ``if __name__ == "__main__":`` block (found here,
so a new tool is covered without listing it). Run by path, Python puts the script's own
directory first on ``sys.path`` and the project is not importable (worse: ``bench/data.py``
once shadowed the ``data`` package). The one mechanism for that, in every CLI that imports
the project, is this bootstrap placed before its first project import:

    if __package__ in (None, ""):  # run by path: import the project from the repository root, as -m does
        sys.path[0] = str(Path(__file__).resolve().parents[1])

It replaces the script's directory by the repository root, exactly what ``-m`` gives, and
does nothing when the module is imported or run with ``-m``. No other ``sys.path`` edit is
allowed in the project's code (checked below).

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

from data.synthetic import write_shards

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "bert", "data", "kernels", "launch")
BOOTSTRAP = (
    'if __package__ in (None, ""):  # run by path: import the project from the repository root, as -m does\n'
    "    sys.path[0] = str(Path(__file__).resolve().parents[1])\n"
)


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
    project = ("bench", "bert", "data", "kernels", "launch", "run_pretraining")
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


def test_every_cli_shows_help_as_module_and_as_script(tmp_path):
    files = cli_files()
    assert {"bench/throughput.py", "data/prepare.py", "launch/summarize.py"} <= {
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


def test_sys_path_is_touched_only_by_the_script_bootstrap():
    offenders, clis = [], set(cli_files())
    for path in project_files():
        text = path.read_text()
        rest = text.replace(BOOTSTRAP, "", 1) if path in clis else text
        for line in rest.splitlines():
            if "sys.path" in line:
                offenders.append(f"{path.relative_to(REPO)}: {line.strip()}")
        if BOOTSTRAP in text:
            boot_at = text.index(BOOTSTRAP)
            tree = ast.parse(text)
            first_project_import = min(
                (
                    n.lineno
                    for n in tree.body
                    if isinstance(n, (ast.Import, ast.ImportFrom))
                    and (n.module if isinstance(n, ast.ImportFrom) else n.names[0].name or "").split(".")[0] in PACKAGES
                ),
                default=None,
            )
            if first_project_import is not None and text[:boot_at].count("\n") + 1 > first_project_import:
                offenders.append(f"{path.relative_to(REPO)}: the bootstrap comes after the first project import")
    assert not offenders, "sys.path edits outside the one script bootstrap:\n" + "\n".join(offenders)


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


def test_data_loading_bench_without_shards_is_one_line(tmp_path):
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
