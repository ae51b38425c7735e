"""The declared minimum versions: pyproject.toml and launch/versions.py agree, and an older
installed package is one line at start."""

from importlib import metadata

import tomllib

from launch import versions
from tests.helpers import REPO


def test_pyproject_declares_the_minimums_launch_checks():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["fp8"]
    assert sorted(declared) == sorted(f"{name}>={v}" for name, v in versions.MINIMUM.items())


def test_an_older_package_is_one_line_naming_it(monkeypatch):
    real = metadata.version
    assert versions.too_old() is None  # this machine's
    monkeypatch.setattr(metadata, "version", lambda d: "2.9.1" if d == "torch" else real(d))
    line = "torch 2.9.1 is older than 2.10.0a0, the oldest this application supports (pyproject.toml)"
    assert versions.too_old() == line
    monkeypatch.setattr(metadata, "version", lambda d: "2.10.0a0+b4e4ee81d3" if d == "torch" else real(d))
    assert versions.too_old() is None  # NGC 25.12's
