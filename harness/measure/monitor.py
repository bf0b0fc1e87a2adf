"""Background device/host monitor sampled at a stated rate over the measured window.

One ``Monitor`` runs per node (the caller starts it on local rank 0). The sampler is NVML
(nvidia-ml-py, module ``pynvml``; see ``harness.measure.nvml_sampler``) on CUDA machines
where NVML initialises, else a host sampler (psutil) recording RSS and CPU utilisation;
``MonitorResult.sampler`` says which ran and ``note`` why the host sampler was used.

Counters vs gauges: energy (J) and NVLink traffic (KiB) are cumulative counters; the
summary reports their difference over the window (``energy_j``) and NVLink rates are
derived from consecutive samples. Everything else is a gauge summarised as max/mean.

The sampler interface and the summary helpers both samplers share live in
:mod:`harness.measure.sampling`; the NVML sampler in :mod:`harness.measure.nvml_sampler`
(which imports ``pynvml`` only when it opens).
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any

import pandas as pd
import psutil

from harness.measure.nvml_sampler import NvmlUnavailable, open_nvml_sampler
from harness.measure.sampling import MonitorResult, Sampler, SamplerKind, column_stats
from harness.units import MIB


class Monitor:
    """Samples ``sampler`` every ``1 / rate_hz`` s between start/stop: on a background thread, or, with
    ``between_steps``, from the training loop's :meth:`tick` after each step's clock has stopped (at most at
    ``rate_hz``; a step longer than the period gets one sample after it).

    A sample is also taken synchronously at ``start`` and at ``stop``, so counter
    differences cover exactly the monitored window and short windows still get 2 rows.

    ``between_steps`` is the host sampler's mode (issue 62, docs/harness-cost.md: on a thread its psutil read woke
    a core the rank computes on, inside a timed step): what it reads (RSS, CPU seconds) is as true between steps,
    except a peak inside a step, which the CPU cell measures by its tensor bytes (``peak_tensor_bytes``).
    NVML's gauges (utilisation, power, PCIe counters) describe the GPU while it works: the NVML sampler
    keeps its thread.
    """

    def __init__(self, sampler: Sampler, rate_hz: float = 10.0, note: str | None = None,
                 between_steps: bool = False) -> None:
        if not rate_hz > 0 or math.isinf(rate_hz):
            raise ValueError(f"rate_hz ({rate_hz}) must be a positive finite rate; e.g. 10.0")
        self.sampler = sampler
        self.rate_hz = float(rate_hz)
        self.note = note
        self.between_steps = between_steps
        self._rows: list[dict[str, float | None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        self._t0 = 0.0
        self._due = math.inf
        self._error: BaseException | None = None

    @property
    def kind(self) -> SamplerKind:
        return self.sampler.kind

    def start(self) -> None:
        """Take the first sample and start the sampling thread (once per Monitor)."""
        if self._running or self._rows:
            raise RuntimeError("Monitor.start() called twice; a Monitor is single-use, make_monitor() anew")
        self._t0 = time.perf_counter()
        self._record()
        self._running = True
        if self.between_steps:
            self._due = self._t0 + 1.0 / self.rate_hz
            return
        self._thread = threading.Thread(target=self._run, name="harness-monitor", daemon=True)
        self._thread.start()

    def tick(self) -> None:
        """Between two steps (outside their clocks): a sample if one is due. A no-op on a thread's monitor."""
        now = time.perf_counter()
        if now < self._due:
            return
        self._record()
        # A fixed schedule without drift: the next point of it after now (those a long step overran are skipped)
        period = 1.0 / self.rate_hz
        self._due += period * (1 + (now - self._due) // period)

    def _record(self) -> None:
        # Stamp the start of the read: one NVML sample can take tens of ms (PCIe counters
        # integrate over 20 ms each), and the first row should sit at t_s = 0.
        t_s = time.perf_counter() - self._t0
        row = self.sampler.sample()
        row["t_s"] = t_s
        self._rows.append(row)

    def _run(self) -> None:
        period = 1.0 / self.rate_hz
        deadline = self._t0 + period
        try:
            # Event.wait returns True as soon as stop() sets the event: stop is prompt.
            while not self._stop.wait(max(0.0, deadline - time.perf_counter())):
                self._record()
                # Fixed schedule without drift; skip ticks a slow sample overran (no bursts).
                deadline = max(deadline + period, time.perf_counter())
        except Exception as exc:  # surfaced by stop(); a dead sampler must not pass silently
            self._error = exc

    def stop(self) -> MonitorResult:
        """Stop sampling, take the final sample and summarise the window."""
        if not self._running:
            raise RuntimeError("Monitor.stop() without start(); call start() first")
        self._running, self._due = False, math.inf
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        try:
            if self._error is not None:
                raise RuntimeError(f"{self.kind} monitor sampling thread failed: {self._error!r}") from self._error
            self._record()
            return self._result()
        finally:
            self.sampler.close()

    def _result(self) -> MonitorResult:
        samples = pd.DataFrame(self._rows)
        samples = samples[["t_s", *[c for c in samples.columns if c != "t_s"]]]
        samples, summary = self.sampler.finish(samples)
        duration_s = float(samples["t_s"].iloc[-1])
        summary = {
            "rate_hz": self.rate_hz,
            "sampled": "between steps" if self.between_steps else "on a thread",
            "n_samples": len(samples),
            "duration_s": duration_s,
            "achieved_rate_hz": (len(samples) - 1) / duration_s if duration_s > 0 else None,
            **summary,
        }
        return MonitorResult(
            sampler=self.kind,
            samples=samples,
            summary=summary,
            unsupported=dict(self.sampler.unsupported),
            note=self.note,
        )


class HostSampler:
    """psutil sampler: RSS (MiB) and CPU % of the given processes, plus system CPU %.

    Process CPU % is ``psutil.Process.cpu_percent`` (100 = one core fully busy, so it can
    exceed 100); system CPU % is ``psutil.cpu_percent`` over all cores (0-100).
    """

    kind: SamplerKind = "host"

    def __init__(self, pids: list[int] | None = None) -> None:
        self.unsupported: dict[str, str] = {}
        self._procs: dict[int, psutil.Process] = {}
        for pid in pids or [os.getpid()]:
            try:
                proc = psutil.Process(pid)
                proc.cpu_percent(None)  # the first call only primes the counter
                self._procs[pid] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied) as exc:
                self.unsupported[f"pid{pid}"] = f"{type(exc).__name__}: {exc}"
        psutil.cpu_percent(None)

    def sample(self) -> dict[str, float | None]:
        rss: list[float] = []
        cpu: list[float] = []
        for pid, proc in list(self._procs.items()):
            try:
                with proc.oneshot():
                    rss.append(proc.memory_info().rss / MIB)
                    cpu.append(proc.cpu_percent(None))
            except (psutil.NoSuchProcess, psutil.AccessDenied) as exc:
                # A rank that exited stops counting; record why instead of retrying.
                self.unsupported[f"pid{pid}"] = f"stopped sampling: {type(exc).__name__}"
                del self._procs[pid]
        return {
            "rss_mib_sum": sum(rss) if rss else None,
            "rss_mib_max": max(rss) if rss else None,
            "proc_cpu_pct_sum": sum(cpu) if cpu else None,
            "system_cpu_pct": psutil.cpu_percent(None),
            "n_procs": float(len(rss)),
        }

    def finish(self, samples: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
        stats = column_stats(samples, ["rss_mib_sum", "rss_mib_max", "proc_cpu_pct_sum", "system_cpu_pct"])
        summary: dict[str, Any] = {
            "peak_rss_mib": stats["rss_mib_sum_max"],
            "peak_rss_mib_per_process": stats["rss_mib_max_max"],
            "cpu_pct_mean": stats["proc_cpu_pct_sum_mean"],
            "system_cpu_pct_mean": stats["system_cpu_pct_mean"],
            **stats,
        }
        return samples, summary

    def close(self) -> None:
        self._procs.clear()




def make_monitor(
    device_kind: str,
    local_device_indices: list[int],
    rate_hz: float = 10.0,
    pids: list[int] | None = None,
) -> Monitor:
    """NVML monitor for ``device_kind == "cuda"`` where NVML works, else a host monitor.

    Args:
        device_kind: ``"cuda"`` or ``"cpu"`` (the cell's device kind).
        local_device_indices: local CUDA indices of this node's ranks, e.g. ``[0, 1, 2, 3]``.
        rate_hz: sampling rate.
        pids: processes for the host sampler (default: this process), which samples between steps
            (:meth:`Monitor.tick`); the NVML sampler samples on its thread.
    """
    if device_kind != "cuda":
        return Monitor(HostSampler(pids), rate_hz, note=f"host sampler: device_kind is {device_kind!r}",
                       between_steps=True)
    try:
        sampler, note = open_nvml_sampler(local_device_indices)
    except NvmlUnavailable as exc:
        return Monitor(HostSampler(pids), rate_hz, note=f"n/a: {exc}; host sampler used", between_steps=True)
    return Monitor(sampler, rate_hz, note=note)
