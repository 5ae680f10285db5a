"""A real Slurm cluster for the tests, from Debian's packages (slurm-wlm, munge; .ci/run installs
them): munged with a key and a socket of its own, slurmctld on this machine, and one slurmd per
node, each inside the network namespace of a sandbox instance (`nsenter --net`, not `ip netns
exec`, which mounts a /sys without cgroups that slurmd fails on) with a copy of the config of its
own (pid file, spool, log: Debian's slurmd is not built for several per machine). The nodes share
this machine's filesystem: a path is on a "shared filesystem" for every node.

Two partitions over the same nodes: `main` (where the tests' jobs run, preemptible with requeue)
and `urgent` (a higher priority tier: a job there preempts one in main). RequeueExit=75: a job
that exits 75 (`relaunch run` after a stop with a verified save) is requeued. Everything is stopped
by the pids the daemons wrote, and the job steps left behind by their folder.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from e2e import wait_for
from relaunch.sandbox import Instance
from relaunch.sandbox.network import netns

KILL_WAIT = 20          # seconds between Slurm's SIGTERM and its SIGKILL (scancel, requeue)
GRACE_TIME = 20         # seconds a preempted job keeps after its SIGTERM


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Cluster:
    folder: Path
    conf: Path
    nodes: dict[str, Instance]
    pids: list[Path] = field(default_factory=list)     # pid files of the daemons, started in this order

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} -> exit {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def sbatch(self, script: Path, *options: str, env: dict[str, str] | None = None) -> str:
        """Submit; the job gets this environment (sbatch exports it), with `env` on top."""
        done = subprocess.run(["sbatch", "--parsable", *options, str(script)], capture_output=True, text=True,
                              env={**self.env, **(env or {})}, timeout=60)
        assert done.returncode == 0, f"sbatch -> exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job -o` as fields (JobState, Restarts, ExitCode, NodeList, Reason ...)."""
        text = self.run("scontrol", "show", "job", "-o", job).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_state(self, job: str, *states: str, timeout: float = 180) -> dict[str, str]:
        return wait_for(f"job {job} in {'/'.join(states)}",
                        lambda: (found := self.job(job)).get("JobState") in states and found,
                        timeout=timeout, explain=lambda: str(self.job(job)))

    def release(self, job: str) -> None:
        """A requeued job waits about two minutes (BeginTime): it may start at once."""
        self.run("scontrol", "update", f"JobId={job}", "StartTime=now")

    def requeued(self, job: str, restarts: int, timeout: float = 180) -> None:
        """Wait until the job is back in the queue after its `restarts`-th end, then release it until
        it starts (Slurm sets the requeue's BeginTime once the job's end is processed: a release
        before that is undone). Not within the second of that end: the nodes revoked the job's
        credential then, in whole seconds, and refuse a launch whose credential is no newer ("Job
        N already killed, do not launch batch job": the job FAILED at once, exit 1:0, under load);
        the two minutes of BeginTime are Slurm's own guard against that."""
        def started() -> bool:
            found = self.job(job)
            if int(found.get("Restarts") or 0) < restarts:
                return False
            if found.get("JobState") == "PENDING":
                if found.get("Reason") == "BeginTime" and time.time() >= _ended(found) + 2:
                    self.release(job)
                return False
            return found.get("JobState") in ("RUNNING", "COMPLETED", "FAILED")

        wait_for(f"job {job} requeued ({restarts} restart(s)) and started again", started, timeout=timeout,
                 explain=lambda: str(self.job(job)))

    def kill(self, job: str) -> list[int]:
        """`kill -9` of every process of the job (what a crash, the OOM killer or a lost node does;
        `scancel --signal=KILL` is a cancel, SIGTERM first). Found by the job's variables: the nodes
        share this machine's process table."""
        killed = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
                # slurmd hands a job its own copy of the config (slurm-NODE.conf, in this cluster's folder)
                if f"SLURM_JOB_ID={job}".encode() in env and any(
                        v.startswith(f"SLURM_CONF={self.folder}/".encode()) for v in env):
                    os.kill(int(proc.name), signal.SIGKILL)
                    killed.append(int(proc.name))
            except OSError:
                continue
        return killed

    def cancel_all(self) -> None:
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            for job in jobs:           # at once: a cancel's SIGTERM would have each save and copy first
                self.kill(job)
            self.run("scancel", *jobs, check=False)
            wait_for("every job to end", lambda: not self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip(),
                     timeout=KILL_WAIT + 60)

    def stop(self) -> None:
        try:
            self.cancel_all()
        finally:
            for pid_file in reversed(self.pids):
                _end(pid_file)
            _end_steps(self.folder)
            shutil.rmtree(self.folder, ignore_errors=True)


