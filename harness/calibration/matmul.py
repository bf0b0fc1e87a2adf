"""Measured matmul peak (MAMF-style): the best TFLOP/s over a search of GEMM shapes.

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
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import torch

from harness.calibration import steadiness, store
from harness.calibration.provenance import label_of
from harness.records.env import cpu_model
from harness.spec import threads_per_rank

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_REP_S = 0.5
"""A shape whose one product would take longer than this (at the best rate so far) is not timed:
bigger ones will not be faster (e.g. fp16 on a CPU without native support)."""
MATMUL_CALIBRATION_VERSION = 2
"""2: the coarse grid + hill-climb search (version 1 timed five fixed shapes). Older entries are re-measured."""


@dataclass(frozen=True)
class SearchPlan:
    """Which GEMM shapes the search times (the maximum-achievable-matmul method, Bekman's MAMF finder).

    Every (m, n, k) of the coarse grid ``dims`` x ``dims`` x ``dims`` first, smallest product
    first; then a hill climb from the best shape, one ``step`` along one axis at a time, until
    no neighbour is faster or ``climbs`` moves were made. Peaks sit at shapes the tile sizes
    divide (multiples of 256 on GPUs), not only at powers of two.
    """

    dims: tuple[int, ...]
    step: int
    climbs: int
    reference: tuple[int, int, int]
    """The plain square product every calibration also reports (``reference_tflops``)."""
    warm_s: float
    """Seconds of back-to-back products of the reference shape first (GPU clocks ramp up under load)."""
    repeats: int
    """Timing windows per shape; a shape's rate is their median."""


GPU_PLAN = SearchPlan(dims=(1024, 2048, 4096, 8192, 16384), step=256, climbs=12, reference=(8192, 8192, 8192),
                      warm_s=3.0, repeats=5)
CPU_PLAN = SearchPlan(dims=(256, 512, 1024), step=128, climbs=4, reference=(1024, 1024, 1024), warm_s=0.0,
                      repeats=2)

Shape = tuple[int, int, int]


def flops(shape: Shape) -> int:
    m, n, k = shape
    return 2 * m * n * k


def neighbours(shape: Shape, step: int, top: int) -> list[Shape]:
    """The shapes one ``step`` away along one axis, inside [step, top]."""
    out = []
    for axis in range(3):
        for d in (-step, step):
            s = list(shape)
            s[axis] += d
            if step <= s[axis] <= top:
                out.append((s[0], s[1], s[2]))
    return out


def search(rate: Callable[[Shape], float], plan: SearchPlan, max_rep_s: float = MAX_REP_S) -> dict:
    """The fastest shape and what was measured on the way; ``rate(shape)`` is TFLOP/s.

    Pure apart from ``rate``, so the search itself is testable with a synthetic landscape. A
    shape whose product would take more than ``max_rep_s`` at the best rate so far is skipped.
    """
    measured: dict[Shape, float] = {}

    def get(shape: Shape) -> float | None:
        if shape not in measured:
            best = max(measured.values(), default=None)
            if best is not None and flops(shape) / (best * 1e12) > max_rep_s:
                return None
            measured[shape] = rate(shape)
        return measured[shape]

    for shape in sorted(product(plan.dims, plan.dims, plan.dims), key=lambda s: (flops(s), s)):
        get(shape)
    best = max(measured, key=measured.__getitem__)
    top = max(plan.dims)
    for _ in range(plan.climbs):
        for shape in neighbours(best, plan.step, top):
            get(shape)
        nxt = max(measured, key=measured.__getitem__)
        if nxt == best:
            break
        best = nxt
    shapes = [{"m": m, "n": n, "k": k, "tflops": t} for (m, n, k), t in measured.items()]
    return {"tflops": measured[best], "median_tflops": statistics.median(measured.values()),
            "best_shape": list(best), "shapes": shapes}


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
        "version": MATMUL_CALIBRATION_VERSION,
    }


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def time_windows(fn: Callable[[], object], cuda: bool, min_time_s: float, repeats: int = 1,
                 max_reps: int = 1 << 12) -> list[float]:
    """Seconds per call of ``fn`` in each of ``repeats`` windows of at least ``min_time_s`` (the caller keeps the
    median): one call first (warmup; for a matmul it also selects the kernel), then the window grown by doubling."""
    fn()
    reps = 1
    while True:  # grow the window until it is long enough to time
        _sync(cuda)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(cuda)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time_s or reps >= max_reps:
            break
        reps *= 2
    windows = [elapsed / reps]
    for _ in range(repeats - 1):
        _sync(cuda)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(cuda)
        windows.append((time.perf_counter() - t0) / reps)
    return windows


