"""nsys command lines: exact flags, per-rank report names, GPU metrics on local rank 0 only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pandas as pd
import pytest

from harness.measure import nsys as nsys_mod
from harness.measure.nsys import (
    format_command,
    load_stats_csvs,
    nsys_available,
    nsys_command,
    nsys_command_from_env,
    nsys_stats_commands,
    report_path,
)

INNER = ["python", "-m", "harness.run.worker", "--cell", "tiny ddp"]
BASE = [
    "/opt/nsys", "profile",
    "-t", "cuda,nvtx,osrt,cublas,cudnn",
    "--capture-range=cudaProfilerApi",
    "--capture-range-end=stop",
    "-o", "/runs/r1/nsys/%q{RANK}",
    "--force-overwrite=false",
    "--stats=false",
]


def test_local_rank0_gets_gpu_metrics() -> None:
    cmd = nsys_command("/opt/nsys", Path("/runs/r1/nsys"), INNER, "all", local_rank0=True)
    assert cmd == [*BASE, "--gpu-metrics-devices=all", *INNER]


def test_other_ranks_do_not_sample_gpu_metrics() -> None:
    cmd = nsys_command("/opt/nsys", Path("/runs/r1/nsys"), INNER, "all", local_rank0=False)
    assert cmd == [*BASE, *INNER]
    assert nsys_command("/opt/nsys", "/runs/r1/nsys", INNER, None, local_rank0=True) == [*BASE, *INNER]


def test_per_rank_report_names() -> None:
    assert report_path("/runs/r1/nsys", 0) == Path("/runs/r1/nsys/0.nsys-rep")
    assert report_path(Path("/runs/r1/nsys"), 13) == Path("/runs/r1/nsys/13.nsys-rep")


def test_command_from_torchrun_env() -> None:
    rank0 = nsys_command_from_env("/opt/nsys", "/runs/r1/nsys", INNER, "all", env={"LOCAL_RANK": "0"})
    rank3 = nsys_command_from_env("/opt/nsys", "/runs/r1/nsys", INNER, "all", env={"LOCAL_RANK": "3"})
    assert "--gpu-metrics-devices=all" in rank0 and not any("gpu-metrics" in a for a in rank3)
    with pytest.raises(ValueError, match="LOCAL_RANK is None; run the nsys wrapper as a torchrun worker"):
        nsys_command_from_env("/opt/nsys", "/x", INNER, "all", env={})


def test_format_command_quotes_arguments() -> None:
    line = format_command(nsys_command("/opt/nsys", "/runs/r1/nsys", INNER, None, local_rank0=False))
    assert line.startswith("/opt/nsys profile -t cuda,nvtx,osrt,cublas,cudnn ")
    assert line.endswith("--cell 'tiny ddp'") and "'/runs/r1/nsys/%q{RANK}'" in line


def test_empty_inner_command_is_rejected() -> None:
    with pytest.raises(ValueError, match="inner_cmd is empty"):
        nsys_command("/opt/nsys", "/x", [], None, local_rank0=True)


def test_stats_commands() -> None:
    cmds = nsys_stats_commands("/opt/nsys", Path("/runs/r1/nsys/0.nsys-rep"), Path("/runs/r1/nsys/0"))
    assert [c[3] for c in cmds] == ["nvtx_sum", "nvtx_gpu_proj_sum", "cuda_gpu_kern_sum"]
    assert cmds[0] == [
        "/opt/nsys", "stats", "--report", "nvtx_sum", "--format", "csv",
        "--output", "/runs/r1/nsys/0", "/runs/r1/nsys/0.nsys-rep",
    ]


def test_load_stats_csvs(tmp_path: Path) -> None:
    (tmp_path / "0_nvtx_sum.csv").write_text("Time (%),Total Time (ns),Instances,Range\n60.0,600,3,:harness:forward\n")
    (tmp_path / "0_cuda_gpu_kern_sum.csv").write_text("")  # nsys leaves empty files for empty reports
    (tmp_path / "1_nvtx_sum.csv").write_text("x\n1\n")  # another rank's prefix
    tables = load_stats_csvs(tmp_path / "0")
    assert sorted(tables) == ["cuda_gpu_kern_sum", "nvtx_sum"]
    assert tables["nvtx_sum"]["Range"].tolist() == [":harness:forward"]
    assert isinstance(tables["cuda_gpu_kern_sum"], pd.DataFrame) and tables["cuda_gpu_kern_sum"].empty


def test_nsys_available_searches_install_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nsys_mod.shutil, "which", lambda name: None)
    assert nsys_available(search_globs=[str(tmp_path / "nsight-systems*/bin/nsys")]) is None
    for version in ("2024.9.2", "2024.10.1"):
        exe = tmp_path / f"nsight-systems-{version}" / "bin" / "nsys"
        exe.parent.mkdir(parents=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    found = nsys_available(search_globs=[str(tmp_path / "nsight-systems*/bin/nsys")])
    assert found == str(tmp_path / "nsight-systems-2024.10.1" / "bin" / "nsys")
    monkeypatch.setattr(nsys_mod.shutil, "which", lambda name: "/usr/bin/nsys")
    assert nsys_available() == "/usr/bin/nsys"


def test_main_execs_nsys_for_the_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(os, "execvp", lambda file, args: seen.append(list(args)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    nsys_mod.main(["--out-dir", str(tmp_path / "nsys"), "--nsys", "/opt/nsys", "--gpu-metrics-devices", "all",
                   "--", *INNER])
    assert seen == [nsys_command("/opt/nsys", tmp_path / "nsys", INNER, "all", local_rank0=False)]
    assert (tmp_path / "nsys").is_dir()
