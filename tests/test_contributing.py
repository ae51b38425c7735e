"""CONTRIBUTING's file map names every module, and the README's line count is true."""

from __future__ import annotations

import re

from tests.helpers import REPO

MAPPED = ("bert", "data", "kernels", "launch", "common", "tools")
APPLICATION = ("bert", "data", "kernels", "launch", "common")


def file_map(text: str) -> str:
    start = text.index("## Where the code lives")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def mapped_problems(root) -> list[str]:
    section = file_map((root / "CONTRIBUTING.md").read_text())
    packages = "|".join(MAPPED)
    named = set(re.findall(rf"`((?:{packages})/[\w/]+\.py)`", section))
    modules = {
        p.relative_to(root).as_posix()
        for package in MAPPED
        for p in (root / package).rglob("*.py")
        if p.name != "__init__.py"  # a package's own opening lines say what it holds
    }
    return [f"{m}: not in CONTRIBUTING's file map" for m in sorted(modules - named)] + [
        f"{m}: in CONTRIBUTING's file map but not in the tree" for m in sorted(named - modules)
    ]


def application_lines(root) -> int:
    files = [root / "run_pretraining.py"] + [p for d in APPLICATION for p in (root / d).rglob("*.py")]
    return sum(len(p.read_bytes().splitlines()) for p in files)


def test_file_map_names_every_module_and_no_missing_one():
    problems = mapped_problems(REPO)
    assert not problems, "\n".join(problems)


def test_file_map_check_catches_a_new_and_a_gone_module(tmp_path):
    for package in MAPPED:
        (tmp_path / package).mkdir()
    (tmp_path / "bert" / "model.py").write_text("x = 1\n")
    (tmp_path / "bert" / "__init__.py").write_text("")
    (tmp_path / "bert" / "newcomer.py").write_text("x = 1\n")
    (tmp_path / "CONTRIBUTING.md").write_text(
        "## Where the code lives\n\n| `bert/model.py`, `data/gone.py` | ... |\n\n## Habits\n`bert/newcomer.py`\n"
    )
    assert mapped_problems(tmp_path) == [
        "bert/newcomer.py: not in CONTRIBUTING's file map",
        "data/gone.py: in CONTRIBUTING's file map but not in the tree",
    ]


def test_readme_line_count_is_within_five_percent():
    claim = re.search(r"about\s+([\d,]+)\s+lines", (REPO / "README.md").read_text())
    assert claim, "README.md: no 'about N lines'"
    claimed, actual = int(claim.group(1).replace(",", "")), application_lines(REPO)
    assert abs(claimed - actual) <= 0.05 * actual, f"README.md says about {claimed:,} lines; wc -l gives {actual:,}"


def readme_tree(text: str) -> set[str]:
    """The paths the README's tree block names ("bert/", "  model/" under it -> "bert/model")."""
    section = text[text.index("## Where things are") :]
    block = section[section.index("```text\n") + 8 : section.index("\n```", section.index("```text"))]
    paths, parents = set(), []
    for line in block.splitlines():
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip(" "))) // 2
        parents[depth:] = [name.rstrip("/")]
        paths.add("/".join(parents))
    return paths


def tree_problems(root) -> list[str]:
    named = readme_tree((root / "README.md").read_text())
    packages = {p.parent.relative_to(root).as_posix() for top in APPLICATION for p in (root / top).rglob("__init__.py")}
    problems = [f"{p}/: a package the README's tree does not show" for p in sorted(packages - named)]
    return problems + [f"{p}: in the README's tree but not on disk" for p in sorted(named) if not (root / p).exists()]


def test_readme_tree_shows_every_package_and_nothing_gone():
    problems = tree_problems(REPO)
    assert not problems, "\n".join(problems)


def test_readme_tree_check_catches_a_new_and_a_gone_package(tmp_path):
    (tmp_path / "bert" / "model").mkdir(parents=True)
    (tmp_path / "bert" / "fresh").mkdir()
    for d in ("bert", "bert/model", "bert/fresh"):
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "README.md").write_text(
        "## Where things are\n\n```text\nbert/      the model\n  model/   the encoder\n  gone/    removed\n```\n"
    )
    assert tree_problems(tmp_path) == [
        "bert/fresh/: a package the README's tree does not show",
        "bert/gone: in the README's tree but not on disk",
    ]
