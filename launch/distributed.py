"""Distributed initialisation from whatever launched this process: docs/clusters.md, "Distributed init".

:func:`init_distributed`, called once by ``run_pretraining.py`` before anything else is built, sets
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the launcher's variables
(:func:`detect_launcher`, the pure part) and creates the default process group, which always exists afterwards.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from common.errors import UserError

DEFAULT_TIMEOUT_S = 1800.0

# (launcher name, rank var, size var, local rank vars in order of preference)
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",)),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ("mpich", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK")),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",)),
)
MPI_LAUNCHERS = ("openmpi", "mpich")

_initialised: DistInfo | None = None  # what init_distributed set up in this process


class LaunchError(UserError):
    """The launch environment is inconsistent or incomplete; the message names the variable."""


@dataclass(frozen=True)
class LaunchEnv:
    """What the environment says about this process's place in the job."""

    launcher: str  # "torchrun" | "openmpi" | "mpich" | "slurm" | "single"
    rank: int
    world_size: int
    local_rank: int | None  # None: the launcher did not say (resolved via MPI)
    master_addr: str | None  # None: rank 0 picks it (MPI launchers only)
    master_port: int | None


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the initialised job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"environment variable {name}={value!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """First host of a Slurm host list: ``"gpu[03-05,9],login1"`` -> ``"gpu03"``."""
    prefix, ranges = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip()).groups()  # always matches
    if not (prefix or ranges):
        raise LaunchError(f"cannot read a host from Slurm node list {nodelist!r}")
    return prefix if ranges is None else prefix + re.split(r"[-,]", ranges, maxsplit=1)[0]


def detect_launcher(env: Mapping[str, str]) -> LaunchEnv:
    """Rank, world size, local rank and rendezvous from a launcher's environment; looks only at
    ``env``. :class:`LaunchError` names the variable when they are malformed or incomplete."""
    for name, rank_var, size_var, local_vars in _LAUNCHERS:
        if rank_var not in env:
            continue
        if size_var not in env:
            raise LaunchError(f"{rank_var} is set ({name} launch) but {size_var} is not")
        rank, world_size = _int_var(env, rank_var), _int_var(env, size_var)
        if world_size < 1 or not 0 <= rank < world_size:
            raise LaunchError(f"{rank_var}={rank} is not a rank of {size_var}={world_size}")
        local_rank = next((_int_var(env, v) for v in local_vars if v in env), 0 if world_size == 1 else None)
        if local_rank is not None and local_rank < 0:
            raise LaunchError(f"{local_vars[0]}={local_rank} is negative")

        addr = env.get("MASTER_ADDR") or None
        port = _int_var(env, "MASTER_PORT") if env.get("MASTER_PORT") else None
        if name == "torchrun":
            if local_rank is None:
                raise LaunchError("RANK and WORLD_SIZE are set but LOCAL_RANK is not")
            missing = [v for v, x in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if x is None]
            if missing and world_size > 1:
                raise LaunchError(f"RANK/WORLD_SIZE are set but {' and '.join(missing)} are not")
        elif name == "slurm":
            if local_rank is None:
                raise LaunchError("SLURM_PROCID is set but SLURM_LOCALID is not")
            if addr is None and world_size > 1:
                nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                if not nodelist:
                    raise LaunchError(
                        "Slurm launch without MASTER_ADDR and without SLURM_STEP_NODELIST / "
                        "SLURM_JOB_NODELIST to derive it from"
                    )
                addr = first_host(nodelist)
            if port is None and world_size > 1:
                job_id = _int_var(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
                port = 20000 + job_id % 20000  # same on every rank of the job
        return LaunchEnv(name, rank, world_size, local_rank, addr, port)
    return LaunchEnv("single", 0, 1, 0, None, None)


def chosen_interface(env: Mapping[str, str]) -> str | None:
    """The NIC the user chose for the ranks' traffic: GLOO_SOCKET_IFNAME, else
    NCCL_SOCKET_IFNAME (its first name; NCCL's ``^exclude`` lists choose none), else None."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = env.get(var, "").split(",")[0].strip()
        if value and not value.startswith("^"):
            return value.lstrip("=")
    return None


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface ``ifname`` (Linux: the SIOCGIFADDR ioctl)."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", ifname.encode()[:15]))
        except OSError as e:
            raise LaunchError(
                f"network interface {ifname!r} (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) "
                f"has no IPv4 address here: {e.strerror}"
            ) from e
    return socket.inet_ntoa(packed[20:24])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _resolve_with_mpi(launch: LaunchEnv) -> LaunchEnv:
    """Fill in what an MPI launcher did not say: rendezvous (from rank 0) and local rank."""
    try:
        from mpi4py import MPI  # imported here: it initialises MPI, which only MPI runs want
    except ImportError as e:
        raise LaunchError(
            f"launched by {launch.launcher} without MASTER_ADDR/MASTER_PORT (or local rank): "
            f"install mpi4py, or export them to every rank ({e})"
        ) from e
    comm = MPI.COMM_WORLD
    if comm.Get_rank() != launch.rank or comm.Get_size() != launch.world_size:
        raise LaunchError(
            f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}, the environment says "
            f"{launch.rank} of {launch.world_size}"
        )
    addr, port = launch.master_addr, launch.master_port
    if addr is None or port is None:
        if comm.Get_rank() == 0:
            # The store server runs on rank 0, so the address and the port are rank 0's. Its
            # hostname may resolve to another network (or 127.0.1.1) than the chosen NIC's.
            if addr is None:
                ifname = chosen_interface(os.environ)
                addr = interface_address(ifname) if ifname else socket.gethostname()
            port = port or _free_port()
        addr, port = comm.bcast((addr, port), root=0)
    if launch.local_rank is None:
        launch = replace(launch, local_rank=comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank())
    return replace(launch, master_addr=addr, master_port=port)