def _time_matmul(a: torch.Tensor, b: torch.Tensor, cuda: bool, min_time_s: float, repeats: int = 1) -> list[float]:
    """Seconds per product in each of ``repeats`` windows of at least ``min_time_s`` (the caller keeps the median)."""
    return time_windows(lambda: torch.matmul(a, b), cuda, min_time_s, repeats)


def _warm(dev: torch.device, tdtype: torch.dtype, shape: Shape, seconds: float, cuda: bool) -> None:
    if seconds <= 0:
        return
    m, n, k = shape
    a, b = torch.randn(m, k, device=dev, dtype=tdtype), torch.randn(k, n, device=dev, dtype=tdtype)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.matmul(a, b)
        _sync(cuda)


def measure(device_kind: str, dtype: str, plan: SearchPlan | None = None, min_time_s: float = 0.05) -> dict:
    """Search GEMM shapes (:func:`search`); the max, the median over shapes, the best shape, every
    shape's rate and timing windows, and the plain reference square's rate timed in the same run.
    ``repeats`` holds the best shape's windows: the spread the peak is judged by
    (:mod:`harness.calibration.steadiness`)."""
    cuda = device_kind == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    tdtype = DTYPES[dtype]
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    plan = plan or (GPU_PLAN if cuda else CPU_PLAN)
    windows: dict[Shape, list[float]] = {}

    def rate(shape: Shape) -> float:
        m, n, k = shape
        a = torch.randn(m, k, device=dev, dtype=tdtype)
        b = torch.randn(k, n, device=dev, dtype=tdtype)
        windows[shape] = _time_matmul(a, b, cuda, min_time_s, plan.repeats)
        del a, b
        return flops(shape) / statistics.median(windows[shape]) / 1e12

    _warm(dev, tdtype, plan.reference, plan.warm_s, cuda)
    out = search(rate, plan)
    for s in out["shapes"]:
        s["windows_s"] = windows[(s["m"], s["n"], s["k"])]
    best = tuple(out["best_shape"])
    out["repeats"] = {f"best shape {'x'.join(map(str, best))}": windows[best]}
    hit = [s["tflops"] for s in out["shapes"] if (s["m"], s["n"], s["k"]) == plan.reference]
    out["reference_shape"] = list(plan.reference)
    out["reference_tflops"] = hit[0] if hit else None  # None: too slow to time here (see MAX_REP_S)
    out["search"] = {"dims": list(plan.dims), "step": plan.step, "climbs": plan.climbs, "repeats": plan.repeats,
                     "warm_s": plan.warm_s, "min_time_s": min_time_s}
    return out


def threads_for(device_kind: str, local_world: int) -> int:
    """The thread count a rank runs with: :func:`threads_per_rank` on CPU, 0 on GPU (not a key there)."""
    return threads_per_rank(local_world) if device_kind == "cpu" else 0


def lookup(device_kind: str, dtype: str, threads: int, cache: Path | None = None) -> dict | None:
    return store.get("matmul", fingerprint(device_kind, dtype, threads), cache)


def calibrate(device_kind: str, dtype: str, threads: int, cache: Path | None = None, force: bool = False) -> dict:
    """Measure (or reuse the stored) matmul peak for this device, dtype and thread count; measured
    again once when the best shape's windows disagree (:func:`steadiness.measure_steadily`)."""
    if not force:
        hit = lookup(device_kind, dtype, threads, cache)
        if hit is not None:
            return hit
    if device_kind == "cpu":
        torch.set_num_threads(threads)
    fp = fingerprint(device_kind, dtype, threads)

    def once() -> dict:
        return {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **measure(device_kind, dtype)}

    return store.put("matmul", fp, steadiness.measure_steadily(once, label_of("matmul", fp),
                                                                 prefer=lambda e: -e["tflops"]), cache)
