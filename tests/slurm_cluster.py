"""A one-node SLURM cluster on this machine, for the tests that submit the real batch scripts.

Debian's `slurmctld`, `slurmd` and `munge` packages, run as root from a private folder: its own slurm.conf (found by
every client through `SLURM_CONF`), ports, state, spool and logs, so nothing of a system-wide install is touched.
`JobRequeue=1` as on most clusters; the node offers this machine's CPUs (select/cons_tres, no GPUs).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sacct")


def missing() -> str | None:
    """Why no cluster can be started here, or None when it can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "the SLURM daemons run as root"
    absent = [name for name in (*DAEMONS, *CLIENTS[:4]) if shutil.which(name) is None
              and not Path("/usr/sbin", name).exists()]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing; apt-get install slurmctld slurmd munge)"
    if not Path("/etc/munge/munge.key").is_file():
        return "munge has no key (/etc/munge/munge.key)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _daemon(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class Cluster:
    """`with Cluster(folder) as cluster:` starts munged (if none runs), slurmctld and slurmd; `cluster.env` is the
    environment for the clients; leaving the block stops the daemons this started."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.host = socket.gethostname().split(".")[0]
        self.started: list[subprocess.Popen] = []
        self.conf = self.folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        ctld_port, slurmd_port = _free_ports(2)
        for sub in ("state", "spool", "munge"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        f = self.folder
        self.conf.write_text("\n".join([
            "ClusterName=imba-test", f"SlurmctldHost={self.host}", "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}", "AuthType=auth/munge",
            f"StateSaveLocation={f / 'state'}", f"SlurmdSpoolDir={f / 'spool'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}", f"SlurmdPidFile={f / 'slurmd.pid'}",
            f"SlurmctldLogFile={f / 'slurmctld.log'}", f"SlurmdLogFile={f / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobRequeue=1", "ReturnToService=2", "KillWait=10", "MinJobAge=600",
            f"NodeName={self.host} CPUs={os.cpu_count()} State=UNKNOWN",
            f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")

    def __enter__(self) -> "Cluster":
        self.write_conf()
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            socket_dir = Path("/run/munge")
            socket_dir.mkdir(parents=True, exist_ok=True)
            subprocess.run([_daemon("munged"), "--force"], check=True, capture_output=True)
        for name in ("slurmctld", "slurmd"):
            self.started.append(subprocess.Popen([_daemon(name), "-D", "-f", str(self.conf)], env=self.env,
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if state.returncode == 0 and state.stdout.strip() in ("idle", "mixed", "allocated"):
                return self
            if any(p.poll() is not None for p in self.started):
                break
            time.sleep(0.5)
        logs = "".join(p.read_text()[-1500:] for p in self.folder.glob("*.log"))
        self.__exit__(None, None, None)
        raise RuntimeError(f"the one-node SLURM cluster did not come up:\n{logs}")

    def __exit__(self, *exc) -> None:
        for proc in self.started:
            proc.terminate()
        for proc in self.started:
            try:
                proc.wait(timeout=120)  # a daemon that ignores SIGTERM is killed below
            except subprocess.TimeoutExpired:
                proc.kill()

    def run(self, *cmd: str, check: bool = True) -> str:
        # a guard against a hung SLURM command; subprocess's TimeoutExpired says it timed out
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=300)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
        return proc.stdout

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-o", "%T").strip()

    def job_state(self, job_id: str) -> str:
        """The job's state as `scontrol show job` gives it (PENDING, RUNNING, COMPLETED, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id)
        return next(f.split("=", 1)[1] for f in out.split() if f.startswith("JobState="))

    def job_field(self, job_id: str, field: str) -> str:
        out = self.run("scontrol", "-o", "show", "job", job_id)
        return next(f.split("=", 1)[1] for f in out.split() if f.startswith(field + "="))
