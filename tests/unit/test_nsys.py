"""nsys command lines and process hygiene (exact flags, report names, the session's leftovers ended),
and reading reports back (an export built here with nsys's own schema, checked against the steps run)."""

from __future__ import annotations

import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.measure import nsys as nsys_mod
from harness.measure import nsys_reports
from harness.measure.nsys import end_sessions, format_command, nsys_available, nsys_command, report_path
from harness.measure.nsys_reports import capture_problem, ranks_of, read_ranges, summarize

REPORT = "/runs/r1/cells/c/nsys/c.nsys-rep"


def test_cuda_capture_is_the_profiler_window_with_gpu_metrics() -> None:
    assert nsys_command("/opt/nsys", REPORT, "ab12", "cuda", "all") == [
        "/opt/nsys", "profile", "-t", "cuda,nvtx,osrt,cublas,cudnn", "--capture-range=cudaProfilerApi",
        "--gpu-metrics-devices=all", "--capture-range-end=none", "--session-new=harness-ab12",
        "-o", "/runs/r1/cells/c/nsys/c", "--force-overwrite=false", "--stats=false",
    ]


def test_cpu_capture_starts_at_the_window_range() -> None:
    cmd = nsys_command("/opt/nsys", Path("/r/c"), "t", "cpu", "all")
    assert cmd[:6] == ["/opt/nsys", "profile", "-t", "nvtx,osrt", "--capture-range=nvtx",
                       "--nvtx-capture=window@harness"]
    assert not any(a.startswith("--gpu-metrics") for a in cmd)  # no GPU to sample
    assert "--capture-range-end=none" in cmd and cmd[cmd.index("-o") + 1] == "/r/c"


def test_unknown_device_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="'tpu'"):
        nsys_command("/opt/nsys", REPORT, "t", "tpu")


def test_report_names_say_cell_and_node() -> None:
    assert report_path("/o", "tiny-ddp") == Path("/o/tiny-ddp.nsys-rep")
    assert report_path("/o", "tiny-ddp", nnodes=2, node_rank=1) == Path("/o/tiny-ddp.node1.nsys-rep")


def test_format_command_quotes() -> None:
    assert format_command(["nsys-ui", "/a b/c.nsys-rep"]) == "nsys-ui '/a b/c.nsys-rep'"


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


def _sleeper(*args: str) -> subprocess.Popen:
    # A process whose command line carries nsys's session flag, as the agent's does; SIGTERM ignored,
    # so only the SIGKILL after the grace period ends it.
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    return subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True)


def test_end_sessions_ends_the_session_only() -> None:
    mine = _sleeper("--start-agent", "--session-name=harness-t0k3n")
    other = _sleeper("--start-agent", "--session-name=harness-t0k3n2")  # another capture's session
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not psutil.Process(mine.pid).cmdline()[-1:] == [
                "--session-name=harness-t0k3n"]:
            time.sleep(0.05)
        assert end_sessions("t0k3n", grace_s=0.5) == [mine.pid]
        mine.wait(timeout=30)  # ended, although it ignored SIGTERM (psutil reaped it, so no status is left)
        assert not psutil.pid_exists(mine.pid)
        assert other.poll() is None
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


# ---- reading reports back: an export with nsys's schema (the tables and columns read) -----------------

EVENT_TYPES = {33: "NvtxCategory", 59: "NvtxPushPopRange", 60: "NvtxStartEndRange", 75: "NvtxDomainCreate"}


def _tid(pid: int) -> int:
    return (1 << 48) | (pid << 24) | pid


def _export(path: Path, events: list[tuple]) -> Path:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE ENUM_NSYS_EVENT_TYPE (id INTEGER PRIMARY KEY, name TEXT, label TEXT)")
    db.executemany("INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES (?, ?, ?)", [(k, v, v) for k, v in EVENT_TYPES.items()])
    db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", [(437, "step"), (438, "window"), (439, "forward")])
    db.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, text TEXT, globalTid INTEGER,"
               " textId INTEGER, domainId INTEGER, int64Value INTEGER, uint64Value INTEGER)")
    db.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", events)
    db.commit()
    db.close()
    return path


