"""End-to-end tier: ``harness`` run as a subprocess (CPU, gloo), faults injected, processes audited.

Every run gets its own calibration cache and fault-marker directory under the test's tmp dir,
runs on CPU whatever the machine has (``--device cpu``), and is never left running: a test that
fails or times out still kills whatever its sweep started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # E2E.planned imports the harness in the test process
INJECT = Path(__file__).resolve().parent / "inject"
TINY = ["--device", "cpu", "--sizes", "tiny", "--steps", "3", "--warmup", "1", "--batch", "4", "--no-calibrate"]
"""The smallest honest cell: 1 warmup + 3 measured steps of the tiny GPT, 4 sequences per step."""


def _as_a_background_job() -> None:
    """The harness starts with SIGINT ignored, as a non-interactive shell starts ``harness ... &``:
    Ctrl-C (SIGINT sent to the harness) must still stop it, so the entry point has to undo this."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass
class HarnessCLI:
    """``python -m harness ...`` with the test environment; ``faults`` go to the inject hook."""

    tmp: Path

    def env(self, faults: list[dict] | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
        env.update(PYTHONPATH=os.pathsep.join([str(INJECT), str(REPO)]), OMP_NUM_THREADS="1",
                   HARNESS_CALIBRATION=str(self.tmp / "calibration.json"), HARNESS_FORCE_CPU="1",
                   HARNESS_TEST_FAULT_DIR=str(self.fault_dir))
        if faults:
            env["HARNESS_TEST_FAULTS"] = json.dumps(faults)
        return env

    @property
    def fault_dir(self) -> Path:
        d = self.tmp / "faults-fired"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def fired(self, cell_id: str, fault: str) -> bool:
        return (self.fault_dir / f"{cell_id}.{fault}.fired").exists()

    def popen(self, *args: str, faults: list[dict] | None = None, log: str = "harness") -> subprocess.Popen:
        out = open(self.tmp / f"{log}.stdout", "w")
        err = open(self.tmp / f"{log}.stderr", "w")
        return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=REPO, env=self.env(faults),
                                stdout=out, stderr=err, preexec_fn=_as_a_background_job)

    def run(self, *args: str, timeout: float, faults: list[dict] | None = None,
            log: str = "harness") -> subprocess.CompletedProcess:
        proc = self.popen(*args, faults=faults, log=log)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"harness {' '.join(args)} still running after {timeout:.0f} s; "
                                 f"stderr tail:\n{self.stderr(log)[-2000:]}") from None
        return subprocess.CompletedProcess(args, rc, self.stdout(log), self.stderr(log))

    def signal_when(self, proc: subprocess.Popen, ready, sig: int = signal.SIGINT, log: str = "harness",
                    timeout_s: float = 240.0, settle_s: float = 0.0) -> int:
        """Send ``sig`` to the harness once ``ready()`` holds (after ``settle_s``), and return its exit code;
        it fails if the harness exits or ``timeout_s`` passes first, and never leaves it running."""
        try:
            deadline = time.monotonic() + timeout_s
            while not ready():
                assert proc.poll() is None, f"harness exited ({proc.returncode}) first:\n{self.stderr(log)[-2000:]}"
                assert time.monotonic() < deadline, f"not ready within {timeout_s:.0f} s"
                time.sleep(0.1)
            time.sleep(settle_s)
            proc.send_signal(sig)
            return proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def stdout(self, log: str = "harness") -> str:
        return (self.tmp / f"{log}.stdout").read_text(errors="replace")

    def stderr(self, log: str = "harness") -> str:
        return (self.tmp / f"{log}.stderr").read_text(errors="replace")


def read_records(out: Path, kind: str | None = "cell") -> list[dict]:
    """Complete records in file order (a torn last line is not a record)."""
    path = out / "records.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    return [r for r in recs if kind is None or r.get("kind") == kind]


