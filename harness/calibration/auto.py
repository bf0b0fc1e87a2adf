"""What a sweep needs calibrated before it runs, measured once and kept in the calibration store.

``harness bench`` calls :func:`ensure_calibrated` with the cells it is about to run: the matmul
peak per compute dtype and thread count (calibrated MFU), the workload passes per size (the
model's compute), and the collective bus bandwidth per rank count (the model's communication),
each only where a valid cell needs it. Each child calibration
is a :func:`harness.jobs.run_job` of ``python -m harness calibrate``, so Ctrl-C or a crash
leaves no process behind. A failed workload calibration warns, and the sweep goes on.

A stored matmul or workload entry marked ``unsteady``, or one written before entries kept their
repeats' spread, is measured again, not reused (:func:`harness.calibration.steadiness.why_remeasure`),
and the line on stderr says why; ``force`` (``bench --recalibrate``) measures every entry again.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from harness.calibration import matmul, storage
from harness.calibration.collectives import COMM_MAX_BYTES, COMM_MIN_BYTES, calibrate_comm
from harness.calibration.matmul import threads_for
from harness.calibration.provenance import label_of
from harness.calibration.steadiness import why_remeasure
from harness.calibration.workload import check_fits, lookup_workload, workload_fingerprint
from harness.errors import UsageError
from harness.jobs import run_job
from harness.precision import PrecisionPlan
from harness.spec import SweepSpec
from workloads.sizes import MODULE_ARCH, ModelSize

CHILD_TIMEOUT_S = 3600.0


def calibrate_in_child(args: list[str]) -> tuple[int | None, str]:
    """``python -m harness calibrate ARGS`` as a job of its own: (exit code or None on timeout, output)."""
    with tempfile.TemporaryDirectory(prefix="harness-calibrate-") as tmp:
        log = Path(tmp) / "calibrate.log"
        rc = run_job([sys.executable, "-m", "harness", "calibrate", *args], log, CHILD_TIMEOUT_S)
        return rc, log.read_text(errors="replace")


def _say(line: str) -> None:
    print(line, flush=True)


def _relay(output: str) -> None:
    """The child's own ``calibration: ...`` lines (its repeats disagreed) on this process's stderr."""
    for line in output.splitlines():
        if line.startswith("calibration: "):
            print(line, file=sys.stderr, flush=True)


def _why(entry: dict | None, force: bool) -> str | None:
    """Why an entry is measured now, or None to reuse the stored one."""
    return "--recalibrate given" if force else why_remeasure(entry)


def _again(kind: str, label: str, stored: dict | None, why: str) -> list[str]:
    """The child's ``--force KIND`` when it replaces a stored entry (said on stderr), else nothing."""
    if stored is None:
        return []
    print(f"calibration: {label}: {why}; measuring again", file=sys.stderr, flush=True)
    return ["--force", kind]


