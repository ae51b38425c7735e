"""Names and helpers shared by the cluster tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import os

from launch.netns_cluster import Cluster
from tests.faults.common import Job, clean_env, run_args
from tests.test_trainer import ROOT

NAME = "bct"  # prefix of the test cluster's namespaces (`python -m launch.netns_cluster` uses bcl)
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
            self.cluster.unshape(host)
