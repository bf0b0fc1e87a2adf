"""NVML (nvidia-ml-py, module ``pynvml``) sampler for ``harness.measure.monitor.Monitor``.

NVML enumerates every physical GPU and ignores ``CUDA_VISIBLE_DEVICES``, so local CUDA
index ``i`` is mapped through the i-th ``CUDA_VISIBLE_DEVICES`` entry (integer -> NVML
index, ``GPU-<uuid>`` -> ``nvmlDeviceGetHandleByUUID``) and, where torch sees CUDA,
cross-checked against ``torch.cuda.get_device_properties(i).uuid``. A MIG instance is
not sampled (the reason goes to ``note``).

NVLink traffic comes from ``nvmlDeviceGetFieldValues`` with
``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX`` and scopeId ``UINT_MAX``: nvml.h defines the
scope as the link id and UINT_MAX as the sum over all links (scope 0 is link 0 only);
drivers that reject the aggregate get the per-link values summed.

Energy (J) and NVLink traffic (KiB) are cumulative counters: the summary reports their
difference over the window and NVLink rates are derived from consecutive samples.

The helpers it shares with the host sampler come from :mod:`harness.measure.sampling`.
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from harness.measure.sampling import SamplerKind, column_stats, counter_delta
from harness.units import MIB


class NvmlUnavailable(RuntimeError):
    """NVML cannot sample the requested devices; the message is the reason."""


@dataclass(frozen=True)
class NvmlDevice:
    """One sampled GPU: local CUDA index, NVML identity and handle."""

    local_index: int
    uuid: str
    name: str
    handle: Any


NVML_SCOPE_ALL_LINKS = 0xFFFFFFFF  # UINT_MAX: aggregate over all NVLinks (nvml.h)
_FIELD_VALUE_ATTR = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
_GAUGES = ("mem_used_mib", "gpu_util_pct", "mem_util_pct", "power_w", "sm_clock_mhz", "pcie_tx_kb_s", "pcie_rx_kb_s")
_NVLINK = ("nvlink_tx_kib", "nvlink_rx_kib")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _field_value(nvml: Any, handle: Any, field_id: int, scope: int) -> float:
    (value,) = nvml.nvmlDeviceGetFieldValues(handle, [(field_id, scope)])
    if value.nvmlReturn != nvml.NVML_SUCCESS:
        raise nvml.NVMLError(value.nvmlReturn)
    return float(getattr(value.value, _FIELD_VALUE_ATTR[value.valueType]))


def _nvlink_per_link_sum(nvml: Any, handle: Any, field_id: int) -> float:
    links = range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)))
    values = nvml.nvmlDeviceGetFieldValues(handle, [(field_id, link) for link in links])
    ok = [v for v in values if v.nvmlReturn == nvml.NVML_SUCCESS]
    if not ok:
        raise nvml.NVMLError(values[0].nvmlReturn)
    return float(sum(getattr(v.value, _FIELD_VALUE_ATTR[v.valueType]) for v in ok))


def _field_readers(nvml: Any) -> dict[str, list[Callable[[Any], float]]]:
    """Field -> candidate readers (first one that works at probe time is kept), units in names."""
    tx, rx = nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    return {
        "mem_used_mib": [lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used / MIB],
        "gpu_util_pct": [lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu],
        "mem_util_pct": [lambda h: nvml.nvmlDeviceGetUtilizationRates(h).memory],
        "power_w": [lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0],
        "energy_j": [lambda h: nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0],
        "sm_clock_mhz": [lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)],
        "throttle_reasons": [
            lambda h: nvml.nvmlDeviceGetCurrentClocksEventReasons(h),
            lambda h: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h),  # pre-12.x drivers
        ],
        "pcie_tx_kb_s": [lambda h: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES)],
        "pcie_rx_kb_s": [lambda h: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES)],
        "nvlink_tx_kib": [
            lambda h: _field_value(nvml, h, tx, NVML_SCOPE_ALL_LINKS),
            lambda h: _nvlink_per_link_sum(nvml, h, tx),
        ],
        "nvlink_rx_kib": [
            lambda h: _field_value(nvml, h, rx, NVML_SCOPE_ALL_LINKS),
            lambda h: _nvlink_per_link_sum(nvml, h, rx),
        ],
    }


class NvmlSampler:
    """NVML sampler over ``devices``; each field is probed once, unsupported ones stay null."""

    kind: SamplerKind = "nvml"

    def __init__(self, nvml: Any, devices: list[NvmlDevice]) -> None:
        self._nvml = nvml
        self.devices = devices
        self.unsupported: dict[str, str] = {}
        self._columns: list[str] = []
        self._active: list[tuple[str, Callable[[Any], float], Any]] = []
        for dev in devices:
            for name, candidates in _field_readers(nvml).items():
                self._probe(f"gpu{dev.local_index}_{name}", candidates, dev.handle)

    def _probe(self, column: str, candidates: list[Callable[[Any], float]], handle: Any) -> None:
        self._columns.append(column)
        reasons = []
        for read in candidates:
            try:
                read(handle)
            except (self._nvml.NVMLError, AttributeError) as exc:  # AttributeError: older pynvml
                reasons.append(_reason(exc))
                continue
            self._active.append((column, read, handle))
            return
        self.unsupported[column] = "; ".join(reasons)

    def sample(self) -> dict[str, float | None]:
        row: dict[str, float | None] = dict.fromkeys(self._columns)
        for entry in list(self._active):
            column, read, handle = entry
            try:
                row[column] = float(read(handle))
            except self._nvml.NVMLError as exc:
                self._active.remove(entry)  # not retried every sample
                self.unsupported[column] = f"stopped after a sampling error: {_reason(exc)}"
        return row

    def finish(self, samples: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
        summary: dict[str, Any] = {
            "devices": [{"local_index": d.local_index, "uuid": d.uuid, "name": d.name} for d in self.devices]
        }
        gauges: list[str] = []
        energies: list[float | None] = []
        dt_s = samples["t_s"].diff()
        for dev in self.devices:
            pre = f"gpu{dev.local_index}_"
            gauges += [pre + g for g in _GAUGES]
            for counter in _NVLINK:
                samples[f"{pre}{counter}_s"] = pd.to_numeric(samples[pre + counter], errors="coerce").diff() / dt_s
                gauges.append(f"{pre}{counter}_s")
                summary[f"{pre}{counter}_total"] = counter_delta(samples, pre + counter)
            energies.append(counter_delta(samples, pre + "energy_j"))
            summary[pre + "energy_j"] = energies[-1]
            bits = pd.to_numeric(samples[pre + "throttle_reasons"], errors="coerce").dropna().astype("int64")
            # A bitmask has no meaningful mean: report every reason seen in the window.
            any_bits = functools.reduce(operator.or_, bits.tolist(), 0)
            summary[pre + "throttle_reasons_any"] = int(any_bits) if len(bits) else None
        summary.update(column_stats(samples, gauges))
        # A node total only when every device reported energy; a partial sum would mislead.
        summary["energy_j"] = None if None in energies else sum(e for e in energies if e is not None)
        mem_max = [summary[f"gpu{d.local_index}_mem_used_mib_max"] for d in self.devices]
        summary["peak_mem_used_mib"] = max((m for m in mem_max if m is not None), default=None)
        return samples, summary

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def visible_device_entries(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` split into entries; None when the variable is unset."""
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def _handle_by_uuid(nvml: Any, uuid: str) -> Any:
    try:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    except nvml.NVMLError as exc:
        first = exc
    # CUDA accepts a unique UUID prefix in CUDA_VISIBLE_DEVICES; NVML wants the full UUID.
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    matches = [h for h in handles if _text(nvml.nvmlDeviceGetUUID(h)).startswith(uuid)]
    if len(matches) != 1:
        raise NvmlUnavailable(
            f"no unique NVML device for UUID {uuid!r} ({len(matches)} prefix matches, {type(first).__name__})"
        )
    return matches[0]


