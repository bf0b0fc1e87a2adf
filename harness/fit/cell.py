"""A fit cell: validate it, run each rank role in its own process, compare with the model, record it.

Each role runs as ``python -m harness.fit.role_process`` (a child job that never outlives this call,
:mod:`harness.jobs`), so process groups and peaks never leak from one role into the next.
The record (``kind: "fit"``, docs/records.md) holds every role's measured peak and model-state
bytes beside the analytic model's (:mod:`harness.model.memory`), and whether the largest peak
fits the memory budget.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

from harness.errors import UsageError
from harness.fit.role_spec import RoleSpec
from harness.fit.roles import Role, rank_roles
from harness.jobs import drop_empty_log, run_job
from harness.model.inventory import coords
from harness.model.memory import peak_bytes, stage_peak_bytes, state_bytes_by_rank
from harness.model.shape import CellShape
from harness.parallel.presets import resolve_cell, resolve_own_cell
from harness.precision import PrecisionPlan
from harness.records.atomic import write_json_atomic
from harness.records.env import capture
from harness.records.record import make_record
from harness.units import GIB
from workloads.own_model import OwnModel
from workloads.resolve import workload_of
from workloads.sizes import ModelSize, get_size

ROLE_TIMEOUT_S = 1800.0
OOM_MARKERS = ("MemoryError", "OutOfMemoryError", "out of memory", "can't allocate memory")


@dataclass(frozen=True)
class FitCell:
    """One cell of a fit: a strategy at a world size, with the micro-batch each data-parallel rank runs."""

    size: str
    strategy: str
    precision: str
    world_size: int
    micro_batch: int
    """Sequences per data-parallel rank per micro-step (per pipeline microbatch)."""
    seq_len: int
    microbatches: int
    """Pipeline microbatches (1 without a pipeline)."""
    pp_schedule: str = "1f1b"
    nnodes: int = 1
    degrees: dict | None = None
    device_kind: str = "cpu"
    ac: str = "none"
    """Activation checkpointing (:mod:`harness.parallel.activation_checkpoint`): memory traded for recompute."""
    compute: str = "real"
    """``real`` or ``fake`` (FakeTensorMode): how the roles run, which decides the attention kernel the model
    prices (:attr:`harness.model.shape.CellShape.fake_compute`)."""
    model: dict | None = None
    """A ``--model``'s source (:meth:`workloads.architecture.ModelOrigin.as_dict`); None for a built-in size."""

    @property
    def workload(self) -> ModelSize | OwnModel:
        """The workload this cell names (a size's key, or the model it carries)."""
        return workload_of(self.size, None, self.model)

    @property
    def global_batch(self) -> int:
        dims = self.shape.dims
        return self.micro_batch * dims.dp * (self.microbatches if dims.pp_enabled else 1)

    @property
    def cell_id(self) -> str:
        parts = [self.size, self.strategy, self.precision, f"w{self.world_size}", f"mb{self.micro_batch}"]
        if self.strategy.startswith("pp"):
            parts.append(f"{self.pp_schedule}-m{self.microbatches}")
        if self.ac != "none":
            parts.append(f"ac-{self.ac}")
        degrees = self.degrees or {}
        for dim in ("cp", "ep"):  # a context- or expert-parallel preset is fitted at every degree
            if degrees.get(dim, 1) > 1:
                parts.append(f"{dim}{degrees[dim]}")
        if self.seq_len != self.workload.seq_len:  # the size's own length keeps the id it always had
            parts.append(f"s{self.seq_len}")
        return "-".join(parts)

    @property
    def shape(self) -> CellShape:
        w = self.workload
        if isinstance(w, OwnModel):  # only its tensors are read (the model states): a stand-in for a size
            size = cast(ModelSize, w)
            from_layout = resolve_own_cell(self.strategy, self.world_size, self.degrees, w, self.precision,
                                           grad_accum=1, global_batch=self.world_size)
        else:
            size = replace(w, seq_len=self.seq_len)
            from_layout = plan_layout(self.strategy, self.world_size, self.degrees, size, self.precision,
                                      self.pp_schedule, self.microbatches)
        dims = from_layout.dims
        gb = self.micro_batch * dims.dp * (self.microbatches if dims.pp_enabled else 1)
        return CellShape(size=size, dims=dims, strategy=self.strategy, precision=self.precision, global_batch=gb,
                         microbatches=self.microbatches, pp_schedule=self.pp_schedule, device_kind=self.device_kind,
                         recompute=self.ac, fake_compute=self.compute == "fake")

    def role_spec(self, role: Role, steps: int) -> RoleSpec:
        return RoleSpec(size=self.size, strategy=self.strategy, precision=self.precision, world_size=self.world_size,
                        rank=role.rank, micro_batch=self.micro_batch, seq_len=self.seq_len,
                        microbatches=self.microbatches, pp_schedule=self.pp_schedule, steps=steps,
                        device_kind=self.device_kind, compute=self.compute, degrees=self.degrees, ac=self.ac,
                        model=self.model)


