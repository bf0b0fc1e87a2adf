"""Captures in a row, and first captures on fresh installs: how often nsys hangs, and what it costs a cell.

    .venv/bin/python scripts/nsys_soak.py --fresh 10 --warm 30 --out results/reference/nsys-hang

``--fresh N``: N times, Nsight Systems removed with its state (``apt-get purge`` of both packages, the
importer link, ``~/.nsightsystems``, ``/tmp/nvidia``, the agents' ``/dev/shm`` files), installed again
with ``make setup-nsys`` (root, Debian/Ubuntu), then one ``harness trace`` of the 2-rank CPU cell.
``--warm N``: N consecutive captures of the same cell. ``--big``: one capture of a larger cell too
(4 ranks, 30 steps), for the healthy report wait at a bigger report. ``--hog``: a busy loop on one core
beside every capture. Each second, the agent's CPU seconds and bytes read and written are sampled: a
capture's ``agent_quiet_s`` is the longest stretch its agent spent without I/O after the ranks ended
(``agent_cpu_s`` its CPU time then). Every capture's outcome (status,
``metrics.nsys`` attempts, the seconds the capture added after rank 0 was done) is appended to
``captures.jsonl`` as it lands; ``summary.md`` is written from those lines at the end.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.records.atomic import write_text_atomic  # noqa: E402

CELL = ["--device", "cpu", "--gpus", "2", "--sizes", "tiny", "--strategies", "ddp", "--batch", "8", "--steps", "5",
        "--warmup", "1", "--cell", "tiny-ddp-fp32-w2-gb8-strong"]
BIG = ["--device", "cpu", "--gpus", "4", "--sizes", "tiny", "--strategies", "fsdp", "--batch", "16", "--steps", "30",
       "--warmup", "1", "--cell", "tiny-fsdp-fp32-w4-gb16-strong"]
STATE = ("~/.nsightsystems", "/tmp/nvidia", "/dev/shm/quadd*")


def _remove_nsys() -> None:
    """Both packages purged, the importer link setup-nsys made, and what nsys keeps between sessions."""
    nsys = shutil.which("nsys")
    if nsys is not None:
        link = Path(os.path.realpath(nsys)).parent.parent / "host-linux-x64"
        if link.is_symlink():
            link.unlink()
    subprocess.run(["apt-get", "purge", "-y", "-q", "nsight-systems", "nsight-systems-target"], check=True,
                   capture_output=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    for pattern in STATE:
        for path in glob.glob(os.path.expanduser(pattern)):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                Path(path).unlink(missing_ok=True)
    assert shutil.which("nsys") is None, "nsys is still on PATH after the purge"


def _install_nsys() -> float:
    t0 = time.monotonic()
    subprocess.run(["make", "setup-nsys"], cwd=REPO, check=True, capture_output=True)
    return time.monotonic() - t0


def _watch_agents(stop: threading.Event, samples: list) -> None:
    """Every second: each nsys agent's pid, CPU seconds and bytes read + written so far."""
    while not stop.wait(1.0):
        row = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if "--start-agent" in (proc.info.get("cmdline") or []):
                try:
                    io, cpu = proc.io_counters(), proc.cpu_times()
                    row.append((proc.info["pid"], round(cpu.user + cpu.system, 1), io.read_chars + io.write_chars))
                except psutil.Error:
                    continue
        samples.append((time.monotonic(), row))


def _agent_quiet(samples: list) -> tuple[float, float]:
    """The longest stretch (s) an agent did no I/O while burning CPU, and the CPU seconds it burnt then."""
    last: dict[int, tuple[float, float, int]] = {}
    start: dict[int, tuple[float, float]] = {}
    quiet, cpu_then = 0.0, 0.0
    for t, row in samples:
        for pid, cpu, io in row:
            if pid in last and io == last[pid][2] and cpu > last[pid][1]:
                t0, c0 = start.setdefault(pid, (last[pid][0], last[pid][1]))
                if t - t0 > quiet:
                    quiet, cpu_then = t - t0, cpu - c0
            else:
                start.pop(pid, None)
            last[pid] = (t, cpu, io)
    return round(quiet, 1), round(cpu_then, 1)


def _capture(kind: str, index: int, cell: list[str], hog: bool = False) -> dict:
    stop, samples = threading.Event(), []
    watcher = threading.Thread(target=_watch_agents, args=(stop, samples), daemon=True)
    watcher.start()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if hog else None
    try:
        row = _one_capture(kind, index, cell)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        stop.set()
        watcher.join()
    row["agent_quiet_s"], row["agent_cpu_s"] = _agent_quiet(samples)
    row["hog"] = hog
    return row


