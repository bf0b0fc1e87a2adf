"""Sweep spec -> cells: expand the matrix, validate each cell, predict its memory per rank.

Invalid cells carry a one-line reason and are never launched. Cells are ordered so that each
group's single-device reference runs first (parity is computed against it as records land).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import product

from harness.config import CellConfig, cell_id_of
from harness.errors import UsageError
from harness.parallel.presets import STRATEGIES, check_model_fit, resolve_degrees, world_for
from harness.precision import PrecisionPlan, check_strategy
from harness.scaling import global_batch, scaled_lr
from workloads.sizes import get_size

GIB = 1024**3


@dataclass(frozen=True)
class SweepSpec:
    """The matrix: sizes x strategies x precisions x scalings x LR rules x device counts."""

    sizes: tuple[str, ...]
    strategies: tuple[str, ...]
    precisions: tuple[str, ...]
    gpus: tuple[int, ...]
    """Device counts per node to sweep (``--gpus 1,2,4``)."""
    device_kind: str
    batch: int
    """Sequences per step: global under strong scaling, per device under weak scaling."""
    steps: int
    warmup: int
    scalings: tuple[str, ...] = ("strong",)
    lr_rules: tuple[str, ...] = ("none",)
    seq_len: int | None = None
    microbatches: int | None = None
    """Pipeline microbatches; default 2 x pp (enough for every schedule)."""
    pp_schedule: str = "1f1b"
    grad_accum: int = 1
    base_lr: float = 1e-3
    base_batch: int | None = None
    """Batch at which base_lr holds; default: ``batch`` (the one-device batch)."""
    lr_warmup_steps: int = 0
    seed: int = 0
    target_loss: float | None = None
    nnodes: int = 1
    nvtx: bool = True
    profile: bool = False
    mem_cap_gib: float | None = None
    degrees: dict | None = None
    reference: bool = True
    """Add the single-device fp32/bf16... reference of each strong-scaling group for parity."""
    extra: dict = field(default_factory=dict)


@dataclass
class PlannedCell:
    cell_id: str
    config: CellConfig | None
    raw: dict
    valid: bool
    reason: str | None
    est_mem_gib: float | None = None
    capacity_gib: float | None = None
    reference_only: bool = False
    """Added by the planner as the parity reference, not asked for by the user."""

    @property
    def fits(self) -> bool | None:
        if self.est_mem_gib is None or self.capacity_gib is None:
            return None
        return self.est_mem_gib <= self.capacity_gib


def _order(strategy: str) -> int:
    return STRATEGIES.index(strategy) if strategy in STRATEGIES else len(STRATEGIES)


def expand(spec: SweepSpec) -> list[PlannedCell]:
    for name in spec.sizes:
        try:
            get_size(name)
        except ValueError as e:  # unknown size: a usage error for the whole sweep, before anything runs
            raise UsageError(f"--sizes: {e}") from None
    strategies = list(spec.strategies)
    added_reference = spec.reference and "single" not in strategies and "strong" in spec.scalings
    if added_reference:
        strategies.insert(0, "single")
    cells: dict[str, PlannedCell] = {}
    for size, prec, scaling, rule, gpus, strat in product(spec.sizes, spec.precisions, spec.scalings,
                                                          spec.lr_rules, spec.gpus, strategies):
        cell = _plan_one(spec, size, strat, prec, scaling, rule, gpus)
        cell.reference_only = added_reference and strat == "single"
        cells.setdefault(cell.cell_id, cell)  # `single` at several --gpus values is one cell
    return sorted(cells.values(), key=lambda c: (c.raw["size"], c.raw["precision"], c.raw["scaling"],
                                                 c.raw["lr_rule"], c.raw["world_size"] > 1,
                                                 c.raw["world_size"], _order(c.raw["strategy"])))


def _plan_one(spec: SweepSpec, size_name: str, strategy: str, precision: str, scaling: str, rule: str,
              gpus: int) -> PlannedCell:
    size = get_size(size_name)
    world = world_for(strategy, gpus * spec.nnodes) if strategy == "single" else gpus * spec.nnodes
    seq = spec.seq_len or size.seq_len
    gb = global_batch(scaling, spec.batch, world)
    base_batch = spec.base_batch or spec.batch
    raw = dict(size=size_name, strategy=strategy, precision=precision, world_size=world, global_batch=gb,
               seq_len=seq, steps=spec.steps, warmup=spec.warmup, device_kind=spec.device_kind,
               nnodes=1 if world == 1 else spec.nnodes, grad_accum=spec.grad_accum,
               microbatches=spec.microbatches or 1, pp_schedule=spec.pp_schedule, scaling=scaling, lr_rule=rule,
               base_lr=spec.base_lr, base_batch=base_batch, lr=scaled_lr(rule, spec.base_lr, base_batch, gb),
               lr_warmup_steps=spec.lr_warmup_steps, seed=spec.seed, target_loss=spec.target_loss,
               nvtx=spec.nvtx, profile=spec.profile, mem_cap_gib=spec.mem_cap_gib,
               degrees=spec.degrees if strategy != "single" else None, **spec.extra)
    try:
        dims = resolve_degrees(strategy, world, raw["degrees"])
        if dims.pp_enabled and spec.microbatches is None:
            raw["microbatches"] = 2 * dims.pp
        if seq > size.seq_len:
            raise UsageError(f"seq_len ({seq}) exceeds {size_name}'s position table ({size.seq_len}); use --seq-len <= {size.seq_len}")
        cfg = CellConfig(**raw)
        PrecisionPlan(precision).check_device(spec.device_kind)
        check_strategy(precision, strategy)
        check_model_fit(dims, size.n_heads, size.d_ff, size.n_layers, cfg.pp_schedule, cfg.microbatches)
        split = dims.dp * (cfg.microbatches if dims.pp_enabled else cfg.grad_accum)
        if gb % split:
            what = f"dp ({dims.dp}) x microbatches ({cfg.microbatches})" if dims.pp_enabled else \
                f"dp ({dims.dp}) x grad_accum ({cfg.grad_accum})"
            raise UsageError(f"global batch ({gb}) must be divisible by {what} = {split}; "
                             f"use a batch that is a multiple of {split}")
    except UsageError as e:
        return PlannedCell(cell_id=cell_id_of(raw), config=None, raw=raw, valid=False, reason=str(e))
    est = estimate_memory_gib(cfg)
    return PlannedCell(cell_id=cfg.cell_id, config=cfg, raw=raw, valid=True, reason=None, est_mem_gib=est,
                       capacity_gib=device_capacity_gib(spec.device_kind, gpus))


def estimate_memory_gib(cfg: CellConfig) -> float:
    """Predicted peak per rank from the analytic model (:func:`harness.model.memory.peak_bytes`).

    CPU ranks add the interpreter's base memory (:data:`harness.model.predict.CPU_BASE_GIB`);
    CUDA's allocator peak does not include the context.
    """
    from harness.model.memory import peak_bytes
    from harness.model.predict import CPU_BASE_GIB
    from harness.model.shape import CellShape

    base = CPU_BASE_GIB * GIB if cfg.device_kind == "cpu" else 0.0
    return peak_bytes(CellShape.of(cfg), base) / GIB


def device_capacity_gib(device_kind: str, gpus_per_node: int) -> float | None:
    """Memory one rank may use: the GPU's memory, or host RAM shared by the node's ranks."""
    if device_kind == "cuda":
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total / GIB
        except pynvml.NVMLError:
            return None
    import psutil

    return psutil.virtual_memory().total / GIB / max(1, gpus_per_node)


def default_device_kind() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() and os.environ.get("HARNESS_FORCE_CPU") != "1" else "cpu"