def _rank_events(pid: int, rank: int, steps: int, warmup: int = 1, domain: int = 1) -> list[tuple]:
    ev: list[tuple] = [(0, None, 75, "harness", _tid(pid), None, domain, None, None),
                       (0, None, 75, "other", _tid(pid), None, domain + 10, None, None)]
    t = 100
    for i in range(warmup + steps):
        if i == warmup:
            window_start = t
        ev.append((t, t + 50, 60, None, _tid(pid), 437, domain, i, None))  # registered string "step"
        ev.append((t + 5, t + 20, 60, "forward", _tid(pid), None, domain, None, None))  # plain text
        ev.append((t + 5, t + 20, 60, "forward", _tid(pid), None, domain + 10, None, None))  # another domain
        t += 100
    ev.append((window_start, t, 60, None, _tid(pid), 438, domain, rank, None))
    ev.append((t + 1, None, 60, "step", _tid(pid), None, domain, 99, None))  # never ended: not a range
    return ev


def test_ranges_are_read_per_rank_from_one_report(tmp_path: Path) -> None:
    db = _export(tmp_path / "c.sqlite", _rank_events(4242, 1, steps=3) + _rank_events(777, 0, steps=3))
    ranges = read_ranges(db)
    assert {r.name for r in ranges} == {"step", "window", "forward"}
    assert ranks_of(ranges) == {4242: 1, 777: 0}
    cap = summarize(1, "c.nsys-rep", [r for r in ranges if r.pid == 4242])
    assert (cap.windows, cap.steps_total, cap.steps_in_window) == (1, 4, 3)
    assert cap.phases == {"forward": {"count": 3, "total_s": pytest.approx(45e-9)}}
    assert cap.window_s == pytest.approx(300e-9)


def test_a_capture_is_checked_against_the_steps_run(tmp_path: Path) -> None:
    ranges = read_ranges(_export(tmp_path / "c.sqlite", _rank_events(10, 0, steps=3) + _rank_events(11, 1, steps=2)))
    caps = {rank: summarize(rank, "c.nsys-rep", [r for r in ranges if r.pid == pid])
            for pid, rank in ranks_of(ranges).items()}
    assert capture_problem({0: caps[0]}, range(1), 3) is None
    assert "c.nsys-rep: 2 step ranges in the measured window, but 3 steps were run" in capture_problem(
        caps, range(2), 3)
    assert "rank(s) 2, 3 of 0, 1, 2, 3" in capture_problem(caps, range(4), 3)
    line = capture_problem({}, range(2), 3)
    assert line.startswith("no 'harness' NVTX window was recorded") and "\n" not in line


def test_an_export_without_nvtx_holds_no_ranges(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "empty.sqlite")
    db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    db.close()
    assert read_ranges(tmp_path / "empty.sqlite") == []


def test_stats_report_names_follow_the_installed_nsys(tmp_path: Path) -> None:
    def fake(help_text: str) -> str:
        exe = tmp_path / f"nsys{len(help_text)}"
        exe.write_text(f"#!/bin/sh\ncat <<'EOF'\n{help_text}\nEOF\n")
        exe.chmod(0o755)
        return str(exe)

    old = fake("  gpukernsum[:base|:mangled] -- CUDA GPU Kernel Summary\n  nvtxsum -- NVTX Range Summary\n")
    new = fake("  cuda_gpu_kern_sum[:nvtx-name] -- CUDA GPU Kernel Summary\n  nvtx_sum[:base] -- NVTX Range Summary\n"
               "  nvtx_gpu_proj_sum -- NVTX GPU Projection Summary\n")
    assert nsys_reports.stats_report_names(old) == {"nvtx": "nvtxsum", "kernels": "gpukernsum"}
    assert nsys_reports.stats_report_names(new) == {"nvtx": "nvtx_sum", "kernels": "cuda_gpu_kern_sum"}


def test_kernels_are_attributed_to_the_rank_whose_process_launched_them(tmp_path: Path, monkeypatch) -> None:
    """A synthetic export with known kernels per process: rank 1 (pid 4242) launched 3 kernels, one of them NCCL's;
    rank 0 (pid 777) 2, both NCCL's; a kernel of a process with no rank (pid 55, a helper) counts for no rank. The
    expected counts are the rows written here, by hand."""
    db = _export(tmp_path / "c.sqlite", _rank_events(4242, 1, steps=3) + _rank_events(777, 0, steps=3))
    con = sqlite3.connect(db)
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(500, "ampere_sgemm_128x64_nn"),
                                                            (501, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
                                                            (502, "vectorized_elementwise_kernel")])
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (globalPid INTEGER, shortName INTEGER)")
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?)",
                    [(_tid(4242), 500), (_tid(4242), 501), (_tid(4242), 502),
                     (_tid(777), 501), (_tid(777), 501), (_tid(55), 500)])
    con.commit()
    con.close()
    monkeypatch.setattr(nsys_reports, "export_sqlite", lambda nsys, report: db)
    caps = nsys_reports.read_capture("nsys", tmp_path / "c.nsys-rep")
    assert {r: (c.kernels, c.nccl_kernels) for r, c in caps.items()} == {1: (3, 1), 0: (2, 2)}
    assert caps[1].steps_in_window == 3 and caps[0].steps_in_window == 3