def _one_capture(kind: str, index: int, cell: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="nsys-soak-") as tmp:
        out = Path(tmp) / "run"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
        env.update(PYTHONPATH=str(REPO), HARNESS_FORCE_CPU="1", HARNESS_CALIBRATION=str(Path(tmp) / "cal.json"))
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "harness", "trace", *cell, "--tracer", "nsys",
                              "--cell-timeout", "300", "--out", str(out)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=900)
        wall = time.monotonic() - t0
        recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()] \
            if (out / "records.jsonl").exists() else []
    rec = next((r for r in recs if r.get("kind") == "cell"), None)
    nsys = (rec or {}).get("metrics", {}).get("nsys") or {}
    attempts = nsys.get("attempts", [])
    added = (attempts[0]["report_wait_s"] + sum(a["wall_s"] for a in attempts[1:])) if attempts else None
    return {"kind": kind, "index": index, "cell": cell[cell.index("--cell") + 1], "exit": res.returncode,
            "status": rec["status"] if rec else None, "problem": nsys.get("problem"),
            "hung": [a["hung"] for a in attempts], "report_wait_s": [a["report_wait_s"] for a in attempts],
            "seconds_lost": nsys.get("seconds_lost"), "cleared": [a.get("cleared", []) for a in attempts], "added_s": added, "cell_wall_s": round(wall, 1),
            "tool": nsys.get("tool")}


def _longest(rows: list[dict], hung: bool) -> str:
    quiet = [r["agent_quiet_s"] for r in rows if any(r["hung"]) == hung and r.get("agent_quiet_s") is not None]
    return f"{max(quiet):g}" if quiet else "n/a"


def _summary(rows: list[dict], command: str) -> str:
    lines = ["# nsys captures: hangs, retries and the time a capture added", "", f"    {command}", "",
             "| kind | captures | report read back | hung once, recovered | hung twice | cell timeout | "
             "healthy report wait s (median / max) | longest time a capture added s | agent at CPU without I/O, "
             "longest s (hung / healthy captures) |", "|---|---|---|---|---|---|---|---|---|"]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        rs = [r for r in rows if r["kind"] == kind]
        healthy = sorted(w for r in rs for w, h in zip(r["report_wait_s"], r["hung"], strict=True) if not h)
        added = [r["added_s"] for r in rs if r["added_s"] is not None]
        lines.append(
            f"| {kind} | {len(rs)} | {sum(r['problem'] is None and r['status'] == 'ok' for r in rs)} | "
            f"{sum(r['hung'][:1] == [True] and r['problem'] is None for r in rs)} | "
            f"{sum(r['hung'] == [True, True] for r in rs)} | {sum(r['status'] == 'timeout' for r in rs)} | "
            f"{healthy[len(healthy) // 2] if healthy else 'n/a'} / {max(healthy) if healthy else 'n/a'} | "
            f"{max(added) if added else 'n/a'} | {_longest(rs, True)} / {_longest(rs, False)} |")
    tools = sorted({r["tool"] for r in rows if r["tool"]})
    lines += ["", f"nsys: {', '.join(tools) or 'none recorded'}. Each capture's line: captures.jsonl "
              "(`hung` and `report_wait_s` per attempt; `added_s` = the first attempt's wait after rank 0 was done "
              "plus the retry's whole run)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh", type=int, default=0, help="first captures, each on a fresh install of nsys (root)")
    ap.add_argument("--warm", type=int, default=0, help="consecutive captures on the installed nsys")
    ap.add_argument("--big", action="store_true", help="one capture of a 4-rank, 30-step cell as well")
    ap.add_argument("--hog", action="store_true", help="a busy loop on one core beside every capture")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.fresh and os.geteuid() != 0:
        print("nsys_soak: --fresh reinstalls nsys with apt-get and needs root; run as root or drop --fresh",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    lines = args.out / "captures.jsonl"
    if lines.exists():
        print(f"nsys_soak: {lines} exists; nothing measured is overwritten: give another --out", file=sys.stderr)
        return 2
    plan = [("fresh", i, CELL) for i in range(args.fresh)] + [("warm", i, CELL) for i in range(args.warm)]
    plan += [("big", 0, BIG)] if args.big else []
    rows = []
    for kind, i, cell in plan:
        if kind == "fresh":
            _remove_nsys()
            installed_s = _install_nsys()
        row = _capture(kind, i, cell, args.hog)
        if kind == "fresh":
            row["install_s"] = round(installed_s, 1)
        rows.append(row)
        with open(lines, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    command = "python scripts/nsys_soak.py " + " ".join(sys.argv[1:])
    write_text_atomic(args.out / "summary.md", _summary(rows, command))
    print(_summary(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
