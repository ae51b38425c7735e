"""MLPerf's system description, ``systems/<system_name>.json``, filled in from this machine.

``python -m launch.system_desc --output FILE.json [--nodes N] [--field key=value ...]`` writes
every field ``mlperf_logging.system_desc_checker`` requires, from what the machine tells
(``nvidia-smi``, ``lscpu``, ``/proc``, the OS, the installed versions, the container image in
``CONT`` or ``CONTAINER_IMAGE``). What it cannot know stays ``""`` for ``--field``, which also
overrides anything measured. docs/mlperf.md, "Reproducing a closed-division result", step 7.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from common.errors import UserError
from common.files import write_text

# The fields the 5.0.0 package checker requires, in the order MLPerf's own files list them.
FIELDS = tuple(
    """
    submitter division status system_name number_of_nodes
    host_processors_per_node host_processor_model_name host_processor_core_count host_processor_vcpu_count
    host_processor_frequency host_processor_caches host_processor_interconnect host_memory_capacity
    host_storage_type host_storage_capacity host_networking host_networking_topology host_memory_configuration
    accelerators_per_node accelerator_model_name accelerator_host_interconnect accelerator_frequency
    accelerator_on-chip_memories accelerator_memory_configuration accelerator_memory_capacity
    accelerator_interconnect accelerator_interconnect_topology
    cooling hw_notes framework other_software_stack operating_system sw_notes
    """.split()
)
# system_desc_checker (training, ruleset >= 4.0): the only values "status" may take.
STATUSES = ("Available on-premise", "Available cloud", "Research, Development, or Internal (RDI)", "Preview")
DIVISIONS = ("closed", "open")


class SystemDescError(UserError):
    """Bad input for a system description; the message names the field."""


def _run(*cmd: str) -> str:
    """stdout of a command, "" when it is missing or fails (a CPU machine has no nvidia-smi)."""
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.0f} GB"


def gpu_fields() -> dict[str, Any]:
    query = "name,memory.total,clocks.max.sm,pcie.link.gen.max,pcie.link.width.max"
    table = _run("nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits")
    rows = [[c.strip() for c in line.split(",")] for line in table.splitlines() if line.strip()]
    if not rows:
        return {"accelerators_per_node": 0}
    name, mem_mib, sm_mhz, gen, width = rows[0]
    fields: dict[str, Any] = {
        "accelerators_per_node": len(rows),
        "accelerator_model_name": name,
        "accelerator_memory_capacity": f"{float(mem_mib) / 1024:.0f} GB",
        "accelerator_frequency": f"{sm_mhz} MHz" if sm_mhz.isdigit() else "",
        "accelerator_host_interconnect": f"PCIe Gen{gen} x{width}" if gen.isdigit() else "",
        "accelerator_memory_configuration": "HBM" if re.search(r"[AHB]\d{3}|GH200|GB200", name) else "",
    }
    if speeds := re.findall(r"Link \d+: ([\d.]+) GB/s", _run("nvidia-smi", "nvlink", "--status", "-i", "0")):
        total = sum(float(s) for s in speeds)
        fields["accelerator_interconnect"] = f"{len(speeds)}x NVLink, {total:.0f} GB/s per GPU"
        topo = _run("nvidia-smi", "topo", "-m")
        fields["accelerator_interconnect_topology"] = "NVSwitch" if "NV" in topo and len(rows) > 2 else "NVLink"
    else:
        fields["accelerator_interconnect"] = fields["accelerator_interconnect_topology"] = "PCIe"
    return fields


def cpu_fields() -> dict[str, Any]:
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in _run("lscpu").splitlines())}
    fields: dict[str, Any] = {"host_processor_vcpu_count": os.cpu_count() or ""}
    if not info:
        fields["host_processor_model_name"] = platform.processor() or platform.machine()
        return fields
    fields.update(
        host_processors_per_node=int(info.get("Socket(s)", "1") or 1),
        host_processor_model_name=info.get("Model name", ""),
        host_processor_core_count=int(info.get("Core(s) per socket", "0") or 0) or "",
        host_processor_vcpu_count=int(info.get("CPU(s)", fields["host_processor_vcpu_count"]) or 0),
    )
    if mhz := info.get("CPU max MHz") or info.get("CPU MHz"):
        fields["host_processor_frequency"] = f"{float(mhz):.0f} MHz"
    caches = [f"{name} {info[f'{name} cache']}" for name in ("L1d", "L1i", "L2", "L3") if info.get(f"{name} cache")]
    fields["host_processor_caches"] = ", ".join(caches)
    return fields


def host_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: the line is not there
        kib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        fields["host_memory_capacity"] = _gib(kib * 1024)
    with contextlib.suppress(OSError):
        fields["host_storage_capacity"] = _gib(shutil.disk_usage(os.getcwd()).total)
    os_name = platform.system()
    with contextlib.suppress(OSError, AttributeError):
        os_name = re.search(r'^PRETTY_NAME="?([^"\n]*)', Path("/etc/os-release").read_text(), re.MULTILINE).group(1)
    fields["operating_system"] = f"{os_name} (kernel {platform.release()})"
    return fields


def software_fields() -> dict[str, Any]:
    import torch

    parts = [f"Python {platform.python_version()}"]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    if torch.backends.cudnn.is_available():
        parts.append(f"cuDNN {torch.backends.cudnn.version()}")
    with contextlib.suppress(AttributeError, RuntimeError):
        nccl = torch.cuda.nccl.version()
        parts.append("NCCL " + (".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
    for dist, name in (
        ("triton", "Triton"),
        ("nvidia-dali-cuda120", "DALI"),
        ("nvidia-dali-cuda110", "DALI"),
        ("mlperf-logging", "mlperf-logging"),
    ):
        with contextlib.suppress(PackageNotFoundError):
            parts.append(f"{name} {version(dist)}")
    if image := os.environ.get("CONT") or os.environ.get("CONTAINER_IMAGE"):
        parts.append(f"container {image}")
    elif Path("/.dockerenv").exists():
        parts.append("container (image not named: set CONT)")
    return {"framework": f"PyTorch {torch.__version__}", "other_software_stack": ", ".join(parts)}


def machine_description(*, nodes: int = 1, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every field of ``FIELDS``: measured here, then ``fields`` on top; checked by ``check``."""
    desc: dict[str, Any] = {name: "" for name in FIELDS}
    desc.update(division="closed", status=STATUSES[0], number_of_nodes=nodes)
    for part in (cpu_fields, host_fields, gpu_fields, software_fields):
        desc.update({k: v for k, v in part().items() if str(v)})
    desc.update(fields or {})
    # The checker joins some fields into a CSV line: every value is a string, as in MLPerf's files.
    desc = {k: str(v) for k, v in desc.items()}
    check(desc)
    return desc


