"""The write and read bandwidth of the filesystem a run writes its checkpoints to.

A cell that checkpoints saves into its run directory; the model prices a save at the bandwidth measured here (a
file of :data:`PROBE_BYTES` written in chunks and ``fsync``-ed, then read back, :data:`REPEATS` times), kept in the
calibration store under the filesystem's mount point and type, so another disk is measured again. The read goes
through the page cache the write just filled, as a restore soon after a save does; the write is what a save waits
for.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path

import psutil

from harness.calibration import steadiness, store
from harness.calibration.provenance import label_of

PROBE_BYTES = 64 * 2**20
CHUNK_BYTES = 4 * 2**20
REPEATS = 3


def filesystem_of(path: Path) -> dict[str, str]:
    """The mount point and filesystem type holding ``path`` (its deepest mount), and this host."""
    path = path.resolve()
    mounts = [p for p in psutil.disk_partitions(all=True) if path.is_relative_to(p.mountpoint)]
    best = max(mounts, key=lambda p: len(p.mountpoint), default=None)
    return {"host": socket.gethostname(), "mount": best.mountpoint if best else "/",
            "fstype": best.fstype if best else "unknown"}


def fingerprint(run_dir: Path) -> dict[str, str]:
    return {"device_kind": "storage", **filesystem_of(run_dir)}


def measure(run_dir: Path, nbytes: int = PROBE_BYTES) -> dict:
    """Seconds to write ``nbytes`` (fsync-ed) and read them back under ``run_dir``, :data:`REPEATS` times."""
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / f".storage-probe-{os.getpid()}"
    chunk = os.urandom(CHUNK_BYTES)
    writes, reads = [], []
    try:
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            with probe.open("wb") as f:
                for _ in range(nbytes // CHUNK_BYTES):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with probe.open("rb") as f:
                while f.read(CHUNK_BYTES):
                    pass
            reads.append(time.perf_counter() - t0)
            probe.unlink()
    finally:
        probe.unlink(missing_ok=True)
    return {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "bytes": nbytes,
            "write_gbps": nbytes / statistics.median(writes) / 1e9, "read_gbps": nbytes / statistics.median(reads) / 1e9,
            "repeats": {"write": writes, "read": reads}}


def lookup(run_dir: Path, cache: Path | None = None) -> dict | None:
    return store.get("storage", fingerprint(run_dir), cache)


def calibrate(run_dir: Path, cache: Path | None = None, force: bool = False) -> dict:
    """The stored bandwidth of ``run_dir``'s filesystem, or measured now (again once when unsteady)."""
    hit = None if force else lookup(run_dir, cache)
    if hit is not None:
        return hit
    fp = fingerprint(run_dir)
    return store.put("storage", fp, steadiness.measure_steadily(lambda: measure(run_dir), label_of("storage", fp)),
                     cache)