def plan_layout(strategy: str, world: int, degrees: dict | None, size, precision: str, pp_schedule: str,
                microbatches: int):
    """The planner's checks (:func:`harness.parallel.presets.resolve_cell`) at a batch that always splits."""
    layout, _ = resolve_cell(strategy, world, degrees, size, precision, pp_schedule=pp_schedule,
                             microbatches=microbatches, grad_accum=1, global_batch=world * microbatches)
    return layout


def plan_fit_cell(size: str | ModelSize | OwnModel, strategy: str, precision: str, world: int, micro_batch: int, device_kind: str,
                  *, seq_len: int | None = None, microbatches: int | None = None, pp_schedule: str = "1f1b",
                  nnodes: int = 1, degrees: dict | None = None, ac: str = "none", compute: str = "real") -> FitCell:
    """A validated cell of ``size`` (a size's key, or the workload itself); UsageError (naming the value and the fix)
    when the strategy cannot run at ``world``."""
    workload = get_size(size) if isinstance(size, str) else size
    seq = seq_len or workload.seq_len
    PrecisionPlan(precision).check_device(device_kind)
    if isinstance(workload, OwnModel):
        if seq != workload.seq_len or ac in ("attn", "op"):
            raise UsageError(f"{workload.name} fits at its factory's seq_len ({workload.seq_len}) with --ac none, full "
                             f"or layerN; got seq {seq}, ac {ac}")
        layout, mb = resolve_own_cell(strategy, world, degrees, workload, precision, grad_accum=1,
                                      global_batch=world), 1
    else:
        layout, mb = resolve_cell(strategy, world, degrees, replace(workload, seq_len=seq), precision,
                                  pp_schedule=pp_schedule, microbatches=microbatches, grad_accum=1,
                                  global_batch=world * (microbatches or 2 * world))
    return FitCell(size=workload.key, strategy=strategy, precision=precision, world_size=world, micro_batch=micro_batch,
                   seq_len=seq, microbatches=mb if layout.dims.pp_enabled else 1, pp_schedule=pp_schedule,
                   nnodes=nnodes, degrees=degrees, device_kind=device_kind, ac=ac, compute=compute,
                   model=workload.origin.as_dict() if workload.origin is not None else None)


@dataclass(frozen=True)
class RoleOutcome:
    role: Role
    status: str
    """``ok``, ``oom`` (the device ran out: does not fit) or ``crashed``."""
    result: dict | None
    error: str | None = None


def run_roles(cell: FitCell, work_dir: Path, steps: int) -> list[RoleOutcome]:
    """Every role of the cell, each in its own process, one after another."""
    work_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for role in rank_roles(cell.shape):
        tag = f"{cell.cell_id}-rank{role.rank}"
        spec_path, result_path, log_path = (work_dir / f"{tag}.spec.json", work_dir / f"{tag}.result.json",
                                            work_dir / f"{tag}.log")
        write_json_atomic(spec_path, cell.role_spec(role, steps).to_dict())
        result_path.unlink(missing_ok=True)
        rc = run_job([sys.executable, "-m", "harness.fit.role_process", "--spec", str(spec_path), "--out", str(result_path)],
                     log_path, ROLE_TIMEOUT_S)
        if rc == 0 and result_path.exists():
            drop_empty_log(log_path)
            out.append(RoleOutcome(role, "ok", json.loads(result_path.read_text())))
            continue
        log = log_path.read_text(errors="replace")
        status = "oom" if any(m in log for m in OOM_MARKERS) else "crashed"
        reason = "timed out" if rc is None else f"exit {rc}: {_last_error_line(log)}"
        out.append(RoleOutcome(role, status, None, f"rank {role.rank} ({role.name}) {reason}; log {log_path}"))
    return out