def check(desc: dict[str, Any]) -> None:
    """What the 5.0.0 checker would refuse, as a SystemDescError naming the field."""
    if unknown := sorted(set(desc) - set(FIELDS)):
        raise SystemDescError(f"{unknown[0]}: not a system-description field (valid: {', '.join(FIELDS)})")
    if missing := [name for name in FIELDS if name not in desc]:
        raise SystemDescError(f"{missing[0]}: missing")
    if desc["status"] not in STATUSES:
        raise SystemDescError(
            f"status: {desc['status']!r} is not one the 5.0.0 checker accepts: {', '.join(repr(s) for s in STATUSES)}"
        )
    if desc["division"] not in DIVISIONS:
        raise SystemDescError(f"division: {desc['division']!r} is not one of {', '.join(DIVISIONS)}")
    for name in ("submitter", "system_name"):
        if not str(desc[name]).strip():
            raise SystemDescError(f"{name}: empty; give it with --field {name}=...")


def write(path: str | os.PathLike, desc: dict[str, Any]) -> None:
    """Writes ``desc`` as JSON, published whole (common.files)."""
    write_text(path, json.dumps(desc, indent=4) + "\n")


def parse_fields(items: list[str]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemDescError(f"--field {item!r}: expected key=value")
        if key not in FIELDS:
            raise SystemDescError(f"--field {key}: not a system-description field (valid: {', '.join(FIELDS)})")
        fields[key] = value
    return fields


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.system_desc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, help="the JSON file to write (systems/<system_name>.json)")
    ap.add_argument("--nodes", type=int, default=1, help="number_of_nodes (default 1)")
    ap.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="key=value",
        help="set a field (submitter, system_name and division at least); repeatable",
    )
    args = ap.parse_args(argv)
    try:
        if args.nodes < 1:
            raise SystemDescError(f"--nodes: must be >= 1, got {args.nodes}")
        desc = machine_description(nodes=args.nodes, fields=parse_fields(args.field))
        write(args.output, desc)
    except SystemDescError as e:
        print(f"system_desc: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"system_desc: {e.filename or args.output}: {e.strerror}", file=sys.stderr)
        return 2
    empty = [k for k, v in desc.items() if not v]
    print(f"wrote {args.output}" + (f"; left empty for you to fill in: {', '.join(empty)}" if empty else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
