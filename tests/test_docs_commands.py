"""Every command the documentation shows names things that exist.

The README, CONTRIBUTING.md, docs/*.md and the READMEs next to the code show commands to
type. This test reads their shell code blocks (and inline code that starts like a command:
`python -m data.prepare.stats DIR`) and checks, for this project's own tools only:

- ``python -m pkg.mod`` / ``.venv/bin/python -m pkg.mod`` / ``python path/script.py`` /
  ``path/script.py`` (also after ``torchrun`` or ``mpirun`` and their own flags): the module
  or script exists, every ``--flag`` shown after it appears in its ``--help`` output, and,
  when that help lists configuration fields as ``section.field = ...`` lines, every
  ``section.field=value`` override shown names one of them;
- a console entry point of the package (``bert-prepare ...``, ``.venv/bin/bert-pretrain ...``,
  named in pyproject.toml's ``[project.scripts]``): checked as ``python -m`` of its module is;
  a command with the entry points' prefix (``bert-``) that is not one of them is an error;
- ``make TARGET``: the target is defined in the Makefile;
- any argument that is a path into the project with a code or config suffix
  (``launch/configs/cpu_demo.yaml``, ``bench/gpu_check.sh``, ``tests/x.py::test_y``) exists.

Commands of other tools (pip, pytest, git, docker, modules outside this repository) are
skipped, as are environment assignments before a command, line continuations, comments,
heredoc bodies, ``[optional]`` brackets and placeholders. All the ``--help`` outputs come from
one subprocess that runs each CLI in-process with runpy, in an empty working directory. A
failure names the file, the line, the command and what is missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]

# Fenced blocks in these languages are not shell; every other fence (bash, sh, console, none) is.
NOT_SHELL = {
    "python",
    "py",
    "pycon",
    "yaml",
    "yml",
    "json",
    "toml",
    "ini",
    "text",
    "txt",
    "diff",
    "output",
    "csv",
    "log",
    "html",
    "xml",
    "c",
    "cpp",
    "cuda",
}
PATH_SUFFIXES = (".py", ".sh", ".sub", ".yaml", ".yml")
LAUNCHERS = {"torchrun", "mpirun", "mpiexec", "srun"}
SEPARATORS = {";", "&&", "||", "|", "&", ";;", "|&"}
SKIP_DIRS = {"results", "node_modules", "build", "dist", "__pycache__"}
# Make's options that take the next word as their value.
MAKE_VALUE_FLAGS = {"-C", "-f", "-j", "-l", "-o", "-W", "-I", "--directory", "--file", "--jobs"}

ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OVERRIDE = re.compile(r"^([a-z_]\w*(?:\.[a-z_]\w*)+)=")
HELP_FIELD = re.compile(r"^\s+([a-z_]\w*(?:\.[a-z_]\w*)+) = ", re.M)
TRAILING_COMMENT = re.compile(r"\s+#.*$")
PLACEHOLDER = re.compile(r"(^|[./])[A-Z][A-Z_]+($|[./])")
PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
COMMAND_START = re.compile(
    r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:\S*/)?(?:python\d*(?:\.\d+)?\s|make\s|make$|"
    r"torchrun\s|mpirun\s|bash\s+\S+\.sh|\S+\.(?:py|sh|sub)(?:\s|$)|bert-[a-z-]+(?:\s|$))"
)
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


@dataclass
class Invocation:
    """One thing a documented command asks of the project."""

    doc: str  # file, relative to the repository
    line: int
    command: str
    kind: str  # "module", "script", "make", "path", "entry" (an entry point that does not exist)
    target: str
    flags: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)

    def where(self) -> str:
        shown = TRAILING_COMMENT.sub("", self.command)
        return f"{self.doc}:{self.line}: `{shown}`"


# --- finding the commands -------------------------------------------------------------------


def doc_files(repo: Path) -> list[Path]:
    """README.md, CONTRIBUTING.md and every other .md in the repository but the changelog
    (which records commands as they were), outside hidden folders and build outputs."""
    found = []
    for root, dirs, files in os.walk(repo):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        found += [Path(root) / f for f in sorted(files) if f.endswith(".md") and f != "CHANGELOG.md"]
    return found


def shell_snippets(text: str) -> list[tuple[int, str, bool]]:
    """(first line number, command text, in a code block) for each command in a markdown text:
    every logical line of a shell code block (continuations joined, heredoc bodies dropped,
    `$ ` prompts removed), and inline code spans elsewhere that start like a command."""
    snippets: list[tuple[int, str, bool]] = []
    lines = text.splitlines()
    fence, shell, prompts, pending, start, heredoc = None, False, False, "", 0, None
    for number, raw in enumerate(lines, 1):
        match = FENCE.match(raw)
        if fence is None:
            if match:
                fence, shell = match.group(1), match.group(2).lower() not in NOT_SHELL
                prompts = match.group(2).lower() in ("console", "shell-session")  # `$ command`, then output
                continue
            for span in INLINE_CODE.findall(raw):
                span = span.strip()
                # A command, or a lone file name; `file.py` alone is a reference, not a command.
                command = COMMAND_START.match(span) and (" " in span or not span.endswith(PATH_SUFFIXES))
                file_name = re.fullmatch(r"[\w./-]+(::[\w\[\]-]+)?", span)
                if command or file_name and span.split("::")[0].endswith(PATH_SUFFIXES):
                    snippets.append((number, span, False))
            continue
        if match and match.group(1).startswith(fence) and not match.group(2):
            if pending:
                snippets.append((start, pending, True))
            fence, pending, heredoc = None, "", None
            continue
        if not shell:
            continue
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        elif prompts and not pending:
            continue  # output of the command above
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        pending += line
        here = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", pending)
        if here:
            heredoc = here.group(1)
        if pending.strip():
            snippets.append((start, pending.strip(), True))
        pending = ""
    return snippets


def split_commands(text: str) -> list[list[str]]:
    """Simple commands of a shell line: words, split at ; && || | &, comments dropped."""
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:  # unbalanced quotes in an illustrative line: fall back to words
        words = text.split("#", 1)[0].split()
    commands, current = [], []
    for word in words:
        if word in SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    return [c for c in commands if c]


def _clean(word: str) -> str:
    """A word without the brackets and punctuation docs put around optional parts."""
    return word.strip("[](){},")


def _is_project_path(word: str, repo: Path) -> bool:
    word = word[2:] if word.startswith("./") else word
    first = word.split("/", 1)[0]
    return "/" in word and not word.startswith(("/", "~", "$", "..")) and (repo / first).is_dir()


def _tool_arguments(target_words: list[str]) -> tuple[list[str], list[str]]:
    flags, overrides = [], []
    for word in target_words:
        word = _clean(word)
        if word == "--":  # the end of the tool's options: what follows goes to the program it runs
            break
        if word.startswith("--") and len(word) > 2:
            flags.append(word.split("=", 1)[0])
        elif OVERRIDE.match(word):
            overrides.append(OVERRIDE.match(word).group(1))
    return flags, overrides


def _make_targets_named(words: list[str]) -> list[str]:
    """The targets of a `make ...` command line (options, their values and VAR=value skipped)."""
    if any(w in ("-C", "--directory", "-f", "--file") for w in words):
        return []  # another Makefile
    targets, skip_next = [], False
    for word in words[1:]:
        if skip_next:
            skip_next = False
        elif word in MAKE_VALUE_FLAGS:
            skip_next = True
        elif not word.startswith("-") and "=" not in word and _clean(word) == word:
            targets.append(word)
    return targets


def _find_tool(words: list[str]) -> tuple[str, str, int] | None:
    """(kind, target, index of the target word) of the tool a command runs: after a python
    interpreter and its options, after a launcher and its options, or the command itself when
    it is a script path; None for anything else."""
    for j, word in enumerate(words):
        base = word.rsplit("/", 1)[-1]
        if PYTHON.match(base):
            k = j + 1
            while k < len(words) and words[k].startswith("-") and words[k] != "-m":
                if words[k] == "-c":
                    return None
                k += 2 if words[k] in ("-X", "-W") else 1
            if k < len(words) and words[k] == "-m":
                return ("module", words[k + 1], k + 1) if k + 1 < len(words) else None
            return ("script", words[k], k) if k < len(words) else None
        if base in LAUNCHERS:
            for k in range(j + 1, len(words)):
                if words[k] in ("-m", "--module") and k + 1 < len(words) and base == "torchrun":
                    return "module", words[k + 1], k + 1
                if PYTHON.match(words[k].rsplit("/", 1)[-1]):
                    break  # the interpreter comes next: the outer loop finds it
                if words[k].endswith(".py"):
                    return "script", words[k], k
            continue
        if j == 0 and word.endswith(".py") and len(words) > 1:
            return "script", word, 0
    return None


@cache
def entry_points(repo: Path) -> dict[str, str]:
    """The package's console scripts (pyproject.toml's ``[project.scripts]``): name -> module."""
    path = repo / "pyproject.toml"
    scripts = tomllib.loads(path.read_text()).get("project", {}).get("scripts", {}) if path.is_file() else {}
    return {name: target.split(":", 1)[0] for name, target in scripts.items()}


def invocations(doc: str, line: int, text: str, repo: Path) -> list[Invocation]:
    """What one documented shell line asks of this project."""
    found: list[Invocation] = []
    scripts = entry_points(repo)
    prefixes = {name.split("-", 1)[0] + "-" for name in scripts if "-" in name}
    for words in split_commands(text):
        if words[0] == "cd":  # later relative paths are relative to somewhere else
            break
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if not words:
            continue
        if words[0].rsplit("/", 1)[-1] == "make":
            found += [Invocation(doc, line, text, "make", t) for t in _make_targets_named(words)]
            continue
        command = words[0].rsplit("/", 1)[-1]
        if command in scripts:
            found.append(Invocation(doc, line, text, "module", scripts[command], *_tool_arguments(words[1:])))
            continue
        if command.startswith(tuple(prefixes)) and not re.search(r"[A-Z]{2,}", command):  # bert-NAME: a pattern
            found.append(Invocation(doc, line, text, "entry", command))
            continue
        tool = _find_tool(words)
        if tool and PLACEHOLDER.search(tool[1]):
            tool = None  # `python -m bench.NAME`: a pattern, not a command
        if tool:
            kind, target, at = tool
            top = target.split(".")[0]
            ours = (
                ((repo / top).is_dir() or (repo / f"{top}.py").is_file())
                if kind == "module"
                else (
                    "$" not in target
                    and not target.startswith(("/", "~", ".."))
                    and ((repo / target).is_file() or "/" not in target or _is_project_path(target, repo))
                )
            )
            if ours:
                found.append(Invocation(doc, line, text, kind, target, *_tool_arguments(words[at + 1 :])))
        for j, word in enumerate(words):
            path = _clean(word).split("::", 1)[0].split("=", 1)[-1]
            if tool and j == tool[2]:
                continue  # checked above as the tool itself
            if (
                path.endswith(PATH_SUFFIXES)
                and _is_project_path(path, repo)
                and not re.search(r"[*?<>${]", path)
                and not PLACEHOLDER.search(path)
            ):
                found.append(Invocation(doc, line, text, "path", path))
    return found


def documented_invocations(repo: Path) -> list[Invocation]:
    found = []
    for path in doc_files(repo):
        doc = str(path.relative_to(repo))
        for line, text, _ in shell_snippets(path.read_text(encoding="utf-8")):
            found += invocations(doc, line, text, repo)
    return found


# --- checking them --------------------------------------------------------------------------


def make_targets(makefile: Path) -> set[str]:
    targets = set()
    for line in makefile.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_./%-][A-Za-z0-9_./% -]*?)\s*::?(?![=])", line)
        if match and not line.startswith("\t"):
            targets.update(match.group(1).split())
    return targets


def module_file(repo: Path, module: str) -> Path | None:
    base = repo.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


# A tool with subcommands (argparse's usage shows them as {up,down,...}) has the help of each
# subcommand appended to its own, so the subcommands' flags count as the tool's.
HELPER = r"""
import contextlib, io, json, re, runpy, sys