def test_a_report_without_kernels_says_none_not_zero(tmp_path: Path, monkeypatch) -> None:
    """CPU ranks launch no CUDA kernel: the export has no kernel table, and the counts are unknown (None)."""
    db = _export(tmp_path / "c.sqlite", _rank_events(777, 0, steps=2))
    monkeypatch.setattr(nsys_reports, "export_sqlite", lambda nsys, report: db)
    [cap] = nsys_reports.read_capture("nsys", tmp_path / "c.nsys-rep").values()
    assert (cap.kernels, cap.nccl_kernels) == (None, None)


def test_a_rank_capture_as_a_record_holds_every_field() -> None:
    cap = nsys_reports.RankCapture(rank=3, report="c.nsys-rep", ranges=9, windows=1, window_s=0.5, steps_total=4,
                                   steps_in_window=3, phases={"forward": {"count": 3, "total_s": 0.1}}, kernels=12,
                                   nccl_kernels=2)
    assert cap.as_dict() == {"rank": 3, "report": "c.nsys-rep", "ranges": 9, "windows": 1, "window_s": 0.5,
                             "steps_total": 4, "steps_in_window": 3, "phases": {"forward": {"count": 3, "total_s": 0.1}},
                             "kernels": 12, "nccl_kernels": 2}


class _Run:
    """A stand-in for ``subprocess.run``: records each call and answers with ``returncode``/``stdout``/``stderr``;
    ``writes`` is created first, as nsys's export would."""

    def __init__(self, returncode: int = 0, stdout: str = "", stderr: str = "", writes: Path | None = None) -> None:
        self.calls: list[tuple[list[str], dict]] = []
        self.result = subprocess.CompletedProcess([], returncode, stdout, stderr)
        self.writes = writes

    def __call__(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        self.calls.append((argv, kwargs))
        if self.writes is not None:
            self.writes.write_text("")
        return self.result


def test_the_export_runs_nsys_once_with_its_arguments_and_reuses_the_file(tmp_path: Path, monkeypatch) -> None:
    report = tmp_path / "cell-node0.nsys-rep"
    run = _Run(writes=tmp_path / "cell-node0.sqlite")
    monkeypatch.setattr(nsys_reports.subprocess, "run", run)
    assert nsys_reports.export_sqlite("/opt/nsys", report) == tmp_path / "cell-node0.sqlite"
    assert run.calls == [(["/opt/nsys", "export", "--type", "sqlite", "--force-overwrite", "true", "--output",
                           str(tmp_path / "cell-node0.sqlite"), str(report)],
                          {"capture_output": True, "text": True, "timeout": 300.0})]
    assert nsys_reports.export_sqlite("/opt/nsys", report, timeout_s=5.0) == tmp_path / "cell-node0.sqlite"
    assert len(run.calls) == 1, "an existing export is reused, not redone"


def test_a_failed_export_says_its_exit_and_last_line(tmp_path: Path, monkeypatch) -> None:
    report = tmp_path / "c.nsys-rep"
    monkeypatch.setattr(nsys_reports.subprocess, "run", _Run(returncode=3, stderr="reading\nimporting\nimporter crashed\n"))
    with pytest.raises(RuntimeError, match=f"^nsys export of {report} failed \\(exit 3\\): importer crashed$"):
        nsys_reports.export_sqlite("nsys", report, timeout_s=1.0)
    # exit 0 but no file written: the last line of stdout when stderr is empty, "no output" when both are
    monkeypatch.setattr(nsys_reports.subprocess, "run", _Run(stdout="Processing\nno events\n"))
    with pytest.raises(RuntimeError, match=r"\(exit 0\): no events$"):
        nsys_reports.export_sqlite("nsys", report)
    monkeypatch.setattr(nsys_reports.subprocess, "run", _Run())
    with pytest.raises(RuntimeError, match=r"\(exit 0\): no output$"):
        nsys_reports.export_sqlite("nsys", report)


def test_stats_reports_are_asked_of_nsys_with_a_time_limit(monkeypatch) -> None:
    run = _Run(stdout="  nvtx_sum[:base] -- NVTX Range Summary\n  osrt_sum -- OS Runtime Summary\n")
    monkeypatch.setattr(nsys_reports.subprocess, "run", run)
    assert nsys_reports.stats_report_names("/x/nsys") == {"nvtx": "nvtx_sum"}, "no kernel summary known: none named"
    assert run.calls == [(["/x/nsys", "stats", "--help-reports"], {"capture_output": True, "text": True, "timeout": 60})]
    assert nsys_reports.stats_command("/x/nsys", "nvtx_sum", Path("/r/c.nsys-rep")) == [
        "/x/nsys", "stats", "--quiet", "--report", "nvtx_sum", "--format", "column", "--output", "-", "/r/c.nsys-rep"]


def test_ranges_of_either_kind_without_a_thread_and_a_window_ending_with_its_last_step(tmp_path: Path) -> None:
    """By hand: a push/pop range and a start/end range both count; a range whose thread nsys did not record has pid
    0; a step ending exactly where the window ends is inside it; an export whose enum lacks the domain event kind
    has no harness domain to read."""
    events = [(0, None, 75, "harness", _tid(9), None, 1, None, None),
              (100, 200, 59, "step", _tid(9), None, 1, 0, None),  # push/pop
              (200, 300, 60, None, _tid(9), 437, 1, 1, None),  # start/end, registered string, ends with the window
              (100, 300, 60, None, _tid(9), 438, 1, 0, None),
              (150, 160, 59, "forward", None, None, 1, None, 7)]  # no thread recorded; unsigned payload
    ranges = read_ranges(_export(tmp_path / "c.sqlite", events))
    assert [(r.name, r.start_ns, r.end_ns, r.payload, r.pid) for r in ranges] == [
        ("step", 100, 200, 0, 9), ("window", 100, 300, 0, 9), ("forward", 150, 160, 7, 0), ("step", 200, 300, 1, 9)]
    cap = summarize(5, "c.nsys-rep", [r for r in ranges if r.pid == 9], kernels=(4, 1))
    assert cap.as_dict() == {"rank": 5, "report": "c.nsys-rep", "ranges": 3, "windows": 1,
                             "window_s": pytest.approx(200e-9), "steps_total": 2, "steps_in_window": 2, "phases": {},
                             "kernels": 4, "nccl_kernels": 1}
    none = summarize(0, "d.nsys-rep", [])
    assert (none.windows, none.window_s, none.steps_in_window, none.ranges) == (0, None, 0, 0)
    no_domain_kind = tmp_path / "old.sqlite"
    _export(no_domain_kind, events)
    con = sqlite3.connect(no_domain_kind)
    con.execute("DELETE FROM ENUM_NSYS_EVENT_TYPE WHERE name = 'NvtxDomainCreate'")
    con.commit()
    con.close()
    assert read_ranges(no_domain_kind) == []


def test_read_capture_exports_the_report_it_is_given_and_counts_a_kernel_less_rank_as_zero(tmp_path: Path,
                                                                                            monkeypatch) -> None:
    """Rank 0 (pid 777, 2 steps) launched no kernel while rank 1 (pid 4242, 3 steps) launched two, one with a name
    the export did not keep (not NCCL's): with a kernel table present, rank 0's counts are 0, not unknown."""
    db = _export(tmp_path / "c.sqlite", _rank_events(4242, 1, steps=3) + _rank_events(777, 0, steps=2))
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (globalPid INTEGER, shortName INTEGER)")
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?)", [(_tid(4242), 437), (_tid(4242), 999)])
    con.commit()
    con.close()
    asked = []
    monkeypatch.setattr(nsys_reports, "export_sqlite", lambda nsys, report: asked.append((nsys, report)) or db)
    report = tmp_path / "cell-node0.nsys-rep"
    caps = nsys_reports.read_capture("/opt/nsys", report)
    assert asked == [("/opt/nsys", report)]
    assert {r: (c.rank, c.report, c.steps_in_window, c.kernels, c.nccl_kernels) for r, c in caps.items()} == {
        1: (1, "cell-node0.nsys-rep", 3, 2, 0), 0: (0, "cell-node0.nsys-rep", 2, 0, 0)}


def test_no_window_at_all_names_where_to_look() -> None:
    assert capture_problem({}, range(1), 1) == (
        "no 'harness' NVTX window was recorded for any rank, so the timeline has no steps; check the record's "
        "metrics.nvtx (an nvtx package that nsys disabled: pip install 'nvtx<0.2.12' if the harness could not open "
        "the domain itself) and nsys's own output in the cell's logs")