def needs(spec: SweepSpec, cells: list) -> tuple[set[tuple[str, int]],
                                                 set[tuple[ModelSize, int, str, int, int, bool]], set[int]]:
    """What the cells to run need: matmul (dtype, threads); workload (size, seq, dtype, threads,
    ranks at once, compiled); comm rank counts. Only valid cells count: a ``--gpus 3`` sweep with no valid
    3-rank cell calibrates no 3-rank collectives."""
    matmuls, workloads, comms = set(), set(), set()
    for c in cells:
        cfg = c.config
        local_world = max(1, cfg.world_size // cfg.nnodes)
        threads = threads_for(spec.device_kind, local_world)
        dtype = PrecisionPlan(cfg.precision).compute_dtype
        if dtype not in matmul.DTYPES:  # fp8: no calibration yet; its prediction and calibrated MFU say n/a
            continue
        matmuls.add((dtype, threads))
        if cfg.arch == MODULE_ARCH:  # a module of your own: its step time is not priced (harness.model.predict)
            continue
        workloads.add((cfg.workload, cfg.seq_len, dtype, threads, local_world if spec.device_kind == "cpu" else 1,
                       cfg.compile))
        if local_world >= 2:
            comms.update({local_world, 2})  # 2 ranks: the group size of every hybrid's inner dimensions
    return matmuls, workloads, comms


def _matmul(spec: SweepSpec, matmuls: set[tuple[str, int]], force: bool = False) -> None:
    for dt, th in sorted(matmuls):
        stored = matmul.lookup(spec.device_kind, dt, th)
        why = _why(stored, force)
        if why is None:
            continue
        again = _again("matmul", label_of("matmul", matmul.fingerprint(spec.device_kind, dt, th)), stored, why)
        rc, output = calibrate_in_child(["--device", spec.device_kind, "--dtype", dt, "--threads", str(max(1, th)),
                                         "--no-comm", *again])
        _relay(output)
        hit = matmul.lookup(spec.device_kind, dt, th)
        if rc != 0 or hit is None:
            raise RuntimeError(f"calibration of {spec.device_kind} {dt} threads={th} failed "
                               f"(exit {rc}); output tail:\n{output[-2000:]}")
        _say(f"calibrated {spec.device_kind} {dt} threads={th}: {hit['tflops']:.4g} TFLOP/s matmul peak")


def _workloads(spec: SweepSpec, workloads: set[tuple[ModelSize, int, str, int, int, bool]], force: bool = False) -> None:
    for size, seq, dt, th, k, compiled in sorted(workloads, key=lambda w: (w[0].key, *w[1:])):
        name = size.key
        stored = lookup_workload(spec.device_kind, name, seq, dt, th, k, compiled=compiled)
        why = _why(stored, force)
        if why is None:
            continue
        try:
            check_fits(size, seq, dt, spec.device_kind, k)
        except UsageError as e:  # never start a calibration that cannot fit (cells run with --force)
            print(f"skipped: {e}", file=sys.stderr, flush=True)
            continue
        fp = workload_fingerprint(spec.device_kind, name, seq, dt, th, k, compiled)
        again = _again("workload", label_of("workload", fp), stored, why)
        with tempfile.TemporaryDirectory(prefix="harness-model-") as tmp:
            rc, output = calibrate_in_child(["--device", spec.device_kind, "--dtype", dt, "--threads", str(max(1, th)),
                                             "--no-comm", *_workload_flags(size, Path(tmp)), "--seq-len", str(seq),
                                             "--concurrent", str(k), *(["--compile"] if compiled else []), *again])
        _relay(output)
        if rc != 0:  # the sweep goes on; its predictions say what was missing
            print(f"workload calibration of {name} {dt} threads={th} x {k}{' compiled' if compiled else ''} failed "
                  f"(exit {rc}); predictions fall back to the "
                  f"{'eager passes' if compiled else 'matmul peak'}", file=sys.stderr, flush=True)
            continue
        _say("calibrated " + output.strip().splitlines()[-1])


def _workload_flags(size: ModelSize, tmp: Path) -> list[str]:
    """How the child names the workload: a built-in size by its key; a config model by its config, written from
    what the model carries into ``tmp`` under its own name (so the child resolves the same name and digest)."""
    if size.origin is None:
        return ["--workloads", size.key]
    path = tmp / f"{size.origin.name}.json"
    path.write_text(size.origin.content)
    return ["--model", str(path), *([] if size.origin.shrink else ["--full-size"])]


def _comm(spec: SweepSpec, comms: set[int], force: bool = False) -> None:
    for n in sorted(comms):
        e = calibrate_comm(spec.device_kind, n, COMM_MIN_BYTES, COMM_MAX_BYTES, force=force)  # reuses a covering entry
        _say(f"comm calibration at {n} ranks ({e['measured_at']}): all_reduce peak busbw "
             f"{e['summary']['all_reduce']['peak_busbw_gbps']:.3g} GB/s, sync cost {e['sync_s'] * 1e3:.2f} ms")


def ensure_calibrated(spec: SweepSpec, cells: list, force: bool = False, run_dir: Path | None = None) -> dict | None:
    """Measure what ``cells`` (the valid cells about to run) need and the store does not hold
    steadily yet; ``force`` (``bench --recalibrate``) measures all of it again. Where a cell checkpoints, the
    write bandwidth of ``run_dir``'s filesystem too: its entry is returned (None without one)."""
    matmuls, workloads, comms = needs(spec, cells)
    _matmul(spec, matmuls, force)
    _workloads(spec, workloads, force)
    _comm(spec, comms, force)
    if run_dir is None or not any(c.config.checkpoint != "off" for c in cells):
        return None
    e = storage.calibrate(run_dir, force=force)
    _say(f"storage calibration of {e['fingerprint']['mount']} ({e['measured_at']}): write {e['write_gbps']:.3g} GB/s, "
         f"read {e['read_gbps']:.3g} GB/s ({e['bytes'] / 2**20:.0f} MiB, fsync-ed)")
    return e
