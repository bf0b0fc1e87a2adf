"""Measured matmul peak (MAMF-style): the best TFLOP/s over a sweep of GEMM shapes.

``harness calibrate`` runs it per device and dtype and keeps the result in the calibration
store (:mod:`harness.calibration.store`) under a fingerprint (device, dtype, torch version,
CPU threads), so a changed machine is re-measured, not reused.
Calibrated MFU divides achieved model TFLOP/s by this number: on CPU, the one MFU that means
something; on GPU, what the chip really sustains (Bekman's MAMF finder).
"""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

import torch

from harness.calibration import store
from harness.records.env import cpu_model
from harness.spec import threads_per_rank

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_SHAPES = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (1024, 4096, 1024)]
MAX_REP_S = 0.5
"""Stop growing the shapes once one product takes this long: bigger ones will not be faster."""
GPU_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 16384, 4096), (16384, 8192, 4096), (8192, 8192, 16384)]


def device_name(device_kind: str) -> str:
    if device_kind == "cuda":
        return torch.cuda.get_device_name()
    return cpu_model()


def fingerprint(device_kind: str, dtype: str, threads: int) -> dict:
    return {
        "device_kind": device_kind,
        "device_name": device_name(device_kind),
        "dtype": dtype,
        "torch": torch.__version__,
        "threads": threads if device_kind == "cpu" else None,
        "machine": platform.machine(),
    }


def _time_matmul(a: torch.Tensor, b: torch.Tensor, cuda: bool, min_time_s: float) -> float:
    torch.matmul(a, b)  # warmup (also selects the kernel)
    reps, elapsed = 1, 0.0
    while True:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time_s or reps >= 1 << 12:
            return elapsed / reps
        reps *= 2


def measure(device_kind: str, dtype: str, shapes: list[tuple[int, int, int]] | None = None, min_time_s: float = 0.05) -> dict:
    """Sweep GEMM shapes (m, n, k); return the max and median TFLOP/s and every shape's result."""
    cuda = device_kind == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    tdtype = DTYPES[dtype]
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    shapes = shapes or (GPU_SHAPES if cuda else CPU_SHAPES)
    results = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev, dtype=tdtype)
        b = torch.randn(k, n, device=dev, dtype=tdtype)
        t = _time_matmul(a, b, cuda, min_time_s)
        results.append({"m": m, "n": n, "k": k, "tflops": 2 * m * n * k / t / 1e12})
        del a, b
        if t > MAX_REP_S:
            break  # a slow dtype on this device (e.g. fp16 on a CPU without native support)
    best = max(results, key=lambda r: r["tflops"])
    return {"tflops": best["tflops"], "median_tflops": statistics.median(r["tflops"] for r in results),
            "best_shape": [best["m"], best["n"], best["k"]], "shapes": results}


def threads_for(device_kind: str, local_world: int) -> int:
    """The thread count a rank runs with: :func:`threads_per_rank` on CPU, 0 on GPU (not a key there)."""
    return threads_per_rank(local_world) if device_kind == "cpu" else 0


def lookup(device_kind: str, dtype: str, threads: int, cache: Path | None = None) -> dict | None:
    return store.get("matmul", fingerprint(device_kind, dtype, threads), cache)


def calibrate(device_kind: str, dtype: str, threads: int, cache: Path | None = None, force: bool = False) -> dict:
    """Measure (or reuse the stored) matmul peak for this device, dtype and thread count."""
    if not force:
        hit = lookup(device_kind, dtype, threads, cache)
        if hit is not None:
            return hit
    if device_kind == "cpu":
        torch.set_num_threads(threads)
    fp = fingerprint(device_kind, dtype, threads)
    entry = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **measure(device_kind, dtype)}
    return store.put("matmul", fp, entry, cache)
