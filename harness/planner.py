"""Sweep spec -> cells: expand the matrix, validate each cell, attach the model's predictions.

Invalid cells carry a one-line reason and are never launched. Each valid cell's strategy is
resolved once (:func:`harness.parallel.presets.resolve_cell`), and its predictions (step time,
communication, memory per rank) are attached here, before anything runs, from the calibration
store: the sweep never imports the model, and the worker never reads calibration files. Cells
are ordered so that each group's single-device reference runs first (parity is computed
against it as records land).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import product

import psutil
import torch

from harness.calibration.collectives import lookup_comm
from harness.calibration.matmul import lookup as lookup_matmul
from harness.calibration.matmul import threads_for
from harness.calibration.provenance import flag_notes, source
from harness.calibration.workload import lookup_workload
from harness.errors import UsageError
from harness.model.predict import CalibrationInputs, predict_cell
from harness.parallel.activation_checkpoint import policy_order
from harness.parallel.levers import OPTIMIZERS, check_levers
from harness.parallel.presets import (
    EP_PRESETS,
    PP_PRESETS,
    STRATEGIES,
    degree_variants,
    resolve_cell,
    resolve_own_cell,
    world_for,
)
from harness.parallel.schedules import PP_SCHEDULES
from harness.precision import Fp8Options, PrecisionPlan, check_fp8
from harness.scaling import global_batch, scaled_lr
from harness.spec import CHECKPOINT_MODES, CellConfig, SweepSpec, cell_id_of
from harness.units import GIB
from workloads.own_model import OwnModel
from workloads.sizes import ARCHS, ModelSize, seq_len_error, size_key


@dataclass
class PlannedCell:
    cell_id: str
    config: CellConfig | None
    raw: dict
    valid: bool
    reason: str | None
    capacity_gib: float | None = None
    reference_only: bool = False
    """Added by the planner as the parity reference, not asked for by the user."""
    predicted: dict | None = None
    """``record.predicted``: :func:`harness.model.predict.predict_cell` from the calibration store."""
    calibrated_tflops: float | None = None
    """The measured matmul peak for the cell's device, compute dtype and threads (calibrated MFU)."""

    @property
    def est_mem_gib(self) -> float | None:
        """Predicted peak memory per rank (the model's ``peak_mem_gib``)."""
        return self.predicted["peak_mem_gib"] if self.predicted else None

    @property
    def fits(self) -> bool | None:
        if self.est_mem_gib is None or self.capacity_gib is None:
            return None
        return self.est_mem_gib <= self.capacity_gib


def _arch_order(arch: str) -> int:
    """The built-in families in their order, then the user's own models."""
    return ARCHS.index(arch) if arch in ARCHS else len(ARCHS)


def _order(strategy: str) -> int:
    return STRATEGIES.index(strategy) if strategy in STRATEGIES else len(STRATEGIES)


def expand(spec: SweepSpec) -> list[PlannedCell]:
    """Every cell of the matrix, validated, with predictions from the calibration store as it is now."""
    workloads = spec.workloads  # resolved once: each cell is planned from its workload's value
    for size in workloads:
        if size.device_kind == "plan":
            raise UsageError(f"--sizes {size.name}: {size.arch} {size.name} ({size.params / 1e9:.1f}B parameters) is "
                             f"for harness plan and harness fit only; bench a smaller size (harness workloads lists "
                             f"them)")
    if set(spec.moe_routings) != {"learned"} and not any(size.moe for size in workloads):
        raise UsageError(f"--moe-routing {','.join(spec.moe_routings)}: only a mixture of experts routes tokens, and "
                         f"no workload of the sweep has experts; add --arch moe (or an MoE --model), or drop "
                         f"--moe-routing")
    strategies = list(spec.strategies)
    added_reference = spec.reference and "single" not in strategies
    if added_reference:
        strategies.insert(0, "single")
    cells: dict[str, PlannedCell] = {}
    for size, seq, routing, prec, scaling, rule, levers, gpus, strat in product(
            workloads, spec.seq_lens, spec.moe_routings, spec.precisions, spec.scalings, spec.lr_rules,
            _levers(spec), spec.gpus, strategies):
        if size.moe is None and routing != "learned":  # a dense model has no routing to vary
            continue
        if prec != "fp8" and (levers["fp8_recipe"] != "tensorwise" or levers["fp8_all_gather"]):
            continue  # the fp8 options vary fp8 cells only
        if levers["pp_schedule"] != spec.pp_schedules[0] and strat not in PP_PRESETS:
            continue  # the schedules vary pipelined cells only
        for degrees in _degrees_of(spec, strat, gpus * spec.nnodes, size):
            cell = _plan_one(spec, size, strat, prec, scaling, rule, gpus=gpus, levers=levers, seq_len=seq,
                             routing=routing, degrees=degrees)
            cell.reference_only = added_reference and strat == "single"
            cells.setdefault(cell.cell_id, cell)  # `single` at several --gpus values is one cell
    for cell in _fp8_references(spec, cells, {size.key: size for size in workloads}):
        cells.setdefault(cell.cell_id, cell)
    ordered = sorted(cells.values(), key=lambda c: (_arch_order(c.raw["arch"]), c.raw["size"], c.raw["seq_len"],
                                                    c.raw["moe_routing"],
                                                    c.raw["precision"], c.raw["scaling"],
                                                    c.raw["lr_rule"], c.raw["world_size"] > 1,
                                                    c.raw["world_size"], _order(c.raw["strategy"]),
                                                    not c.raw["sequence_parallel"],
                                                    PP_SCHEDULES.index(c.raw["pp_schedule"]),
                                                    c.raw["compile"], policy_order(c.raw["ac"]),
                                                    OPTIMIZERS.index(c.raw["optimizer"]),
                                                    CHECKPOINT_MODES.index(c.raw.get("checkpoint", "off"))))
    return predict_cells(ordered, force=spec.force)


