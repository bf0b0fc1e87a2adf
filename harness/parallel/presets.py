"""Named strategies -> parallel degrees for a device count, and the checks a cell must pass."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import UsageError
from harness.parallel.dims import ParallelDims

STRATEGIES = ("single", "ddp", "fsdp", "zero2", "hsdp", "tp", "tp-sp", "pp", "fsdp+tp", "pp+fsdp", "pp+fsdp+tp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclass(frozen=True)
class StrategyOptions:
    """What a strategy does beyond its degrees."""

    data_parallel: str
    """``none``, ``ddp`` (all-reduce), ``fsdp`` (fully_shard) or ``hsdp`` (replicate x shard)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3-like) or keep them to backward (ZeRO-2-like)."""


OPTIONS = {
    "single": StrategyOptions("none"),
    "ddp": StrategyOptions("ddp"),
    "fsdp": StrategyOptions("fsdp", reshard_after_forward=True),
    "zero2": StrategyOptions("fsdp", reshard_after_forward=False),
    "hsdp": StrategyOptions("hsdp"),
    "tp": StrategyOptions("none"),
    "tp-sp": StrategyOptions("none"),
    "pp": StrategyOptions("none"),
    "fsdp+tp": StrategyOptions("fsdp"),
    "pp+fsdp": StrategyOptions("fsdp"),
    "pp+fsdp+tp": StrategyOptions("fsdp"),
}


def _need(strategy: str, world: int, minimum: int, multiple: int, shape: str) -> None:
    if world < minimum or world % multiple:
        div = f" divisible by {multiple}" if multiple > 1 else ""
        raise UsageError(f"strategy {strategy} needs a device count >= {minimum}{div} ({shape}), got --gpus {world}")


def degrees_for(strategy: str, world: int) -> ParallelDims:
    """Map a strategy name and device count to validated degrees.

    Hybrids give the inner dimensions 2 ways and the data-parallel dimension the rest, so each
    named dimension is really exercised (a degree of 1 would silently be a different strategy).
    """
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if strategy == "single":
        return ParallelDims(world_size=1)
    if strategy in ("ddp", "fsdp", "zero2", "tp", "tp-sp", "pp"):
        _need(strategy, world, 2, 1, "one dimension over all devices")
    if strategy == "ddp":
        return ParallelDims(dp_replicate=world, world_size=world)
    if strategy in ("fsdp", "zero2"):
        return ParallelDims(dp_shard=world, world_size=world)
    if strategy in ("tp", "tp-sp"):
        return ParallelDims(tp=world, world_size=world, sequence_parallel=strategy == "tp-sp")
    if strategy == "pp":
        return ParallelDims(pp=world, world_size=world)
    if strategy == "hsdp":
        _need(strategy, world, 4, 2, "2 replicas x >= 2 shards")
        return ParallelDims(dp_replicate=2, dp_shard=world // 2, world_size=world)
    if strategy == "fsdp+tp":
        _need(strategy, world, 4, 2, ">= 2 shards x tp 2")
        return ParallelDims(dp_shard=world // 2, tp=2, world_size=world)
    if strategy == "pp+fsdp":
        _need(strategy, world, 4, 2, "pp 2 x >= 2 shards")
        return ParallelDims(pp=2, dp_shard=world // 2, world_size=world)
    _need(strategy, world, 8, 4, "pp 2 x >= 2 shards x tp 2")
    return ParallelDims(pp=2, dp_shard=world // 4, tp=2, world_size=world)


def resolve_degrees(strategy: str, world: int, override: dict | None) -> ParallelDims:
    """The preset's degrees, or an explicit override validated against the world size."""
    if not override:
        return degrees_for(strategy, world)
    unknown = set(override) - {"dp_replicate", "dp_shard", "tp", "pp"}
    if unknown:
        raise UsageError(f"unknown degree names {sorted(unknown)}; use dp_replicate, dp_shard, tp, pp")
    dims = ParallelDims(**override, world_size=world, sequence_parallel=strategy == "tp-sp")
    dp = OPTIONS[strategy].data_parallel if strategy in OPTIONS else "none"
    syncs = {"none": (), "ddp": ("dp_replicate",), "fsdp": ("dp_shard",), "hsdp": ("dp_replicate", "dp_shard")}[dp]
    for name in ("dp_replicate", "dp_shard"):
        if getattr(dims, name) > 1 and name not in syncs:
            raise UsageError(f"strategy {strategy} does not synchronise gradients over {name} "
                             f"({getattr(dims, name)}): its replicas would diverge; set {name}=1 or pick a strategy "
                             f"that uses it ({'ddp/hsdp' if name == 'dp_replicate' else 'fsdp/zero2/hsdp'})")
    return dims


def world_for(strategy: str, gpus: int) -> int:
    """Devices a strategy's cell uses: ``single`` always runs on one."""
    return 1 if strategy == "single" else gpus


def check_model_fit(dims: ParallelDims, n_heads: int, d_ff: int, n_layers: int, pp_schedule: str, microbatches: int) -> None:
    """Checks that need the workload's shape; each error names the values and the fix."""
    if dims.tp_enabled:
        if n_heads % dims.tp:
            ok = [t for t in range(1, n_heads + 1) if n_heads % t == 0]
            raise UsageError(f"tp ({dims.tp}) must divide n_heads ({n_heads}); choose tp in {{{', '.join(map(str, ok))}}}")
        if d_ff % dims.tp:
            raise UsageError(f"tp ({dims.tp}) must divide the MLP width ({d_ff}); choose a tp that divides {d_ff}")
    if dims.pp_enabled:
        stages = dims.pp * stages_per_rank(pp_schedule)
        if stages > n_layers:
            raise UsageError(
                f"pipeline stages ({stages} = pp {dims.pp} x {stages_per_rank(pp_schedule)} per rank) exceed "
                f"layers ({n_layers}); lower pp or use a deeper size"
            )
        need = min_microbatches(pp_schedule, dims.pp)
        if microbatches < need:
            raise UsageError(
                f"schedule {pp_schedule} with pp {dims.pp} needs >= {need} microbatches, got {microbatches}; "
                f"raise --microbatches"
            )
        if pp_schedule == "interleaved1f1b" and microbatches % dims.pp:
            raise UsageError(
                f"schedule interleaved1f1b needs microbatches ({microbatches}) divisible by pp ({dims.pp}); "
                f"use a multiple of {dims.pp}"
            )


def stages_per_rank(pp_schedule: str) -> int:
    """Virtual stages per rank: 2 for interleaved 1F1B (Narayanan et al. 2021), else 1."""
    if pp_schedule not in PP_SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {pp_schedule!r}; choose from {', '.join(PP_SCHEDULES)}")
    return 2 if pp_schedule == "interleaved1f1b" else 1


def min_microbatches(pp_schedule: str, pp: int) -> int:
    """1F1B-style schedules need at least one microbatch in flight per stage."""
    return 1 if pp_schedule == "gpipe" else pp


def expected_bubble(pp: int, virtual: int, microbatches: int) -> float:
    """Pipeline bubble fraction ``(p - 1) / (v * m)`` (Narayanan et al. 2021, eq. for interleaving)."""
    return (pp - 1) / (virtual * microbatches)
