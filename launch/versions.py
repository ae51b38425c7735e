"""The oldest torch, Triton, transformers and torchao the application runs on, as pyproject.toml
declares them (tests/test_versions.py keeps the two equal); ``too_old()`` is checked once at
start by run_pretraining.py. A package that is not installed is not checked here: the feature
that needs it names it (docs/kernels.md, "Versions")."""

from __future__ import annotations

from importlib import metadata

MINIMUM = {"torch": "2.10.0a0", "triton": "3.6", "transformers": "5.17", "torchao": "0.16"}
DISTRIBUTIONS = {"triton": ("triton", "pytorch-triton")}  # older NGC images name Triton so


def too_old() -> str | None:
    """One line naming the first installed package older than its minimum, else None."""
    from packaging.version import Version

    for name, oldest in MINIMUM.items():
        for dist in DISTRIBUTIONS.get(name, (name,)):
            try:
                have = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
            if Version(have) < Version(oldest):
                return f"{dist} {have} is older than {oldest}, the oldest this application supports (pyproject.toml)"
    return None
