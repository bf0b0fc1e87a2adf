"""Nsight Systems (nsys) command lines for one cell's job, and the processes nsys leaves behind.

One ``nsys profile`` session wraps the cell's launcher (torchrun) on each node, as Megatron-LM and
NeMo run it: nsys follows the ranks it forks, and the report holds every rank of the node as its
own process row, in one timeline. One session per rank was tried first and dropped: with Nsight
Systems 2022.4 on this machine, two sessions running at once left one of them hung (an agent at
100% of a core, the rank blocked in an NVTX call) in 7 of 12 rounds; one session never did.
Which process is which rank is read from the payload of each rank's ``window`` range.

On CUDA, capture is limited to the measured window: ``--capture-range=cudaProfilerApi`` starts
recording at the first ``cudaProfilerStart`` (``Ranges.window_start``) and runs to the job's end.
On CPU ranks there is no cudaProfilerApi: the capture starts at the first ``window`` NVTX range
(``--capture-range=nvtx --nvtx-capture=window@harness``, ``-t nvtx,osrt``). Either way
``--capture-range-end=none``: the measured window's end triggers nothing inside a rank's step loop.

Reading the reports back: :mod:`harness.measure.nsys_reports`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

NSYS_TRACE = "cuda,nvtx,osrt,cublas,cudnn"
NSYS_TRACE_CPU = "nvtx,osrt"
"""On CPU ranks: NVTX and OS runtime calls (no CUDA to trace)."""
WINDOW_CAPTURE = "window@harness"
"""On CPU ranks (no cudaProfilerStart) the capture range starts at the harness's ``window`` NVTX range."""
SESSION_PREFIX = "harness-"
"""Every nsys session the harness starts is named ``harness-<tag>`` (``--session-new``), so the agent
nsys forks, which leaves the job's process group, can be found and ended with the cell."""
NSYS_SEARCH_GLOBS: tuple[str, ...] = (
    # Nsight Systems installers (versioned or not), then the copy a CUDA toolkit bundles.
    "/opt/nvidia/nsight-systems*/bin/nsys",
    "/opt/nvidia/nsight-systems*/*/bin/nsys",
    "/opt/nvidia/nsight-systems*/*/target-linux-*/nsys",
    "/usr/local/cuda/bin/nsys",
    "/usr/local/cuda-*/bin/nsys",
    "/usr/local/cuda*/nsight-systems-*/bin/nsys",
)
NO_NSYS = ("n/a: no nsys (not on PATH, /opt/nvidia/nsight-systems*/ or /usr/local/cuda*/); "
           "make setup-nsys installs it on Debian/Ubuntu, or use NVIDIA's Nsight Systems installer")


def _version_key(path: str) -> list[tuple[int, str]]:
    # "2024.10.1" > "2024.9.2": compare digit runs numerically, the rest as text.
    parts = []
    for token in path.replace("-", ".").split("."):
        parts.append((int(token), "") if token.isdigit() else (-1, token))
    return parts


def nsys_available(search_globs: Sequence[str] = NSYS_SEARCH_GLOBS) -> str | None:
    """Path of the nsys executable: ``PATH`` first, then the newest install under ``search_globs``."""
    on_path = shutil.which("nsys")
    if on_path:
        return on_path
    for pattern in search_globs:
        candidates = sorted(
            (p for p in glob.glob(pattern) if os.access(p, os.X_OK) and Path(p).is_file()),
            key=_version_key,
        )
        if candidates:
            return candidates[-1]
    return None


def report_path(out_dir: str | Path, cell_id: str, nnodes: int = 1, node_rank: int = 0) -> Path:
    """Where a cell's report lands: ``<out_dir>/<cell_id>.nsys-rep`` (``.node<k>`` across nodes)."""
    stem = cell_id if nnodes == 1 else f"{cell_id}.node{node_rank}"
    return Path(out_dir) / f"{stem}.nsys-rep"


def nsys_command(
    nsys: str,
    report: str | Path,
    tag: str,
    device_kind: str = "cuda",
    gpu_metrics_device: str | None = None,
) -> list[str]:
    """The argument list ``nsys profile <flags>`` to put in front of a cell's launcher command.

    Args:
        nsys: nsys executable (see ``nsys_available``).
        report: the report's path (see :func:`report_path`); nsys adds ``.nsys-rep`` if missing.
        tag: names the nsys session ``harness-<tag>``, by which :func:`end_sessions` finds it.
        device_kind: ``cuda`` traces CUDA, cuBLAS and cuDNN from the first ``cudaProfilerStart``;
            ``cpu`` traces NVTX and OS calls from the first ``window`` range.
        gpu_metrics_device: value for ``--gpu-metrics-devices`` (``all``, ``cuda-visible`` or
            nvidia-smi GPU ids; one session per node samples them all), or None for none.
    """
    if device_kind not in ("cuda", "cpu"):
        raise ValueError(f"device_kind is {device_kind!r}; nsys captures 'cuda' or 'cpu' ranks")
    report = Path(report)
    stem = report.with_suffix("") if report.suffix == ".nsys-rep" else report
    cmd = [nsys, "profile", "-t", NSYS_TRACE if device_kind == "cuda" else NSYS_TRACE_CPU]
    if device_kind == "cuda":
        cmd.append("--capture-range=cudaProfilerApi")
        if gpu_metrics_device is not None:
            cmd.append(f"--gpu-metrics-devices={gpu_metrics_device}")
    else:
        cmd += ["--capture-range=nvtx", f"--nvtx-capture={WINDOW_CAPTURE}"]
    return [
        *cmd,
        "--capture-range-end=none",  # to the job's end: nothing happens inside a step loop
        f"--session-new={SESSION_PREFIX}{tag}",
        "-o", str(stem),
        "--force-overwrite=false",  # a run directory is never overwritten
        "--stats=false",  # stats run afterwards, off the measured job's clock
    ]


