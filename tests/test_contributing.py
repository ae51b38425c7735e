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
        if p.name != "__init__.py" or p.read_text().strip()
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
        "## Where the code lives\n\n| `bert/model/pretraining.py`, `data/gone.py` | ... |\n\n"
        "## Habits\n`bert/newcomer.py`\n"
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