def _last_error_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if "Error" in ln or "error" in ln]
    return (lines[-1] if lines else (log.strip().splitlines() or ["no output"])[-1])[-300:]


def pct_error(predicted: float, measured: float) -> float | None:
    """``100 (predicted - measured) / measured``; None when nothing was measured."""
    return 100.0 * (predicted - measured) / measured if measured else None


def fit_record(run_id: str, cell: FitCell, outcomes: list[RoleOutcome], device_mem_gib: float, steps: int,
               batch_search: dict | None = None) -> dict:
    """The cell's ``kind: "fit"`` record: measured roles, the model beside them, fits or not (and, for
    ``--batch auto``, every micro-batch tried)."""
    shape = cell.shape
    own = isinstance(cell.workload, OwnModel)  # a module of your own: its model states priced, its peak not
    states = state_bytes_by_rank(shape)
    predicted_peak = None if own else peak_bytes(shape, 0.0)
    stage_of = [k.pp for k in coords(shape.dims)]
    roles: list[dict[str, Any]] = []
    for o in outcomes:
        role_peak = None if own else stage_peak_bytes(shape, stage_of[o.role.rank])  # a stage's own, not the largest
        row: dict[str, Any] = {"role": o.role.name, "rank": o.role.rank, "ranks": len(o.role.ranks),
                               "status": o.status, "error": o.error,
                               "predicted_model_state_bytes": states[o.role.rank].total,
                               "predicted_peak_mem_gib": role_peak / GIB if role_peak is not None else None}
        if o.result is not None:
            peak = o.result["peak_bytes"]
            row.update(peak_mem_gib=peak / GIB, peak_mem_kind=o.result["peak_kind"],
                       model_state_bytes=o.result["model_state_bytes"]["total"],
                       model_state_breakdown=o.result["model_state_bytes"],
                       peak_error_pct=pct_error(role_peak, peak) if role_peak is not None else None,
                       model_state_exact=o.result["model_state_bytes"]["total"] == states[o.role.rank].total,
                       fits=peak / GIB <= device_mem_gib)
        else:
            row["fits"] = False if o.status == "oom" else None
        roles.append(row)
    measured = [r["peak_mem_gib"] for r in roles if "peak_mem_gib" in r]
    failed = [o for o in outcomes if o.status != "ok"]
    status = "ok" if not failed else ("oom" if all(o.status == "oom" for o in failed) else "crashed")
    peak = max(measured) if measured and not failed else None
    fits = (peak <= device_mem_gib) if peak is not None else (False if status == "oom" else None)
    metrics = {
        "collectives": "fake: no time or throughput is measured",
        "compute": cell.compute,
        "steps": steps,
        "roles": roles,
        "peak_mem_gib": peak,
        "peak_mem_kind": roles[0].get("peak_mem_kind") if roles else None,
        "model_state_bytes_per_rank": max((r["model_state_bytes"] for r in roles if "model_state_bytes" in r),
                                          default=None),
        "device_mem_gib": device_mem_gib,
        "fits": fits,
        "headroom_gib": device_mem_gib - peak if peak is not None else None,
    }
    if batch_search is not None:
        metrics["batch_search"] = batch_search
    config = {**{k: v for k, v in asdict(cell).items() if k != "model" or v is not None}, "global_batch": cell.global_batch,
              "steps": steps}
    predicted = {"model": "harness.model", "peak_mem_gib": predicted_peak / GIB if predicted_peak is not None else None,
                 "model_state_bytes_per_rank": max(s.total for s in states),
                 "peak_error_pct": pct_error(predicted_peak, peak * GIB) if peak and predicted_peak else None}
    return make_record(run_id=run_id, cell_id=cell.cell_id, status=status, config=config,
                       env=capture(cell.device_kind), degrees=shape.dims.degrees(),
                       workload={**shape.size.as_dict()}, metrics=metrics, kind="fit", predicted=predicted,
                       error="; ".join(o.error for o in failed if o.error) or None)