def _pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _end(pid_file: Path) -> None:
    pid = _pid(pid_file)
    if pid is None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _end_steps(folder: Path) -> None:
    """The slurmstepd processes of this cluster (their working folder is its log folder) that
    outlived their slurmd."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "comm").read_text().strip() != "slurmstepd":
                continue
            if not os.readlink(proc / "cwd").startswith(str(folder)):
                continue
            os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def _munge(folder: Path) -> tuple[Path, Path]:
    """munged as the munge user, with a key and a socket of this cluster's own."""
    munge = pwd.getpwnam("munge")
    keys, sock = folder / "munge", folder / "sock"
    for path, mode in ((keys, 0o700), (sock, 0o755)):
        path.mkdir(mode=mode)
        os.chown(path, munge.pw_uid, munge.pw_gid)
        path.chmod(mode)
    key = keys / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chown(key, munge.pw_uid, munge.pw_gid)
    key.chmod(0o400)
    socket_path, pid_file = sock / "munge.sock", sock / "munged.pid"
    subprocess.run(["runuser", "-u", "munge", "--", "munged", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={pid_file}", f"--log-file={keys / 'munged.log'}",
                    f"--seed-file={keys / 'munged.seed'}"], check=True, capture_output=True, timeout=30)
    return socket_path, pid_file


def start(nodes: dict[str, Instance], gateway: str) -> Cluster:
    """A cluster of `nodes` (name -> the sandbox instance it runs in); the controller on this machine,
    reached by the nodes at `gateway` (this machine's side of a node's link)."""
    folder = Path(tempfile.mkdtemp(prefix="relaunch-slurm-"))
    folder.chmod(0o755)                    # munged, as its own user, goes through it
    cluster = Cluster(folder, folder / "slurm.conf", nodes)
    try:
        socket_path, munge_pid = _munge(folder)
        cluster.pids.append(munge_pid)
        for sub in ("state", "log"):
            (folder / sub).mkdir()
        lines = [
            f"ClusterName=rl{folder.name[-6:].lower().replace('_', 'x')}",
            f"SlurmctldHost={socket.gethostname()}({gateway})",
            f"SlurmctldPort={free_port()}", "SlurmdPort=6818",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={socket_path}",
            "CredType=cred/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none",
            "JobRequeue=1", "RequeueExit=75", f"KillWait={KILL_WAIT}", "MinJobAge=3600", "ReturnToService=2",
            "SchedulerType=sched/backfill", "SchedulerParameters=bf_interval=1,sched_interval=2",
            "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            f"StateSaveLocation={folder / 'state'}", f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
            f"SlurmdSpoolDir={folder / 'spool'}", f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmdLogFile={folder / 'log' / 'slurmd.log'}",
        ]
        lines += [f"NodeName={name} NodeAddr={inst.address} CPUs=2 State=UNKNOWN" for name, inst in nodes.items()]
        names = ",".join(nodes)
        lines += [f"PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
                  f"GraceTime={GRACE_TIME}",
                  f"PartitionName=urgent Nodes={names} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF"]
        cluster.conf.write_text("\n".join(lines) + "\n")
        subprocess.run(["slurmctld", "-f", str(cluster.conf)], check=True, capture_output=True, timeout=60)
        cluster.pids.append(folder / "slurmctld.pid")
        for name, inst in nodes.items():
            own = folder / f"slurm-{name}.conf"
            spool = folder / f"spool-{name}"
            spool.mkdir()
            text = cluster.conf.read_text()
            for key, value in (("SlurmdSpoolDir", spool), ("SlurmdPidFile", folder / f"slurmd-{name}.pid"),
                               ("SlurmdLogFile", folder / "log" / f"slurmd-{name}.log")):
                text = re.sub(rf"^{key}=.*$", f"{key}={value}", text, flags=re.M)
            own.write_text(text)
            subprocess.run(["nsenter", f"--net=/run/netns/{netns(inst.name)}", "slurmd", "-N", name, "-f", str(own)],
                           check=True, capture_output=True, timeout=60)
            cluster.pids.append(folder / f"slurmd-{name}.pid")
        wait_for("every node idle", lambda: set(cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False)
                                                  .stdout.split()) == {"idle"}, timeout=120,
                 explain=lambda: cluster.run("sinfo", "-N", check=False).stdout)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def _ended(job: dict[str, str]) -> float:
    """When the job's last run ended, as this machine's clock reads it (scontrol prints local time):
    a requeue submits the job again once that end is processed (its EndTime, while it waits, is an
    estimate of the next end)."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(job.get("SubmitTime", "")).timestamp()
    except ValueError:                          # "Unknown"
        return time.time()
