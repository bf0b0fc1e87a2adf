"""What a sweep needs calibrated before it runs, measured once and kept in the calibration store.

``harness bench`` calls :func:`ensure_calibrated`: the matmul peak per compute dtype and
thread count (calibrated MFU), the workload passes per size (the model's compute), and the
collective bus bandwidth per rank count (the model's communication). Each child calibration
is a :func:`harness.jobs.run_job` of ``python -m harness calibrate``, so Ctrl-C or a crash
leaves no process behind. A failed workload calibration warns, and the sweep goes on.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from harness.calibration import matmul
from harness.calibration.collectives import COMM_MAX_BYTES, COMM_MIN_BYTES, calibrate_comm
from harness.calibration.workload import lookup_workload
from harness.jobs import run_job
from harness.spec import SweepSpec, threads_per_rank
from workloads.sizes import get_size

CHILD_TIMEOUT_S = 3600.0


def calibrate_in_child(args: list[str]) -> tuple[int | None, str]:
    """``python -m harness calibrate ARGS`` as a job of its own: (exit code or None on timeout, output)."""
    with tempfile.TemporaryDirectory(prefix="harness-calibrate-") as tmp:
        log = Path(tmp) / "calibrate.log"
        rc = run_job([sys.executable, "-m", "harness", "calibrate", *args], log, CHILD_TIMEOUT_S)
        return rc, log.read_text(errors="replace")


def _say(line: str) -> None:
    print(line, flush=True)


def _matmul(spec: SweepSpec, dtypes: list[str]) -> None:
    threads = sorted({threads_per_rank(g) for g in {*spec.gpus, 1}}) if spec.device_kind == "cpu" else [0]
    for dt in dtypes:
        for th in threads:
            if matmul.lookup(spec.device_kind, dt, th) is not None:
                continue
            rc, output = calibrate_in_child(["--device", spec.device_kind, "--dtype", dt, "--threads",
                                             str(max(1, th)), "--no-comm"])
            hit = matmul.lookup(spec.device_kind, dt, th)
            if rc != 0 or hit is None:
                raise RuntimeError(f"calibration of {spec.device_kind} {dt} threads={th} failed "
                                   f"(exit {rc}); output tail:\n{output[-2000:]}")
            _say(f"calibrated {spec.device_kind} {dt} threads={th}: {hit['tflops']:.4g} TFLOP/s matmul peak")


def _workloads(spec: SweepSpec, dtypes: list[str]) -> None:
    # (threads per rank, ranks computing at once) as each device count of the sweep runs them
    runs = sorted({(threads_per_rank(w), w) for w in {*spec.gpus, 1}}) if spec.device_kind == "cpu" else [(0, 1)]
    for name in spec.sizes:
        seq = spec.seq_len or get_size(name).seq_len
        for dt in dtypes:
            for th, k in runs:
                if lookup_workload(spec.device_kind, name, seq, dt, th, k) is not None:
                    continue
                rc, output = calibrate_in_child(["--device", spec.device_kind, "--dtype", dt, "--threads",
                                                 str(max(1, th)), "--no-comm", "--workloads", name, "--seq-len",
                                                 str(seq), "--concurrent", str(k)])
                if rc != 0:  # the sweep goes on; its predictions say what was missing
                    print(f"workload calibration of {name} {dt} threads={th} x {k} failed (exit {rc}); "
                          f"predictions fall back to the matmul peak", file=sys.stderr, flush=True)
                    continue
                _say("calibrated " + output.strip().splitlines()[-1])


def _comm(spec: SweepSpec) -> None:
    for n in sorted({g for w in spec.gpus for g in (w, 2) if w >= 2 and g <= w}):
        e = calibrate_comm(spec.device_kind, n, COMM_MIN_BYTES, COMM_MAX_BYTES)  # reuses a covering entry
        _say(f"comm calibration at {n} ranks ({e['measured_at']}): all_reduce peak busbw "
             f"{e['summary']['all_reduce']['peak_busbw_gbps']:.3g} GB/s, sync cost {e['sync_s'] * 1e3:.2f} ms")


def ensure_calibrated(spec: SweepSpec) -> None:
    """Measure what the sweep's cells need and the store does not hold yet."""
    dtypes = sorted({p for p in spec.precisions if not (p == "tf32" and spec.device_kind != "cuda")})
    _matmul(spec, dtypes)
    _workloads(spec, dtypes)
    _comm(spec)
