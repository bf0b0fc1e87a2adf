"""One record per cell: schema, fingerprint and JSON hygiene (docs/records.md)."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping
from typing import Any

from harness.records.fingerprint import digest

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "timeout", "crashed", "invalid", "contradicted")
"""A cell's outcome. ``contradicted``: it ran, but something its record claims (a lever, a layout, a recipe) the
run did not do (:mod:`harness.run.claims`); its metrics stay as the evidence, and no table shows it as measured."""

# What makes two cells comparable: same work, same layout, same machine and software.
FINGERPRINT_CONFIG = ("size", "strategy", "precision", "world_size", "nnodes", "global_batch", "seq_len",
                      "grad_accum", "microbatches", "pp_schedule", "scaling", "device_kind")
FINGERPRINT_ENV = ("device_name", "torch", "cuda", "nccl")
FINGERPRINT_LEVERS = {"compile": False, "ac": "none", "optimizer": "adamw"}
"""Levers (:mod:`harness.parallel.levers`) and their unpulled values: a pulled lever enters the
fingerprint; an unpulled one does not, so records from before the levers keep their fingerprints."""


def pulled_levers(config: dict) -> dict:
    """The levers a cell's config pulls (empty: an eager, checkpoint-free, default-optimizer cell)."""
    return {k: config[k] for k, off in FINGERPRINT_LEVERS.items() if config.get(k, off) != off}


FINGERPRINT_AXES = {"arch": "gpt2", "moe_routing": "learned", "fp8_recipe": "tensorwise", "fp8_all_gather": False,
                    "fp8_emulate": False, "checkpoint": "off"}
"""Workload axes and their default: a cell off the default enters them in its fingerprint, a default one
does not, so records from before the axis keep their fingerprints."""


def fingerprint_fields(config: dict, env: dict, degrees: dict | None) -> dict:
    f = {k: config.get(k) for k in FINGERPRINT_CONFIG}
    f.update({k: config[k] for k, off in FINGERPRINT_AXES.items() if config.get(k, off) != off})
    f.update(pulled_levers(config))
    f.update({k: env.get(k) for k in FINGERPRINT_ENV})
    f["degrees"] = degrees
    return f


def fingerprint(fields: dict) -> str:
    return digest(fields)


def clean(obj: Any) -> Any:
    """JSON-safe: NaN/inf -> None (strict JSON), tuples -> lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + hashlib.sha256(str(time.time_ns()).encode()).hexdigest()[:4]


def make_record(*, run_id: str, cell_id: str, status: str, config: dict, env: dict, degrees: dict | None,
                workload: dict | None, metrics: Mapping[str, Any] | None = None, samples: dict | None = None,
                error: str | None = None, kind: str = "cell", predicted: dict | None = None) -> dict:
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    fields = fingerprint_fields(config, env, degrees)
    return clean(
        {
            "schema_version": SCHEMA_VERSION,
            "kind": kind,
            "run_id": run_id,
            "cell_id": cell_id,
            "status": status,
            "error": error,
            "fingerprint": fingerprint(fields),
            "fingerprint_fields": fields,
            "config": {**config, "degrees": degrees},
            "env": env,
            "workload": workload,
            "metrics": metrics or {},
            "predicted": predicted,
            "samples": samples or {},
        }
    )
