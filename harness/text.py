"""How a number or a message prints in a table, one definition for every report and comparison."""

from __future__ import annotations

import math
import numbers
from typing import Any


def fmt_or(value: Any, spec: str, missing: str = "n/a") -> str:
    """``format(value, spec)``, or ``missing`` where there is no finite number (None, NaN, inf, text)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        return missing
    return format(value, spec)


def first_line(message: Any, limit: int = 60) -> str:
    """The first line of an error message, at most ``limit`` characters."""
    text = "" if message is None or (isinstance(message, float) and math.isnan(message)) else str(message)
    return text.splitlines()[0][:limit] if text.strip() else "no error message"


def degrees_label(degrees: dict[str, int] | None) -> str:
    """``dp_shard=4 x tp=2``: the degrees above 1, or ``1 device``; ``tp=2 (sp)`` under sequence parallel."""
    d = degrees or {}
    label = " x ".join(f"{k}={v}" + (" (sp)" if k == "tp" and d.get("sp") else "")
                       for k, v in d.items() if v > 1 and k != "sp")
    return label or "1 device"