def _matching(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != os.getpid() and any(marker in a for a in (p.info["cmdline"] or [])):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def survivors(marker: str, grace_s: float = 10.0) -> list[str]:
    """Live processes whose command line mentions ``marker`` (a run's --out path), after a short grace.

    Zombies are dead (only their exit status is left) and do not count.
    """
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for p in _matching(marker):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"pid {p.pid} [{p.status()}]: {' '.join(p.cmdline())[:300]}")
            except psutil.NoSuchProcess:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def job_processes(harness_pid: int) -> list[str]:
    """Live processes of every job the harness ``harness_pid`` started (their tag starts with its pid)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("HARNESS_JOB_TAG", "").startswith(f"{harness_pid}-") \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"pid {p.pid}: {' '.join(p.cmdline())[:200]}")
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return found


def rank_processes(marker: str) -> list[psutil.Process]:
    """Live rank processes of a run (its ``--out`` path in their command line): torchrun's run
    ``harness.run.worker``; forked ones are the grandchildren of the sweep's fork server
    (``harness.run.fork_server --run-dir OUT``: server -> a cell's leader -> its ranks)."""
    ranks = []
    for p in _matching(marker):
        try:
            cmd = " ".join(p.cmdline())
            lineage = [q for q in (p.parent(), p.parent().parent() if p.parent() else None) if q is not None]
            forked = len(lineage) == 2 and all("harness.run.fork_server" in " ".join(q.cmdline())
                                               for q in [p, *lineage])
            if ("harness.run.worker" in cmd or forked) and p.status() != psutil.STATUS_ZOMBIE:
                ranks.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return ranks


def kill_all(marker: str) -> None:
    """Test cleanup: SIGCONT + SIGKILL every process that mentions ``marker``."""
    for p in _matching(marker):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                break


class E2E:
    """The helpers, handed to tests by the ``e2e`` fixture (a conftest is not importable reliably)."""

    TINY = TINY
    REPO = REPO
    CLI = HarnessCLI
    read_records = staticmethod(read_records)
    survivors = staticmethod(survivors)
    rank_processes = staticmethod(rank_processes)
    job_processes = staticmethod(job_processes)
    kill_all = staticmethod(kill_all)

    @staticmethod
    def planned(*flags: str) -> list:
        """The cells ``harness plan`` would list for these sweep flags, in run order."""
        from harness.cli import build_parser, spec_from_args
        from harness.planner import expand

        args = build_parser().parse_args(["plan", *flags])
        return expand(spec_from_args(args))

    @staticmethod
    def free_port() -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


@pytest.fixture(scope="session")
def e2e() -> type[E2E]:
    return E2E


BENCH_RUN = ["--device", "cpu", "--gpus", "4", "--sizes", "tiny", "--strategies", "tp,pp,fsdp+tp", "--steps", "4",
             "--warmup", "1", "--batch", "8", "--no-calibrate"]
"""The fast tier's one sweep: tensor, pipeline and hybrid cells at 4 ranks and the single-device
reference the planner adds, read by every test that needs real records (the joints between the
worker, the record builder and the formulas; bench -> records -> report)."""


@dataclass
class BenchRun:
    out: Path
    returncode: int
    stdout: str
    stderr: str
    records: list[dict]

    def cells(self, status: str | None = "ok") -> list[dict]:
        return [r for r in self.records if r["kind"] == "cell" and (status is None or r["status"] == status)]

    def cell(self, strategy: str) -> dict:
        found = [r for r in self.cells(None) if r["config"]["strategy"] == strategy]
        assert len(found) == 1, f"{strategy}: {len(found)} records"
        return found[0]


@pytest.fixture(scope="session")
def bench_run(tmp_path_factory) -> BenchRun:
    """``harness bench`` of :data:`BENCH_RUN`, once per test session, through the real CLI and launcher."""
    tmp = tmp_path_factory.mktemp("bench-run")
    cli = HarnessCLI(tmp)
    out = tmp / "run"
    try:
        res = cli.run("bench", *BENCH_RUN, "--out", str(out), timeout=900)
    finally:
        kill_all(str(tmp))
    run = BenchRun(out=out, returncode=res.returncode, stdout=res.stdout, stderr=res.stderr,
                   records=read_records(out, kind=None))
    assert run.returncode == 0, f"harness bench exited {res.returncode}; stderr tail:\n{res.stderr[-3000:]}"
    return run


@pytest.fixture
def harness_cli(tmp_path: Path):
    cli = HarnessCLI(tmp_path)
    yield cli
    kill_all(str(tmp_path))