def run(kind, target, argv):
    out = io.StringIO()
    sys.argv = [target, *argv]
    ok, error = True, ""
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as e:
            ok = e.code in (0, None)
            error = "" if ok else f"exit status {e.code}"
        except BaseException as e:
            ok, error = False, f"{type(e).__name__}: {e}"
    return ok, error, out.getvalue()

results = {}
for kind, target in json.loads(sys.argv[1]):
    ok, error, text = run(kind, target, ["--help"])
    usage = text.split("\n\n", 1)[0]
    subcommands = re.search(r"\{([\w-]+(?:,[\w-]+)+)\}", usage) if ok else None
    for sub in subcommands.group(1).split(",") if subcommands else ():
        text += "\n" + run(kind, target, [sub, "--help"])[2]
    results[f"{kind}:{target}"] = {"ok": ok, "error": error, "text": text}
sys.stdout.write("\n@@HELP@@" + json.dumps(results))
"""


def help_texts(repo: Path, targets: list[tuple[str, str]], cwd: Path) -> dict[str, dict]:
    """--help of every (kind, target), run in one subprocess with the working directory cwd
    (a CLI that mistakes --help for an argument writes there, not into the repository)."""
    if not targets:
        return {}
    args = [(kind, target if kind == "module" else str(repo / target)) for kind, target in targets]
    env = {
        **os.environ,
        "PYTHONPATH": str(repo),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"),
        "COLUMNS": "200",
    }
    proc = subprocess.run(
        [sys.executable, "-c", HELPER, json.dumps(args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    if "@@HELP@@" not in proc.stdout:
        raise AssertionError(f"the --help runner died (exit {proc.returncode}): {proc.stderr[-2000:]}")
    raw = json.loads(proc.stdout.rsplit("@@HELP@@", 1)[1])
    return {f"{kind}:{target}": raw[f"{kind}:{path}"] for (kind, target), (_, path) in zip(targets, args)}


def problems(found: list[Invocation], repo: Path, helps: dict[str, dict]) -> list[str]:
    out = []
    targets = make_targets(repo / "Makefile") if (repo / "Makefile").is_file() else set()
    for inv in found:
        if inv.kind == "make" and inv.target not in targets:
            out.append(f"{inv.where()}: make target {inv.target!r} is not in the Makefile")
        elif inv.kind == "entry":
            out.append(f"{inv.where()}: {inv.target} is not a console script (pyproject.toml [project.scripts])")
        elif inv.kind == "path" and not (repo / inv.target).exists():
            out.append(f"{inv.where()}: {inv.target} does not exist")
        elif inv.kind == "module" and module_file(repo, inv.target) is None:
            out.append(f"{inv.where()}: module {inv.target} not found (no {inv.target.replace('.', '/')}.py)")
        elif inv.kind == "script" and not (repo / inv.target).is_file():
            out.append(f"{inv.where()}: script {inv.target} does not exist")
        elif inv.kind in ("module", "script") and (inv.flags or inv.overrides):
            result = helps[f"{inv.kind}:{inv.target}"]
            if not result["ok"]:
                out.append(f"{inv.where()}: `{inv.target} --help` failed: {result['error']}")
                continue
            text = result["text"]
            for flag in inv.flags:
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                    out.append(f"{inv.where()}: {inv.target} has no flag {flag} (not in its --help)")
            fields = set(HELP_FIELD.findall(text))
            for key in inv.overrides if fields else ():
                if key not in fields:
                    out.append(f"{inv.where()}: {inv.target} has no configuration field {key} (not in its --help)")
    return out


def check_docs(repo: Path, cwd: Path) -> tuple[list[Invocation], list[str]]:
    found = documented_invocations(repo)
    wanted = sorted(
        {
            (i.kind, i.target)
            for i in found
            if i.kind in ("module", "script")
            and (i.flags or i.overrides)
            and (module_file(repo, i.target) if i.kind == "module" else (repo / i.target).is_file())
        }
    )
    return found, problems(found, repo, help_texts(repo, wanted, cwd))


# --- tests ----------------------------------------------------------------------------------


def test_every_documented_command_exists_with_its_flags(tmp_path):
    found, errors = check_docs(REPO, tmp_path)
    kinds = {i.kind for i in found}
    assert {"module", "make"} <= kinds, f"no documented commands found in {[str(p) for p in doc_files(REPO)]}"
    assert not errors, "documented commands that do not work:\n" + "\n".join(errors)


SAMPLE = """\
# A page

