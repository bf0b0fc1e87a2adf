"""What every monitor sampler shares: the interface, the result, and the summary helpers.

:mod:`harness.measure.monitor` (host sampler, the sampling thread) and
:mod:`harness.measure.nvml_sampler` both build on this module; neither imports the other's
internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import pandas as pd

from harness.records.atomic import write_text_atomic

SamplerKind = Literal["nvml", "host"]


class Sampler(Protocol):
    """What ``Monitor`` needs: ``sample()`` one row (None = unreadable), ``finish(samples)``
    derived columns + summary, ``close()`` release (e.g. ``nvmlShutdown``)."""

    kind: SamplerKind
    unsupported: dict[str, str]

    def sample(self) -> dict[str, float | None]: ...

    def finish(self, samples: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]: ...

    def close(self) -> None: ...


@dataclass
class MonitorResult:
    """Samples and summary of one monitored window."""

    sampler: SamplerKind
    samples: pd.DataFrame
    """One row per sample; ``t_s`` = seconds since ``Monitor.start``."""
    summary: dict[str, Any]
    """Max/mean per field, counter differences (``energy_j``), devices, achieved rate."""
    unsupported: dict[str, str] = field(default_factory=dict)
    """Field -> reason it was not sampled (null in ``samples``)."""
    note: str | None = None
    """Why this sampler ran, e.g. 'n/a: no NVML on this machine (...); host sampler used'."""

    def to_record(self) -> dict[str, Any]:
        """The ``metrics.monitor`` entry of a record (JSON-serialisable)."""
        return {"sampler": self.sampler, "note": self.note, "unsupported": dict(self.unsupported), **self.summary}

    def save_csv(self, path: str | Path) -> Path:
        """Write ``samples`` as CSV atomically (temp file in the same dir + ``os.replace``)."""
        target = write_text_atomic(path, self.samples.to_csv(index=False))
        return target


def column_stats(samples: pd.DataFrame, columns: list[str]) -> dict[str, float | None]:
    """``<col>_max`` and ``<col>_mean`` over non-null values; None when a column has none."""
    out: dict[str, float | None] = {}
    for col in columns:
        values = pd.to_numeric(samples[col], errors="coerce").dropna() if col in samples else pd.Series(dtype=float)
        out[f"{col}_max"] = float(values.max()) if len(values) else None
        out[f"{col}_mean"] = float(values.mean()) if len(values) else None
    return out


def counter_delta(samples: pd.DataFrame, column: str) -> float | None:
    """Last minus first non-null value of a cumulative counter column (None if < 2 values)."""
    if column not in samples:
        return None
    values = pd.to_numeric(samples[column], errors="coerce").dropna()
    if len(values) < 2:
        return None
    return float(values.iloc[-1] - values.iloc[0])