def _degrees_of(spec: SweepSpec, strategy: str, world: int, size) -> Sequence[dict | None]:
    """The sweep's ``--degrees``; without them an expert-parallel preset on an MoE runs at every ep that
    divides its shards and experts (ep 2 and 4 at 4 ranks), as ``plan`` and ``fit`` rank them."""
    if strategy == "single":
        return [None]
    if spec.degrees or strategy not in EP_PRESETS or size.moe is None:
        return [spec.degrees]
    return degree_variants(strategy, world, size.moe.n_experts) or [None]


def _levers(spec: SweepSpec) -> list[dict]:
    """Every combination of the lever axes, as cell fields."""
    return [dict(compile=c, ac=a, optimizer=o, sequence_parallel=sp, fp8_recipe=r, fp8_all_gather=ag, pp_schedule=ps,
                 checkpoint=k, checkpoint_every=spec.checkpoint_every, checkpoint_keep=spec.checkpoint_keep and k != "off",
                 restore_from=spec.restore_from)
            for c, a, o, sp, r, ag, ps, k in product(spec.compiles, spec.acs, spec.optimizers, spec.sequence_parallels,
                                                    spec.fp8_recipes, spec.fp8_all_gathers, spec.pp_schedules,
                                                    spec.checkpoints)]


def _fp8_references(spec: SweepSpec, cells: dict[str, PlannedCell],
                    sizes: dict[str, ModelSize | OwnModel]) -> list[PlannedCell]:
    """fp8 is checked against bf16 (the same work, its matmuls in bf16): the bf16 single-device cell of each
    fp8 cell's group, planned as a reference when the sweep does not ask for it."""
    if not spec.reference:
        return []
    out = []
    plain = dict(compile=False, ac="none", optimizer="adamw", sequence_parallel=True, fp8_recipe="tensorwise",
                 fp8_all_gather=False, pp_schedule=spec.pp_schedules[0], checkpoint="off",
                 restore_from=spec.restore_from)
    for c in cells.values():
        r = c.raw
        if r["precision"] != "fp8":
            continue
        ref = _plan_one(spec, sizes[size_key(r["arch"], r["size"])], "single", "bf16", r["scaling"], r["lr_rule"], gpus=1,
                        levers=plain, seq_len=r["seq_len"], routing=r["moe_routing"])
        ref.reference_only = ref.cell_id not in cells
        out.append(ref)
    return out