Run `python -m tool.run DIR --fast` or `make build`; `--not-a-command 3` and `python -m` are prose.

```bash
# a comment with python -m tool.gone
FOO=1 .venv/bin/python -m tool.run --depth 3 \\
    --missing-flag x sec.known=1 sec.unknown=2   # trailing comment --ignored
torchrun --nproc_per_node 2 tool/script.py --fast [--spikes]
pip install -r requirements.txt --upgrade
python -m pytest tests/x -q --whatever
python -m tool.gone --x
make build test-nope VAR=1
cat > f <<'EOF'
python -m tool.inside_heredoc
EOF
tool/launch.sh 2 conf/a.yaml tool/missing.yaml
```

```python
python -m tool.not_shell
```

```console
$ python -m tool.run --fast
usage: python -m tool.gone --output-line
```
"""


def _sample_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "tool").mkdir(parents=True)
    (repo / "tool" / "__init__.py").write_text("")
    (repo / "tool" / "run.py").write_text(
        "import argparse\n"
        "p = argparse.ArgumentParser(epilog='fields:\\n  sec.known = 1\\n',\n"
        "                            formatter_class=argparse.RawDescriptionHelpFormatter)\n"
        "p.add_argument('--depth'); p.add_argument('--fast', action='store_true')\n"
        "p.add_argument('rest', nargs='*')\np.parse_args()\n"
    )
    (repo / "tool" / "script.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--fast')\np.parse_args()\n"
    )
    (repo / "tool" / "launch.sh").write_text("#!/bin/sh\n")
    (repo / "Makefile").write_text(".PHONY: build\nVAR ?= 0\nbuild: x\n\techo build\n")
    (repo / "docs").mkdir()
    (repo / "docs" / "page.md").write_text(SAMPLE)
    return repo


def test_the_checker_reads_console_entry_points(tmp_path):
    repo = _sample_repo(tmp_path)
    (repo / "pyproject.toml").write_text('[project]\nname = "t"\n[project.scripts]\nbert-run = "tool.run:main"\n')
    (repo / "docs" / "page.md").write_text(
        "Run `bert-run --fast` or `.venv/bin/bert-run --depth 2`.\n\n"
        "```bash\nbert-run --nope\nbert-gone --x\nbert-NAME --help\n```\n"
    )
    found, errors = check_docs(repo, tmp_path)
    assert {(i.kind, i.target, i.line) for i in found} == {
        ("module", "tool.run", 1),
        ("module", "tool.run", 4),
        ("entry", "bert-gone", 5),
    }
    assert errors == [
        "docs/page.md:4: `bert-run --nope`: tool.run has no flag --nope (not in its --help)",
        "docs/page.md:5: `bert-gone --x`: bert-gone is not a console script (pyproject.toml [project.scripts])",
    ]


def test_the_checker_finds_what_is_missing_and_skips_what_is_not_ours(tmp_path):
    repo = _sample_repo(tmp_path)
    found, errors = check_docs(repo, tmp_path)
    listed = {(i.kind, i.target, i.line) for i in found}
    assert ("module", "tool.run", 3) in listed and ("make", "build", 3) in listed  # inline code
    assert ("module", "tool.run", 7) in listed  # continuation joined, env assignment skipped
    assert ("script", "tool/script.py", 9) in listed  # after torchrun and its flags
    assert ("module", "tool.run", 25) in listed  # a console prompt; the output line after it is skipped
    assert not any("heredoc" in t or "not_shell" in t or t == "pytest" for _, t, _ in listed)
    assert sorted(errors) == sorted(
        [
            "docs/page.md:7: `FOO=1 .venv/bin/python -m tool.run --depth 3 --missing-flag x sec.known=1 "
            "sec.unknown=2`: tool.run has no flag --missing-flag (not in its --help)",
            "docs/page.md:7: `FOO=1 .venv/bin/python -m tool.run --depth 3 --missing-flag x sec.known=1 "
            "sec.unknown=2`: tool.run has no configuration field sec.unknown (not in its --help)",
            "docs/page.md:9: `torchrun --nproc_per_node 2 tool/script.py --fast [--spikes]`: "
            "tool/script.py has no flag --spikes (not in its --help)",
            "docs/page.md:12: `python -m tool.gone --x`: module tool.gone not found (no tool/gone.py)",
            "docs/page.md:13: `make build test-nope VAR=1`: make target 'test-nope' is not in the Makefile",
            "docs/page.md:17: `tool/launch.sh 2 conf/a.yaml tool/missing.yaml`: tool/missing.yaml does not exist",
        ]
    )
    assert list(tmp_path.glob("--help")) == []


def test_arguments_after_a_bare_double_dash_are_not_the_tools_flags():
    assert _tool_arguments(["--data", "d", "--", "--model", "tiny", "x.y=1"]) == (["--data"], [])