def _handle_for_entry(nvml: Any, entry: str) -> Any:
    if entry.startswith("MIG-"):
        raise NvmlUnavailable(
            f"CUDA_VISIBLE_DEVICES entry {entry!r} is a MIG instance; NVML per-device sampling of MIG "
            "instances is not supported"
        )
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    if entry.startswith("GPU-"):
        return _handle_by_uuid(nvml, entry)
    raise NvmlUnavailable(f"CUDA_VISIBLE_DEVICES entry {entry!r} is neither an index nor GPU-<uuid>")


def resolve_devices(
    nvml: Any, local_indices: list[int], visible: str | None, cuda_uuids: list[str] | None = None
) -> tuple[list[NvmlDevice], list[str]]:
    """Map local CUDA indices to NVML devices through ``CUDA_VISIBLE_DEVICES`` (``visible``).

    ``cuda_uuids`` (``GPU-<uuid>`` per local index, from torch) wins over the entry mapping
    when they disagree, which happens when CUDA orders devices FASTEST_FIRST; the returned
    notes say so.
    """
    entries = visible_device_entries(visible)
    devices, notes = [], []
    for pos, index in enumerate(local_indices):
        if entries is not None and index >= len(entries):
            raise NvmlUnavailable(
                f"local CUDA index {index} has no CUDA_VISIBLE_DEVICES entry ({visible!r} lists "
                f"{len(entries)}); use indices below {len(entries)}"
            )
        handle = _handle_for_entry(nvml, entries[index] if entries is not None else str(index))
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        if cuda_uuids is not None and cuda_uuids[pos].lower() != uuid.lower():
            notes.append(f"cuda:{index} is {cuda_uuids[pos]} per torch but {uuid} per CUDA_VISIBLE_DEVICES "
                         "order; mapped by UUID (set CUDA_DEVICE_ORDER=PCI_BUS_ID)")
            handle = _handle_by_uuid(nvml, cuda_uuids[pos])
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        devices.append(NvmlDevice(index, uuid, _text(nvml.nvmlDeviceGetName(handle)), handle))
    return devices, notes