def _plan_one(spec: SweepSpec, size: ModelSize | OwnModel, strategy: str, precision: str, scaling: str, rule: str, *,
              gpus: int, levers: dict, seq_len: int | None, routing: str = "learned",
              degrees: dict | None = None) -> PlannedCell:
    """One cell of ``size`` at ``seq_len`` tokens per sequence (None: the size's own), its MoE tokens routed by
    ``routing``, at ``degrees`` (None: the strategy's preset)."""
    world = world_for(strategy, gpus * spec.nnodes) if strategy == "single" else gpus * spec.nnodes
    seq = seq_len or size.seq_len
    gb = global_batch(scaling, spec.batch, world)
    if spec.batch_auto:  # a placeholder that divides: the sweep's trials find the batch (harness.run.batch_search)
        gb = world * spec.grad_accum * (spec.microbatches or 2 * world)
    base_batch = spec.base_batch or spec.batch
    raw = dict(size=size.name, strategy=strategy, precision=precision, world_size=world, global_batch=gb,
               seq_len=seq, steps=spec.steps, warmup=spec.warmup, device_kind=spec.device_kind,
               nnodes=1 if world == 1 else spec.nnodes, grad_accum=spec.grad_accum,
               microbatches=spec.microbatches or 1, scaling=scaling, lr_rule=rule,
               base_lr=spec.base_lr, base_batch=base_batch, lr=scaled_lr(rule, spec.base_lr, base_batch, gb),
               lr_warmup_steps=spec.lr_warmup_steps, seed=spec.seed, target_loss=spec.target_loss,
               nvtx=spec.nvtx, monitor_hz=spec.monitor_hz, profile=spec.profile, mem_cap_gib=spec.mem_cap_gib,
               degrees=degrees, batch_auto=spec.batch_auto, arch=size.arch,
               model=size.origin.as_dict() if size.origin is not None else None,
               moe_routing=routing, fp8_emulate=precision == "fp8" and (spec.device_kind == "cpu" or spec.fp8_emulate),
               **levers, **spec.extra)
    try:
        plan = PrecisionPlan(precision, Fp8Options(levers["fp8_recipe"], levers["fp8_all_gather"], raw["fp8_emulate"]))
        plan.check_device(spec.device_kind)
        if isinstance(size, OwnModel):
            layout = _own_layout(size, seq, strategy, world, raw, precision=precision, levers=levers,
                                 grad_accum=spec.grad_accum, global_batch=gb)
        else:
            if seq_error := seq_len_error(size, seq):
                raise UsageError(seq_error)
            layout, raw["microbatches"] = resolve_cell(strategy, world, raw["degrees"], replace(size, seq_len=seq),
                                                       precision, pp_schedule=levers["pp_schedule"],
                                                       microbatches=spec.microbatches, grad_accum=spec.grad_accum,
                                                       global_batch=gb, sequence_parallel=levers["sequence_parallel"])
        check_levers(spec.device_kind, layout.dims.tp_enabled, spec.warmup, levers["compile"], levers["ac"],
                     levers["optimizer"])
        if precision == "fp8":
            check_fp8(plan.fp8, fsdp=layout.fsdp, tp=layout.dims.tp_enabled, device_kind=spec.device_kind)
        cfg = CellConfig(**raw)
    except UsageError as e:
        return PlannedCell(cell_id=cell_id_of(raw), config=None, raw=raw, valid=False, reason=str(e))
    return PlannedCell(cell_id=cfg.cell_id, config=cfg, raw=raw, valid=True, reason=None,
                       capacity_gib=device_capacity_gib(spec.device_kind, max(1, world // raw["nnodes"])))


def _own_layout(own: OwnModel, seq: int, strategy: str, world: int, raw: dict, *, precision: str, levers: dict,
                grad_accum: int, global_batch: int):
    """The checks of a module of your own (:func:`harness.parallel.presets.resolve_own_cell`), and what else it
    cannot take: another sequence than its factory's, a policy that reaches into the harness's own block, fp8."""
    if seq != own.seq_len:
        raise UsageError(f"--seq-len {seq}: {own.name} trains at its factory's seq_len ({own.seq_len}); drop --seq-len")
    if levers["ac"] in ("attn", "op"):
        raise UsageError(f"--ac {levers['ac']} reaches into the harness's own block; a module of your own takes none, "
                         f"full or layerN")
    if precision == "fp8":
        raise UsageError(f"--precision fp8 on {own.name}: fp8 converts the harness's own linears; use bf16 or fp32")
    raw["sequence_parallel"] = False  # its tp_plan says how it shards sequences
    return resolve_own_cell(strategy, world, raw["degrees"], own, precision, grad_accum=grad_accum,
                            global_batch=global_batch)


def calibration_inputs(cfg: CellConfig) -> CalibrationInputs:
    """The calibration store's entries for one cell, as the model takes them.

    None for a device this machine does not have (``harness slurm`` plans GPU cells on a login
    node): its entries could not be told apart, and the prediction says it is uncalibrated.
    """
    local_world = max(1, cfg.world_size // cfg.nnodes)
    threads = threads_for(cfg.device_kind, local_world)
    dtype = PrecisionPlan(cfg.precision).compute_dtype
    if cfg.device_kind == "cuda" and not torch.cuda.is_available():
        return CalibrationInputs(dtype=dtype, threads=threads)
    concurrent = local_world if cfg.device_kind == "cpu" else 1
    matmul = lookup_matmul(cfg.device_kind, dtype, threads)
    workload = lookup_workload(cfg.device_kind, cfg.workload_key, cfg.seq_len, dtype, threads, concurrent, compiled=True) \
        if cfg.compile else None
    compiled = workload is not None
    if workload is None:  # eager passes, or a compiled cell whose compiled passes were not timed (the prediction says so)
        workload = lookup_workload(cfg.device_kind, cfg.workload_key, cfg.seq_len, dtype, threads, concurrent)
    return CalibrationInputs(
        dtype=dtype, threads=threads, workload=workload, workload_compiled=compiled,
        matmul_tflops=matmul["tflops"] if matmul else None,
        comm=lambda group: lookup_comm(cfg.device_kind, group, nnodes=1 if group <= 1 else cfg.nnodes))


def predict_cells(cells: list[PlannedCell], force: bool = False, storage: dict | None = None) -> list[PlannedCell]:
    """The cells with ``predicted`` and ``calibrated_tflops`` from the calibration store as it is now.

    A cell predicted to need more memory per rank than a rank has is made invalid, before
    anything is launched or calibrated for it, unless ``force``. ``harness bench`` calls this
    again after its automatic calibration, so each record carries the prediction made from
    everything measured before the cell ran. ``storage``: the run directory's filesystem entry (a checkpointing
    cell's save seconds).
    """
    out = []
    for c in cells:
        if not c.valid:
            out.append(c)
            continue
        cfg = c.config
        assert cfg is not None, f"valid cell {c.cell_id} has no config"
        cal = replace(calibration_inputs(cfg), storage=storage)
        c = replace(c, predicted=_predict(cfg, cal), calibrated_tflops=cal.matmul_tflops)
        keep = force or c.fits is not False or cfg.batch_auto  # auto: the trials find what fits
        out.append(c if keep else replace(c, valid=False, reason=_unfit_reason(c)))
    return out


def _predict(cfg: CellConfig, cal: CalibrationInputs) -> dict:
    """:func:`predict_cell`, with the calibration entries its step time came from
    (``predicted.calibration``: :func:`harness.calibration.provenance.source` of each) and a note per
    entry stored unsteady. The model reads entries, never the store: the planner records which."""
    used: dict[int, dict] = {}

    def comm(group: int) -> dict | None:
        e = cal.comm(group)
        if e is not None:
            used[group] = e
        return e

    predicted = predict_cell(cfg, replace(cal, comm=comm))
    basis = (predicted.get("breakdown") or {}).get("basis")
    sources = []
    if basis == "workload" and cal.workload is not None:
        sources.append(source("workload", cal.workload))
    elif basis == "matmul peak":
        local_world = max(1, cfg.world_size // cfg.nnodes)
        entry = lookup_matmul(cfg.device_kind, cal.dtype, threads_for(cfg.device_kind, local_world))
        sources += [source("matmul", entry)] if entry else []
    sources += [source("comm", used[g]) for g in sorted(used)]
    sources += [source("storage", cal.storage)] if "checkpoint" in predicted and cal.storage is not None else []
    predicted["calibration"] = sources
    predicted["notes"] += flag_notes(sources)
    return predicted


def _unfit_reason(c: PlannedCell) -> str:
    cfg = c.config
    assert cfg is not None, f"valid cell {c.cell_id} has no config"
    where = ("GPU memory" if cfg.device_kind == "cuda" else
             f"available RAM / {max(1, cfg.world_size // cfg.nnodes)} rank(s) on the node")
    return (f"predicted {c.est_mem_gib:.3g} GiB per rank > {c.capacity_gib:.3g} GiB available ({where}); "
            f"use a smaller size or batch, more ranks, or --force to run it anyway")


def device_capacity_gib(device_kind: str, ranks_per_node: int) -> float | None:
    """Memory one rank may use: the GPU's memory, or the host RAM available now shared by the node's ranks."""
    if device_kind == "cuda":
        try:
            import pynvml  # noqa: PLC0415  (optional: NVML is absent on CPU machines)
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total / GIB
        except pynvml.NVMLError:
            return None
    return psutil.virtual_memory().available / GIB / max(1, ranks_per_node)
