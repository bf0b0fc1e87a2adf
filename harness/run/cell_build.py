"""A cell's first step on a rank: its device, its model built and parallelized, the training step's context, and
the data each step reads. The worker (:mod:`harness.run.worker`) runs named steps over what this builds and never
learns a strategy's name: a new strategy or lever lands in :mod:`harness.parallel`, not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.measure import gns
from harness.measure.nvtx_ranges import Ranges
from harness.parallel.cp import shard_sequence
from harness.parallel.dims import ParallelDims
from harness.parallel.expert_load import ExpertLoad
from harness.parallel.levers import build_optimizer
from harness.parallel.parallelize import parallelize
from harness.parallel.pipeline import static_shapes
from harness.parallel.presets import Layout
from harness.precision import PrecisionPlan
from harness.run import train
from harness.scaling import lr_at
from harness.spec import CellConfig, threads_per_rank
from workloads.data import MarkovData
from workloads.model import Decoder, lm_loss
from workloads.own_model import OwnModel
from workloads.sizes import ModelSize


@dataclass(frozen=True)
class Placement:
    """Where this rank runs."""

    rank: int
    local_rank: int
    device: torch.device
    threads: int
    """CPU threads this rank computes with."""


def place(cfg: CellConfig) -> Placement:
    """This rank's device (its GPU, or the CPU with the cores shared out) on the initialised process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(f"cell needs world size {cfg.world_size}, process group has {world}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return Placement(rank, local_rank, device, torch.get_num_threads())


@dataclass
class BuiltCell:
    """What a rank trains and how: the parallelized model, its optimizer and the step's context."""

    size: ModelSize | OwnModel
    layout: Layout
    precision: PrecisionPlan
    ctx: train.StepContext
    params: list[torch.nn.Parameter]
    built_params: int
    """Parameters of the model as this rank built it, whole, before any parallelism split it (tied tensors once):
    the ``model`` claim's evidence that the size the record names is the one that ran."""
    ranges: Ranges
    gns_state: gns.LocalGradNorm | None
    """DDP only: the local gradient's norm, for the gradient noise scale."""
    moe: ExpertLoad | None

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims


def build_cell(cfg: CellConfig, device: torch.device) -> BuiltCell:
    """The seeded model, parallelized by the cell's layout and levers, with its optimizer and step context."""
    size, layout = cfg.model_size, cfg.layout  # validated by the planner (resolve_cell) before the launch
    dims = layout.dims
    dims.build_mesh(device.type)
    precision = cfg.precision_plan
    precision.configure_backends(cfg.device_kind)
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = size.module() if isinstance(size, OwnModel) else Decoder(size)
    built_params = sum(p.numel() for p in model.parameters())
    gns_state = gns.LocalGradNorm(process_group=dims.mesh("dp_replicate").get_group()) \
        if layout.data_parallel == "ddp" else None
    # An MoE's stages are static: runtime shape inference would route an uninitialised tensor on later
    # stages and count its load towards the balancing step.
    shapes = static_shapes(dims, cfg.global_batch // dims.dp // cfg.microbatches, cfg.seq_len,
                           size.d_model, size.vocab_size, precision.autocast_dtype, layout.fsdp) if size.moe else None
    par = parallelize(model, layout, device, precision, pp_schedule=cfg.pp_schedule, microbatches=cfg.microbatches,
                      loss_fn=lm_loss, ddp_comm_hook=gns.local_norm_allreduce_hook if gns_state else None,
                      ddp_comm_state=gns_state, ac=cfg.ac, compiled=cfg.compile, stage_shapes=shapes)
    params = [p for p in par.parameters() if p.requires_grad]
    ranges = Ranges(enabled=cfg.nvtx)
    moe = ExpertLoad(par.parts, size, cfg.moe_routing, cfg.ac, device, ranges, dims.tp) if size.moe else None
    ctx = train.StepContext(par=par, optimizer=build_optimizer(params, cfg.optimizer, cfg.lr), precision=precision,
                            scaler=precision.grad_scaler(cfg.device_kind), device_kind=cfg.device_kind,
                            grad_accum=1 if par.pipeline else cfg.grad_accum, ranges=ranges, moe=moe,
                            after_optimizer=precision.after_optimizer_step(par.parts))
    return BuiltCell(size=size, layout=layout, precision=precision, ctx=ctx, params=params,
                     built_params=built_params, ranges=ranges, gns_state=gns_state, moe=moe)


class Batches:
    """Each step's batch as this rank sees it: its data-parallel rows of the global batch, its head and tail
    chunks of each sequence under context parallel (:func:`harness.parallel.cp.shard_sequence`). ``offset``: the
    training step of the cell's step 0 (a cell restored from another run's save after step k starts at k + 1)."""

    def __init__(self, cfg: CellConfig, cell: BuiltCell, device: torch.device, offset: int = 0) -> None:
        dims = cell.dims
        self.cfg, self.device, self.ranges, self.cp, self.offset = cfg, device, cell.ranges, dims.cp, offset
        self.data = MarkovData(cell.size.vocab_size, cfg.seq_len, seed=cfg.seed)
        self.local_batch = cfg.global_batch // dims.dp
        dp_rank = dims.mesh("dp_replicate").get_local_rank() * dims.dp_shard + dims.mesh("dp_shard").get_local_rank()
        self.rows = slice(dp_rank * self.local_batch, (dp_rank + 1) * self.local_batch)
        self.cp_rank = dims.mesh("cp").get_local_rank()

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.ranges.range("data"):
            x, y = self.data.batch(self.offset + step, self.cfg.global_batch)
            x, y = x[self.rows], y[self.rows]
            if self.cp > 1:
                x, y = shard_sequence(x, self.cp_rank, self.cp), shard_sequence(y, self.cp_rank, self.cp)
            return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def lr(self, step: int) -> float:
        """The learning rate at ``step`` (the LR rule's warmup)."""
        return lr_at(self.offset + step, self.cfg.lr, self.cfg.lr_warmup_steps)