def _pick_device(local_rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    n = torch.cuda.device_count()
    # With one visible GPU per process (Slurm --gpus-per-task, CUDA_VISIBLE_DEVICES per
    # rank) the local rank indexes nodes' GPUs that this process cannot see: use cuda:0.
    index = 0 if n == 1 else local_rank
    if index >= n:
        raise LaunchError(f"local rank {local_rank} but only {n} CUDA devices are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistInfo:
    """Initialise the default process group from the launcher's environment.

    ``backend``: ``"nccl"``, ``"gloo"`` or None (NCCL when CUDA is available, else gloo; NCCL without
    CUDA is a LaunchError). ``timeout_s`` bounds the rendezvous and every collective. A second call
    (before :func:`destroy`) returns the same info.
    """
    global _initialised
    if dist.is_initialized():
        if _initialised is None:
            raise LaunchError("a process group exists that init_distributed did not create")
        return _initialised

    launch = detect_launcher(os.environ)
    unresolved = None in (launch.master_addr, launch.master_port, launch.local_rank)
    if launch.launcher in MPI_LAUNCHERS and launch.world_size > 1 and unresolved:
        launch = _resolve_with_mpi(launch)
    assert launch.local_rank is not None  # every launcher path above has set it

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise LaunchError(f"backend {backend!r}: choose 'nccl' or 'gloo'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise LaunchError("backend 'nccl' needs CUDA, which is not available here; use 'gloo'")
    device = _pick_device(launch.local_rank)

    os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank))
    timeout = timedelta(seconds=timeout_s)
    if launch.world_size == 1:  # no rendezvous: an in-memory store, no port opened
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        os.environ.update(MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port))
        dist.init_process_group(
            backend, init_method="env://", rank=launch.rank, world_size=launch.world_size, timeout=timeout
        )
    _initialised = DistInfo(launch.rank, launch.world_size, launch.local_rank, device, backend, launch.launcher)
    return _initialised


def destroy() -> None:
    """Tear down the default process group if one exists (safe to call twice)."""
    global _initialised
    if dist.is_initialized():
        dist.destroy_process_group()
    _initialised = None