TAG_ENV = "HARNESS_NSYS_TAG"
"""Set in the captured job's environment: nsys starts the launcher in a session of its own, so the
job's process-group kill cannot reach it or the ranks; this variable, which they inherit, can."""


def end_sessions(tag: str, grace_s: float = 3.0) -> list[int]:
    """End every process of the capture ``tag`` still alive; return their pids.

    Those are the nsys session ``harness-<tag>``'s agent (``nsys --start-agent``, in a session of its
    own, which 2022.4 can leave running after the program ends, holding most of a core) and
    ``nsys profile``, and anything started under it (launcher, ranks: :data:`TAG_ENV`). They get
    SIGTERM, then SIGKILL after ``grace_s`` (what they leave behind: :func:`clear_stale_state`).
    """
    names = (f"--session-name={SESSION_PREFIX}{tag}", f"--session-new={SESSION_PREFIX}{tag}")
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["cmdline", "pid"]):
        if proc.info["pid"] == me:
            continue
        cmdline = proc.info.get("cmdline") or []
        try:
            tagged = any(arg in names for arg in cmdline) or proc.environ().get(TAG_ENV) == tag
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if tagged:
            found.append(proc)
    for proc in found:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in found]


STALE_STATE = ("quadd-agent-instance-*", "NSys-*", "sem.nsys_sem_*")
"""What an nsys 2022.4 session keeps in shared memory while it runs (named by pids of its own numbering,
not the host's) and removes when it ends normally; a killed agent leaves them behind."""


def _nsys_running() -> bool:
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info.get("cmdline") or []
        if cmdline and proc.info.get("status") != psutil.STATUS_ZOMBIE and (
                "nsight-systems" in cmdline[0] or os.path.basename(cmdline[0]) in ("nsys", IMPORTER)):
            return True
    return False


def clear_stale_state(tmp_dir: str | None = None, shm_dir: str = "/dev/shm") -> list[str]:
    """Remove what ended (killed) nsys sessions left behind: their shared memory and their session folders
    under ``<tmp>/nvidia/nsight_systems``; only when no nsys process runs on this machine, so a session
    of someone else's is never touched. Returns what was removed."""
    if _nsys_running():
        return []
    tmp = tmp_dir or tempfile.gettempdir()
    removed = []
    for path in [p for g in STALE_STATE for p in glob.glob(f"{shm_dir}/{g}")] + glob.glob(f"{tmp}/nvidia/nsight_systems/quadd_session_*"):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(os.path.basename(path))
    return removed


WORKLOAD_MODULES = ("torch.distributed.run", "harness.run.worker")
"""What a capture's workload runs (its launcher and ranks); every other process of the session is nsys's."""


def workload_alive(tag: str) -> bool:
    """Whether a launcher or rank of the capture ``tag`` still runs (found by :data:`TAG_ENV`).

    Once none does, what is left of the session is nsys writing its report (and, when 2022.4's agent
    hangs, nothing more): :class:`harness.run.nsys_capture.ReportWait` bounds that wait."""
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info.get("cmdline") or []
        if proc.info.get("status") == psutil.STATUS_ZOMBIE or not any(m in cmdline for m in WORKLOAD_MODULES):
            continue
        with contextlib.suppress(psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            if proc.environ().get(TAG_ENV) == tag:
                return True
    return False


IMPORTER = "QdstrmImporter"
"""The program nsys runs once its agent has the data, to turn it into the ``.nsys-rep`` report."""


@dataclass(frozen=True)
class SessionActivity:
    """What the capture ``tag``'s nsys processes are doing: their pids, the bytes they have read and
    written so far (``read_chars`` + ``write_chars``, page cache included), and whether the importer runs."""

    pids: frozenset[int]
    io_bytes: int
    importing: bool


def session_activity(tag: str) -> SessionActivity:
    """The capture ``tag``'s nsys processes (by session name or :data:`TAG_ENV`), the launcher and ranks
    excluded: a healthy agent reads the ranks' data after they end and the importer writes the report;
    a hung 2022.4 agent spins at a full core with no I/O at all (docs/nsys.md, "A hung capture")."""
    names = (f"--session-name={SESSION_PREFIX}{tag}", f"--session-new={SESSION_PREFIX}{tag}")
    pids, io, importing = set(), 0, False
    for proc in psutil.process_iter(["cmdline", "pid", "status"]):
        cmdline = proc.info.get("cmdline") or []
        if not cmdline or proc.info.get("status") == psutil.STATUS_ZOMBIE or any(m in cmdline for m in WORKLOAD_MODULES):
            continue
        with contextlib.suppress(psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            if any(a in names for a in cmdline) or proc.environ().get(TAG_ENV) == tag:
                counters = proc.io_counters()
                pids.add(proc.info["pid"])
                io += getattr(counters, "read_chars", counters.read_bytes) + getattr(counters, "write_chars", counters.write_bytes)
                importing = importing or os.path.basename(cmdline[0]) == IMPORTER
    return SessionActivity(frozenset(pids), io, importing)


def format_command(cmd: Sequence[str]) -> str:
    """Shell-quoted one-line form of an argument list, for logs and dry runs."""
    return shlex.join(list(cmd))
