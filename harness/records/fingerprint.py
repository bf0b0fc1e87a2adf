"""The one fingerprint function: 16 hex characters of sha256 over canonical (sorted-key) JSON.

Records, pytest-benchmark cells and calibration entries are all keyed by it, so two things
with equal fields always get the same key, on any machine.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

LENGTH = 16


def digest(fields: Any) -> str:
    """sha256 of ``json.dumps(fields, sort_keys=True)``, first 16 hex characters (non-JSON values as ``str``)."""
    blob = json.dumps(fields, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:LENGTH]
