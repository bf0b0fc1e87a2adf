"""A real Slurm on this host for the slurm tier: munged, slurmctld and two slurmd (nodes n1, n2).

Everything lives in a private directory (key, sockets, state, spool, logs, ``slurm.conf``) on
ports picked free on loopback, and every daemon runs in the foreground as a child of the test
process, so stopping is terminating them: nothing is left behind and the host's own
``/etc/slurm`` and ``/etc/munge`` are never read or written. Two ``slurmd -N`` on one host,
each with its own port, make a two-node cluster (Slurm's multiple-slurmd mode, which Debian's
build allows). :func:`unavailable` says why the daemons cannot start here, for the skip.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "munge", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
NODES = ("n1", "n2")
NO_SLURM = "n/a: no slurm"
PR_SET_PDEATHSIG = 1

SLURM_CONF = """\
ClusterName=harness-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=30
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName=test Nodes={node_list} Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes={node_list} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""
"""Jobs run in ``test``; a job in ``urgent`` preempts them, and a preempted job is requeued."""
NODE_LINE = "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN"


def unavailable() -> str | None:
    """Why a private Slurm cannot start on this machine (None: it can)."""
    missing = [t for t in (*DAEMONS, *CLIENTS) if shutil.which(t) is None]
    if missing:
        return f"{NO_SLURM}: {', '.join(missing)} not on PATH (make setup-slurm installs Slurm and munge)"
    if os.geteuid() != 0:
        return f"{NO_SLURM}: slurmd must run as root to start jobs, and this test runs as uid {os.geteuid()}"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SlurmCluster:
    """A started private cluster; ``env`` is what its client commands and jobs run with."""

    root: Path
    env: dict[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *argv: str, timeout: float = 60, check: bool = True,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``argv`` with the cluster's environment (and ``extra_env``: sbatch hands a job the submitting one)."""
        done = subprocess.run(list(argv), env={**self.env, **(extra_env or {})}, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}\n{self.logs()}")
        return done

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``'s fields (JobState, Restarts, ExitCode, ...)."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_job(self, job_id: str, ready: Callable[[dict[str, str]], bool], what: str,
                 timeout: float) -> dict[str, str]:
        """The job's fields once ``ready`` holds for them (or fail, naming ``what``, with the daemons' logs)."""
        deadline = time.monotonic() + timeout
        while not ready(fields := self.job(job_id)):
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: not {what} after {timeout:.0f} s (JobState="
                                     f"{fields.get('JobState')}, Restarts={fields.get('Restarts')})\n{self.logs()}")
            time.sleep(0.5)
        return fields

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """The job's fields once its state is one of ``states``."""
        return self.wait_job(job_id, lambda f: f.get("JobState") in states, f"in one of {states}", timeout)

    def wait_restarted(self, job_id: str, restarts: int, timeout: float) -> dict[str, str]:
        """The job's fields once Slurm counts ``restarts`` requeues of it (in whatever state it is then)."""
        return self.wait_job(job_id, lambda f: f.get("Restarts") == str(restarts), f"requeued {restarts} times",
                             timeout)

    def release(self, job_id: str, timeout: float = 120) -> None:
        """Start a requeued job now, not after Slurm's hold of a requeued job (BeginTime, up to
        now + 120 s), as an admin may; a job that has started already needs nothing.

        A job requeued from its own batch script reads COMPLETING, COMPLETED or CANCELLED until its
        epilog ends (over 15 s once in CI, under load), and refuses the update until then: the update
        waits for PENDING (or RUNNING: started already) and is retried while the job stays pending."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.wait_job(job_id, lambda f: f.get("JobState") in ("PENDING", "RUNNING"),
                                  "pending again or running", max(deadline - time.monotonic(), 1)).get("JobState")
            if state == "RUNNING":
                return
            done = self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"scontrol update JobId={job_id} StartTime=now: {done.stderr.strip()}")
            time.sleep(0.5)

    def logs(self, lines: int = 15) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel every job, then end the daemons (slurmd, slurmctld, munged last)."""
        if self.daemons and all(p.poll() is None for p in self.daemons):  # else scancel would retry for minutes
            try:
                self.run("scancel", "--partition", "test", check=False, timeout=30)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and self.run("squeue", "-h", check=False, timeout=30).stdout.strip():
                    time.sleep(1.0)
            except subprocess.TimeoutExpired as e:
                print(f"slurm fixture: {e.cmd[0]} gave no answer in {e.timeout:.0f} s; stopping the daemons anyway",
                      file=sys.stderr)
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster(job_env: dict[str, str], start_timeout_s: float = 90) -> SlurmCluster:
    """munged, slurmctld and slurmd n1 and n2, in a new private directory; returns once both nodes
    are idle. ``job_env`` is the environment the client commands (and so the jobs) get."""
    root = Path(tempfile.mkdtemp(prefix="harness-slurm-", dir="/tmp"))
    root.chmod(0o755)  # munged wants its socket's directory searchable by all
    for sub, mode in (("munge", 0o700), ("run", 0o755), ("state", 0o700), ("spool", 0o755), ("log", 0o755)):
        (root / sub).mkdir(mode=mode)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge_socket = root / "run" / "munge.sock"
    host = socket.gethostname()
    cpus = os.cpu_count() or 1
    nodes = "\n".join(NODE_LINE.format(name=n, host=host, port=_free_port(), cpus=cpus) for n in NODES)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, ctld_port=_free_port(), munge_socket=munge_socket, root=root,
                                      nodes=nodes, node_list=",".join(NODES)))
    env = {**job_env, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(root, env)
    try:
        _start(cluster, ["munged", "--foreground", f"--key-file={key}", f"--socket={munge_socket}",
                         f"--pid-file={root / 'run' / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
                         f"--seed-file={root / 'munge' / 'seed'}"])
        _wait(lambda: munge_socket.exists(), 20, "munged's socket", cluster)
        _start(cluster, ["slurmctld", "-D", "-f", str(conf)])
        for name in NODES:
            _start(cluster, ["slurmd", "-D", "-N", name, "-f", str(conf)])
        _wait(lambda: _idle(cluster) == set(NODES), start_timeout_s, f"nodes {', '.join(NODES)} idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM when the process that started it dies, however it dies
    (a killed pytest leaves no daemon behind). Linux's prctl(PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _start(cluster: SlurmCluster, argv: list[str]) -> None:
    log = open(cluster.root / "log" / f"{argv[0]}-{len(cluster.daemons)}.stdout.log", "w")
    cluster.daemons.append(subprocess.Popen(argv, env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
    log.close()  # the child holds its own copy


def _idle(cluster: SlurmCluster) -> set[str]:
    done = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=20)
    return {name for name, state in (line.split() for line in done.stdout.splitlines() if line.strip())
            if state == "idle"}


def _wait(ready, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [p.args[0] for p in cluster.daemons if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(dead)} exited" if dead else f"not after {timeout:.0f} s"
            raise RuntimeError(f"private Slurm did not start ({what}: {why})\n{cluster.logs()}")
        time.sleep(0.5)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":  # python -m tests.slurm.cluster: start one, hold it until Ctrl-C or SIGTERM
    reason = unavailable()
    if reason:
        sys.exit(reason)
    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started with `&` (SIGINT ignored)
        signal.signal(sig, _interrupt)
    c = start_cluster(dict(os.environ))
    print(f"export SLURM_CONF={c.env['SLURM_CONF']}   # Ctrl-C or SIGTERM here stops the cluster", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        c.stop()
