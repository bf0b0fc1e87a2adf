"""How far a calibration's repeats spread: the evidence behind ``steadiness.MAX_SPREAD``.

    .venv/bin/python scripts/calibration_spread.py --runs 4 -- --workloads tiny --threads 2
    .venv/bin/python scripts/calibration_spread.py --runs 4 -- --workloads tiny --threads 1 --concurrent 2
    .venv/bin/python scripts/calibration_spread.py --runs 2 --hog 1 -- --workloads tiny --threads 2

Runs ``harness calibrate --device cpu --dtype fp32 --no-comm ARGS`` RUNS times, each into a
fresh store and with the spread limit lifted (every first measurement is kept, none repeated).
With ``--quiet`` (the default) each run waits until other processes have used less than
QUIET_CPU cores for QUIET_S seconds in a row; the CPU other processes used while it ran is
sampled once a second and printed, so a run the machine did not leave alone shows as such.
``--hog N`` starts N busy-looping processes beside each calibration (a neighbour holding cores).
Prints per run the worst probe's ``max / min`` of the matmul and the workload entry, and each
workload probe's spread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
UNLIMITED = ("import sys; from harness.calibration import steadiness; steadiness.MAX_SPREAD = float('inf'); "
             "from harness.cli import main; sys.exit(main(sys.argv[1:]))")


class OthersCpu:
    """Cores other processes (not this one or its children) used since the last :meth:`sample`."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.seen: dict[int, float] = {}

    def sample(self) -> float:
        mine = {self.me.pid} | {c.pid for c in self.me.children(recursive=True)}
        used = 0.0
        for p in psutil.process_iter():
            if p.pid in mine:
                continue
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            v = t.user + t.system
            used += v - self.seen.get(p.pid, v)
            self.seen[p.pid] = v
        return used


def wait_quiet(cpu: float, seconds: int, limit_s: float) -> float | None:
    """Seconds waited until others used < ``cpu`` cores for ``seconds`` in a row; None past ``limit_s``."""
    others, calm, t0 = OthersCpu(), 0, time.time()
    others.sample()
    while time.time() - t0 < limit_s:
        time.sleep(1.0)
        calm = calm + 1 if others.sample() < cpu else 0
        if calm >= seconds:
            return time.time() - t0
    return None


def calibrate_once(args: list[str], store: Path, hogs: int = 0) -> tuple[int, list[float], dict]:
    """(exit code, others' cores per second while it ran, the store's entries); ``hogs`` busy loops beside it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
    env.update(HARNESS_CALIBRATION=str(store), PYTHONPATH=str(REPO))
    others, samples, done = OthersCpu(), [], threading.Event()

    def watch() -> None:
        others.sample()
        while not done.wait(1.0):
            samples.append(others.sample())

    t = threading.Thread(target=watch, daemon=True)
    hog = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    t.start()
    try:
        r = subprocess.run([sys.executable, "-c", UNLIMITED, "calibrate", "--device", "cpu", "--dtype", "fp32",
                            "--no-comm", *args], cwd=REPO, env=env, capture_output=True, text=True)
    finally:
        for h in hog:
            h.kill()
            h.wait()
        done.set()
        t.join()
    if r.returncode != 0:
        print(r.stderr[-2000:], file=sys.stderr)
    return r.returncode, samples, json.loads(store.read_text()) if store.exists() else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--no-quiet", dest="quiet", action="store_false", help="do not wait for a quiet machine")
    p.add_argument("--quiet-cpu", type=float, default=0.15, help="cores others may use and still count as quiet")
    p.add_argument("--quiet-s", type=int, default=20, help="seconds in a row the machine must be quiet")
    p.add_argument("--max-wait-s", type=float, default=3600.0)
    p.add_argument("--hog", type=int, default=0, help="busy-looping processes beside each calibration")
    p.add_argument("calibrate_args", nargs=argparse.REMAINDER, help="after --: harness calibrate's flags")
    args = p.parse_args()
    extra = [a for a in args.calibrate_args if a != "--"]
    print(f"harness calibrate --device cpu --dtype fp32 --no-comm {' '.join(extra)}; spread = max / min of a "
          f"probe's repeats; {args.hog} busy-looping neighbour(s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="calibration-spread-") as tmp:
        for i in range(args.runs):
            waited = wait_quiet(args.quiet_cpu, args.quiet_s, args.max_wait_s) if args.quiet else 0.0
            rc, others, entries = calibrate_once(extra, Path(tmp) / f"cal{i}.json", args.hog)
            load = f"others (not the hogs) used up to {max(others, default=0.0):.2f} cores while it ran"
            print(f"\nrun {i}: exit {rc}; {'never quiet' if waited is None else f'waited {waited:.0f} s'}; {load}")
            for e in entries.values():
                s = e.get("spread") or {}
                print(f"  {e.get('kind', 'matmul')}: worst {s.get('probe')} {s.get('ratio', float('nan')):.2f}x")
                if e.get("kind") == "workload":
                    for name, ts in e["repeats"].items():
                        print(f"    {name:22s} {max(ts) / min(ts):5.2f}x  ms " + " ".join(f"{t * 1e3:.1f}" for t in ts))
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
