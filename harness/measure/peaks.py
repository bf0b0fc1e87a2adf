"""Datasheet peak TFLOP/s per device and compute dtype (dense, no sparsity).

Sources: NVIDIA H200 / H100 / A100 datasheets. Sparse figures are halved to dense. An unknown
device or dtype gives ``None`` plus the reason, never another chip's peak.
"""

from __future__ import annotations

# (name substring, peaks by compute dtype); first match wins, so specific names come first.
_TABLE: list[tuple[str, dict[str, float]]] = [
    # MLE's TFLOPS table (stas00/ml-engineering compute/accelerator/README.md): "NVIDIA B200 SXM | 80.0 | 1125.0 | 2250
    # | 2250 | 4500", the DGX B200 datasheet's figures
    ("B200", {"fp32": 80.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}),
    ("H200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.5, "fp16": 989.5, "fp8": 1978.9}),
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0}),
    ("H100", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.5, "fp16": 989.5, "fp8": 1978.9}),  # SXM5 (HBM3)
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
]


def datasheet_peaks(device_name: str) -> dict[str, float] | None:
    """The dense peaks by compute dtype of the first table entry ``device_name`` contains, or None."""
    for key, peaks in _TABLE:
        if key in device_name:
            return dict(peaks)
    return None


def datasheet_peak_tflops(device_name: str | None, dtype: str, device_kind: str) -> tuple[float | None, str | None]:
    """``(peak, None)`` or ``(None, reason)``."""
    if device_kind != "cuda":
        return None, f"n/a: no datasheet peak for CPU ({device_name or 'unknown model'}); see mfu_calibrated_pct"
    peaks = datasheet_peaks(device_name) if device_name else None
    if peaks is not None:
        if dtype in peaks:
            return peaks[dtype], None
        return None, f"n/a: no datasheet peak for {dtype} on {device_name}"
    return None, f"n/a: device {device_name!r} is not in the datasheet table (harness/measure/peaks.py)"


def mfu_pct(tflops_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in percent: achieved model TFLOP/s over the peak."""
    return None if peak is None or peak <= 0 else 100.0 * tflops_per_device / peak