def _torch_cuda_uuids(local_indices: list[int]) -> list[str] | None:
    """``GPU-<uuid>`` of each local index as CUDA sees it, or None without CUDA/uuid support."""
    if not torch.cuda.is_available():
        return None
    uuids = [getattr(torch.cuda.get_device_properties(i), "uuid", None) for i in local_indices]
    if any(u is None for u in uuids):
        return None
    # str() of torch's _CUuuid has no "GPU-" prefix; NVML's UUIDs do.
    return [f"GPU-{str(u).removeprefix('GPU-')}" for u in uuids]


def open_nvml_sampler(local_indices: list[int]) -> tuple[NvmlSampler, str | None]:
    """Initialise NVML and build the sampler; raises ``NvmlUnavailable`` with the reason."""
    try:
        import pynvml  # noqa: PLC0415  (optional: NVML is absent on CPU machines)
    except ImportError as exc:
        raise NvmlUnavailable(f"pynvml not importable ({type(exc).__name__})") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"no NVML on this machine ({type(exc).__name__})") from exc
    try:
        devices, notes = resolve_devices(
            pynvml, local_indices, os.environ.get("CUDA_VISIBLE_DEVICES"), _torch_cuda_uuids(local_indices)
        )
        return NvmlSampler(pynvml, devices), "; ".join(notes) or None
    except (pynvml.NVMLError, NvmlUnavailable) as exc:
        pynvml.nvmlShutdown()
        reason = str(exc) if isinstance(exc, NvmlUnavailable) else f"NVML device mapping failed ({_reason(exc)})"
        raise NvmlUnavailable(reason) from exc
