"""Nsight Systems (nsys) command lines: one report per rank, and ``nsys stats`` CSV tables.

The per-rank wrapper is a torchrun worker prefix: every worker runs
``nsys profile ... -o <out_dir>/%q{RANK} <worker command>``, so nsys expands ``RANK`` from
the worker's environment and each rank writes ``<out_dir>/<rank>.nsys-rep``. Capture is
limited to the measured window: ``--capture-range=cudaProfilerApi`` starts recording at the
worker's ``cudaProfilerStart`` (``Ranges.window_start``) and ``--capture-range-end=stop``
ends it at ``cudaProfilerStop``.

GPU metrics sampling (``--gpu-metrics-devices``) can be owned by one nsys session per GPU
at a time, so only local rank 0 of each node asks for it, for the whole node.

Torchrun usage (the wrapper picks the flags from ``LOCAL_RANK`` in each worker)::

    torchrun --nproc-per-node 4 -m harness.measure.nsys --out-dir runs/x/nsys \\
        --gpu-metrics-devices all -- python -m harness.run.worker ...
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

NSYS_TRACE = "cuda,nvtx,osrt,cublas,cudnn"
STATS_REPORTS: tuple[str, ...] = ("nvtx_sum", "nvtx_gpu_proj_sum", "cuda_gpu_kern_sum")
NSYS_SEARCH_GLOBS: tuple[str, ...] = (
    # Nsight Systems installers (versioned or not), then the copy a CUDA toolkit bundles.
    "/opt/nvidia/nsight-systems*/bin/nsys",
    "/opt/nvidia/nsight-systems*/*/bin/nsys",
    "/opt/nvidia/nsight-systems*/*/target-linux-*/nsys",
    "/usr/local/cuda/bin/nsys",
    "/usr/local/cuda-*/bin/nsys",
    "/usr/local/cuda*/nsight-systems-*/bin/nsys",
)


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


def report_path(out_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank``'s report lands: ``<out_dir>/<rank>.nsys-rep``."""
    return Path(out_dir) / f"{rank}.nsys-rep"


def nsys_command(
    nsys: str,
    out_dir: str | Path,
    inner_cmd: Sequence[str],
    gpu_metrics_device: str | None,
    local_rank0: bool,
) -> list[str]:
    """Argument list ``nsys profile <flags> <inner_cmd...>`` for one torchrun worker.

    Args:
        nsys: nsys executable (see ``nsys_available``).
        out_dir: report directory; the report name is the global rank (``%q{RANK}``).
        inner_cmd: the worker command, as an argument list.
        gpu_metrics_device: value for ``--gpu-metrics-devices`` (``all``, ``cuda-visible``
            or nvidia-smi GPU ids), or None for no GPU metrics.
        local_rank0: whether this worker is local rank 0, the only one sampling GPU metrics.
    """
    if not inner_cmd:
        raise ValueError("inner_cmd is empty; pass the worker command, e.g. ['python', '-m', 'harness.run.worker']")
    cmd = [
        nsys, "profile",
        "-t", NSYS_TRACE,
        "--capture-range=cudaProfilerApi",
        "--capture-range-end=stop",
        "-o", f"{Path(out_dir)}/%q{{RANK}}",
        "--force-overwrite=false",  # a run directory is never overwritten
        "--stats=false",  # stats run afterwards, off the measured job's clock
    ]
    if local_rank0 and gpu_metrics_device is not None:
        cmd.append(f"--gpu-metrics-devices={gpu_metrics_device}")
    return [*cmd, *inner_cmd]


def nsys_command_from_env(
    nsys: str,
    out_dir: str | Path,
    inner_cmd: Sequence[str],
    gpu_metrics_device: str | None,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """``nsys_command`` with ``local_rank0`` read from ``LOCAL_RANK`` (set by torchrun)."""
    env = os.environ if env is None else env
    local_rank = env.get("LOCAL_RANK")
    if local_rank is None or not local_rank.isdigit():
        raise ValueError(f"LOCAL_RANK is {local_rank!r}; run the nsys wrapper as a torchrun worker")
    return nsys_command(nsys, out_dir, inner_cmd, gpu_metrics_device, local_rank0=int(local_rank) == 0)


def format_command(cmd: Sequence[str]) -> str:
    """Shell-quoted one-line form of an argument list, for logs and dry runs."""
    return shlex.join(list(cmd))


def nsys_stats_commands(nsys: str, report_path: str | Path, out_prefix: str | Path) -> list[list[str]]:
    """``nsys stats`` argument lists writing ``<out_prefix>_<report>.csv`` per report.

    One command per report, run in order: a report a given nsys version lacks (e.g.
    ``nvtx_gpu_proj_sum`` before 2023.x) then fails alone instead of taking the others with it.
    """
    return [
        [nsys, "stats", "--report", name, "--format", "csv", "--output", str(out_prefix), str(report_path)]
        for name in STATS_REPORTS
    ]


def load_stats_csvs(prefix: str | Path) -> dict[str, pd.DataFrame]:
    """``{report name: table}`` from the ``<prefix>_<report>.csv`` files nsys stats wrote."""
    prefix = Path(prefix)
    tables: dict[str, pd.DataFrame] = {}
    for path in sorted(prefix.parent.glob(f"{glob.escape(prefix.name)}_*.csv")):
        name = path.name[len(prefix.name) + 1 : -len(".csv")]
        try:
            tables[name] = pd.read_csv(path)
        except pd.errors.EmptyDataError:
            # nsys writes an empty file when a report has no rows (e.g. no NVTX ranges).
            tables[name] = pd.DataFrame()
    return tables


def main(argv: Sequence[str] | None = None) -> None:
    """Torchrun worker entry: exec ``nsys profile`` around the command after ``--``."""
    parser = argparse.ArgumentParser(prog="python -m harness.measure.nsys", description=__doc__)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--gpu-metrics-devices", default=None)
    parser.add_argument("--nsys", default=None, help="nsys executable (default: search PATH and /opt)")
    parser.add_argument("inner", nargs=argparse.REMAINDER, help="-- worker command")
    args = parser.parse_args(argv)
    inner = args.inner[1:] if args.inner[:1] == ["--"] else args.inner
    nsys = args.nsys or nsys_available()
    if nsys is None:
        parser.error("nsys not found on PATH, /opt/nvidia/nsight-systems*/bin or /usr/local/cuda/bin; "
                     "install Nsight Systems or pass --nsys")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cmd = nsys_command_from_env(nsys, args.out_dir, inner, args.gpu_metrics_devices)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
