"""Names and helpers shared by the cluster tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import time

from tests.cluster.netns_cluster import Cluster
from tests.faults.common import ROOT, Job, clean_env, run_args

NAME = "bct"  # prefix of the test cluster's namespaces (`python -m tests.cluster.netns_cluster` uses bcl)
SUBNET = "10.231.7"
STEPS = ("train.max_steps=8", "checkpoint.interval_steps=3", "data.rebalance=balanced")
CONFIG = os.path.join(ROOT, "launch", "configs", "cpu_demo.yaml")
LAUNCH = os.path.join(ROOT, "launch")


def train_args(dataset, *extra) -> list[str]:
    """The tiny run's overrides (fp32, dropout off, 8 steps, a checkpoint every 3) plus ``extra``."""
    return run_args(dataset, *STEPS, *extra)


class HostJobs:
    """Start commands on cluster hosts; every process of the cluster is killed at the end."""

    def __init__(self, cluster: Cluster, log_dir):
        self.cluster, self.log_dir, self.jobs = cluster, str(log_dir), []

    def start(self, host: int, argv: list[str], log: str, **env) -> Job:
        job = Job(self.cluster.command(host, argv), os.path.join(self.log_dir, log), clean_env(**env))
        self.jobs.append(job)
        return job

    def cleanup(self) -> None:
        for job in self.jobs:
            job.kill()
        for host in range(self.cluster.hosts):
            self.cluster.kill_host(host)
            self.cluster.set_link(host, True)
        self.cluster.unshape()


def torchrun_on(host_jobs: HostJobs, host: int, nnodes: str, out, dataset, *extra, **env) -> Job:
    """launch/run_torchrun.sh NNODES 2 on ``host``; the rendezvous is on host 0, the NIC cl0."""
    c = host_jobs.cluster
    return host_jobs.start(
        host,
        [os.path.join(LAUNCH, "run_torchrun.sh"), nnodes, "2", CONFIG, str(out), *train_args(dataset, *extra)],
        f"host{host}-{len(host_jobs.jobs)}.log",
        MASTER_ADDR=c.address(0),
        MASTER_PORT=29500,
        SOCKET_IFNAME="cl0",
        **env,
    )


SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")


class SlurmCluster:
    """munged, slurmctld on host 0 and slurmd on every host, configured in ``directory``."""

    def __init__(self, cluster: Cluster, directory: str):
        self.cluster, self.dir = cluster, directory
        self.conf = os.path.join(directory, "slurm.conf")
        self.jobs: list[Job] = []

    def env(self, **extra) -> dict:
        return clean_env(SLURM_CONF=self.conf, **extra)

    def write_config(self) -> None:
        d, c = self.dir, self.cluster
        for sub in ["ctld", *(f"spool-{h}" for h in c.hostnames)]:
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        nodes = "".join(
            f"NodeName={c.hostname(i)} NodeAddr={c.address(i)} CPUs=2 State=UNKNOWN\n" for i in range(c.hosts)
        )
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName={c.name}
SlurmctldHost={c.hostname(0)}({c.address(0)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# The nodes declare 2 CPUs whatever the machine has.
SlurmdParameters=config_overrides
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def start(self, timeout: float = 60) -> None:
        self.write_config()
        d, c = self.dir, self.cluster

        def daemon(host: int, argv: list[str], log: str) -> None:
            self.jobs.append(Job(c.command(host, argv), os.path.join(d, log), self.env()))

        daemon(
            0,
            [
                "munged",
                "-F",
                "--force",
                f"--key-file={d}/munge.key",
                f"--socket={d}/munge.socket",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log",
                f"--seed-file={d}/munged.seed",
            ],
            "munged.out",
        )
        deadline = time.monotonic() + timeout
        while not os.path.exists(f"{d}/munge.socket"):
            if time.monotonic() > deadline or self.jobs[0].proc.poll() is not None:
                raise RuntimeError(f"munged did not start:\n{self.jobs[0].output()[-2000:]}")
            time.sleep(0.1)
        daemon(0, ["slurmctld", "-D", "-f", self.conf], "slurmctld.out")
        for i in range(c.hosts):
            daemon(i, ["slurmd", "-D", "-f", self.conf, "-N", c.hostname(i)], f"slurmd{i}.out")
        while True:
            done = subprocess.run(
                c.command(0, ["sinfo", "-h", "-o", "%T %D"]),
                env=self.env(),
                check=False,
                capture_output=True,
                text=True,
            )
            if done.stdout.split() == ["idle", str(c.hosts)]:
                return
            if time.monotonic() > deadline or any(j.proc.poll() is not None for j in self.jobs):
                raise RuntimeError(
                    f"Slurm did not come up (sinfo: {done.stdout.strip()} {done.stderr.strip()}):\n"
                    + "\n".join(j.output()[-1500:] for j in self.jobs)
                )
            time.sleep(0.3)

    def stop(self) -> None:
        for job in self.jobs:
            job.kill()
        for host in range(self.cluster.hosts):
            self.cluster.kill_host(host)
