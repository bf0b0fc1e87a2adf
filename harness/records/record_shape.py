"""What a record of this schema version is: the one check every reader applies to every line it reads.

:func:`record_problem` says why a JSON value is not a record this harness can read, or None when it is: the
top-level fields every writer (:func:`harness.records.record.make_record`) gives, with their types, and a cell
record's ``metrics`` keys against their types in :class:`harness.records.schema.CellMetrics` (a key this version
does not know is kept: readers look keys up by name). A record of another ``schema_version`` is refused by name: it
was written by another version of the harness, whose readers know its shape.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Union, get_args, get_origin, get_type_hints, is_typeddict

from harness.records.record import SCHEMA_VERSION, STATUSES
from harness.records.schema import CellMetrics

KINDS = ("cell", "calibration", "fit")
"""Record kinds: a sweep's cells, its calibration record (the normaliser workload), ``harness fit``'s roles."""

FIELDS: dict[str, Any] = {
    "schema_version": int, "cell_id": str, "status": str, "config": dict, "metrics": dict,
    "samples": dict,
}
"""The fields every reader needs, and their JSON types."""
OPTIONAL: dict[str, Any] = {"kind": str, "run_id": str, "error": str | None, "fingerprint": str, "fingerprint_fields": dict,
                            "env": dict, "workload": dict | None, "predicted": dict | None}
"""The other fields a writer gives, typed where present: a record made by hand or converted (a pytest-benchmark
file) may leave them out (``kind`` then reads as ``"cell"``), and ``predicted`` is absent from records before the model's predictions."""
CONFIG: dict[str, Any] = {
    "size": str, "strategy": str, "precision": str, "world_size": int, "global_batch": int, "seq_len": int,
    "steps": int, "warmup": int, "device_kind": str, "nnodes": int, "grad_accum": int, "microbatches": int,
    "pp_schedule": str, "scaling": str, "lr_rule": str, "base_lr": float, "base_batch": int, "lr": float,
    "lr_warmup_steps": int, "seed": int, "target_loss": float | None, "nvtx": bool, "profile": bool,
    "profile_ranks": list[int], "monitor_hz": float, "degrees": dict[str, int] | None, "mem_cap_gib": float | None,
    "compile": bool, "ac": str, "optimizer": str, "batch_auto": bool, "arch": str, "model": dict | None,
    "moe_routing": str, "sequence_parallel": bool, "fp8_recipe": str, "fp8_all_gather": bool, "fp8_emulate": bool,
    "checkpoint": str, "checkpoint_every": int, "checkpoint_keep": bool, "restore_from": str | None,
}
"""A record's ``config`` keys: :class:`harness.spec.CellConfig`'s fields as JSON types (a test holds the two alike;
this layer does not import the spec)."""
ENV: dict[str, Any] = {
    "git_sha": str | None, "git_dirty": bool | None, "python": str, "torch": str, "cuda": str | None,
    "nccl": str | None, "device_kind": str, "device_name": str, "device_count": int, "driver": str | None,
    "cpu_model": str, "cpu_count": int | None, "hostname": str, "platform": str,
}
"""A record's ``env`` keys (:func:`harness.records.env.collect_env`) and their types."""
SAMPLES: dict[str, Any] = {"step_time_s": list[float], "warmup_step_time_s": list[float],
                           "step_time_s_per_rank": list[list[float]]}
"""The samples readers compute with, and their types."""


def _conforms(value: Any, tp: Any) -> bool:
    """Whether a JSON value has the type ``tp`` (a float field takes an int: JSON writes 2.0 as 2 only by hand)."""
    origin = get_origin(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (Union, types.UnionType):
        return any(_conforms(value, t) for t in get_args(tp))
    if origin is list or tp is list:
        return isinstance(value, list) and all(_conforms(x, (get_args(tp) or (Any,))[0]) for x in value)
    if origin is dict or tp is dict or is_typeddict(tp):
        args = get_args(tp)
        return isinstance(value, dict) and (not args or all(_conforms(x, args[1]) for x in value.values()))
    return True


@functools.cache
def _metric_types() -> dict[str, Any]:
    return get_type_hints(CellMetrics)


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "") if get_args(tp) else getattr(tp, "__name__", str(tp))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def record_problem(obj: Any) -> str | None:
    """Why ``obj`` (one parsed line) is not a record of this schema version; None when it is."""
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not a record object"
    version = obj.get("schema_version")
    if "schema_version" not in obj:
        return "no schema_version: not a harness record (docs/records.md)"
    if version != SCHEMA_VERSION or isinstance(version, bool):
        return (f"schema_version {_shown(version)}: this harness reads version {SCHEMA_VERSION}; read the run with "
                f"the harness version that wrote it")
    for name, tp in {**FIELDS, **{k: t for k, t in OPTIONAL.items() if k in obj}}.items():
        if name not in obj:
            return f"no {name!r} field (every record has it, docs/records.md)"
        if not _conforms(obj[name], tp):
            return f"{name} = {_shown(obj[name])} is not {_type_name(tp)}"
    kind = obj.get("kind", "cell")
    if kind not in KINDS:
        return f"kind {kind!r} is not one of {', '.join(KINDS)}"
    if obj["status"] not in STATUSES:
        return f"status {obj['status']!r} is not one of {', '.join(STATUSES)}"
    for part, types_ in (("config", CONFIG), ("env", ENV), ("samples", SAMPLES)):
        if (problem := _part_problem(part, obj.get(part) or {}, types_)) is not None:
            return problem
    return _part_problem("metrics", obj["metrics"], _metric_types()) if kind == "cell" else None


def _part_problem(part: str, values: dict, types_: dict[str, Any]) -> str | None:
    """The first of ``values``' keys named in ``types_`` whose value is not of its type."""
    for name, value in values.items():
        if name in types_ and not _conforms(value, types_[name]):
            return f"{part}.{name} = {_shown(value)} is not {_type_name(types_[name])}"
    return None

