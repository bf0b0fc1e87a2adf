"""Compose the strategies in one fixed order.

Order, and why:

1. **Pipeline split first**: every later step applies per stage module, and stage modules
   must exist before their parameters are sharded.
2. **Tensor parallel** next: it replaces parameters by DTensors on the tp mesh; FSDP must see
   those DTensors to shard the remaining dimension (2-D FSDP x TP). **Context parallel** attaches
   each rank's sequence shard to the attentions and embeddings (no parameter changes). **Expert
   parallel** shards the experts (DTensors on the ep mesh) and sets the all-to-all dispatcher.
3. **Activation checkpointing, then ``torch.compile``** (:mod:`harness.parallel.levers`), per
   block, wrapping the TP'd blocks and before FSDP hooks are installed, so the per-block FSDP
   unshard stays outside the checkpointed, compiled region.
4. **FSDP / HSDP / DDP last**: they wrap what the model has become, and their hooks must see
   the final forward. FSDP shards over ``dp_shard x cp`` (the CP ranks' gradients are summed); under
   expert parallel the experts first, over ``efsdp`` (:func:`harness.parallel.ep.shard_experts`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from harness.parallel.activation_checkpoint import apply_ac
from harness.parallel.cp import apply_cp
from harness.parallel.data_parallel import apply_ddp, apply_fsdp
from harness.parallel.dims import FSDP_SHARD_DIM, ParallelDims
from harness.parallel.ep import apply_ep, shard_experts
from harness.parallel.levers import apply_compile
from harness.parallel.parallelized import Parallelized
from harness.parallel.pipeline import StageShapes, build_stage_module
from harness.parallel.presets import Layout
from harness.parallel.schedules import stage_ids, stages_per_rank
from harness.parallel.tp import apply_tp, head_shared_params, reduce_head_shared_grads, reduce_partial_grads
from harness.precision import float8_tp_styles
from workloads.model import Decoder
from workloads.own_model import OwnModule


def parallelize(model: Decoder | OwnModule, layout: Layout, device: torch.device, precision, *,
                pp_schedule: str = "1f1b", microbatches: int = 1, loss_fn=None, ddp_comm_hook=None,
                ddp_comm_state=None, stage_shapes: StageShapes | None = None, ac: str = "none",
                compiled: bool = False) -> Parallelized:
    """Apply the layout's strategies and the levers to ``model`` in the order above
    (``stage_shapes``: static pipeline stages, see :class:`harness.parallel.pipeline.StageShapes`)."""
    dims = layout.dims
    device_kind = device.type
    # 1. pipeline split
    if dims.pp_enabled:
        n_stages = dims.pp * stages_per_rank(pp_schedule)
        pp_rank = dims.mesh("pp").get_local_rank()
        assert isinstance(model, Decoder), "a pipeline splits the harness's own layers (the planner refuses the rest)"
        parts: dict[int, Decoder | OwnModule] = {sid: build_stage_module(model, sid, n_stages)
                                                 for sid in stage_ids(pp_rank, dims.pp, pp_schedule)}
    else:
        n_stages = 1
        parts = {0: model}
    # fp8: the linears become float8 training linears before anything wraps them (torchao)
    fp8 = sorted(name for part in parts.values() for name in precision.convert_linears(part))
    # 2. tensor parallel; with fp8, torchao's float8 styles where the backend moves float8 tensors (NCCL): gloo
    # refuses them ("Invalid scalar type"), so CPU ranks gather bf16 activations into the float8 linears
    if dims.tp_enabled:
        for part in parts.values():
            apply_tp(part, dims.mesh("tp"), dims.sequence_parallel, dims.loss_parallel,
                     float8=bool(fp8) and float8_tp_styles(device_kind))
    if dims.cp_enabled:
        for part in parts.values():
            apply_cp(part, dims.mesh("cp"))
    if dims.ep_enabled:
        for part in parts.values():
            apply_ep(part, dims)
    # 3. activation checkpointing, then compile
    for part in parts.values():
        apply_ac(part, ac)
        if compiled:
            apply_compile(part)
    # 4. data parallel
    dp = layout.data_parallel
    wrapped: nn.Module | None = None
    if layout.fsdp:
        dp_mesh = dims.mesh("dp_replicate", "dp_shard") if dp == "hsdp" else dims.mesh(FSDP_SHARD_DIM)
        for part in parts.values():
            if dims.ep_enabled:
                shard_experts(part, dims.mesh("efsdp"), dims.dp_shard, layout.reshard_after_forward,
                              precision.fsdp_policy())
            apply_fsdp(part, dp_mesh, layout.reshard_after_forward, precision.fsdp_policy())
    elif dp == "ddp":
        wrapped = apply_ddp(parts[0], dims.mesh("dp_replicate"), device_kind, ddp_comm_hook, ddp_comm_state)
    if dims.pp_enabled:
        # only here: a rank without a pipeline never imports torch's pipelining (harness/parallel/pipeline_run.py)
        from harness.parallel.pipeline_run import build_pipeline  # noqa: PLC0415

        pipe = build_pipeline(parts, n_stages, dims.mesh("pp").get_group(), device, pp_schedule, microbatches, loss_fn,
                              stage_shapes)
        return Parallelized(parts=list(parts.values()), model=None, pipeline=pipe, data_parallel=dp,
                            fp8_linears=fp8, step_parts=pipe.clock.lap, **_step_hooks(dims, list(parts.values())))
    callable_model = wrapped or parts[0]
    return Parallelized(parts=[parts[0]], model=callable_model, pipeline=None, data_parallel=dp,
                        fp8_linears=fp8, **_step_hooks(dims, [parts[0]], callable_model))


def _step_hooks(dims: ParallelDims, parts: list[nn.Module], model: nn.Module | None = None) -> dict:
    """What the layout adds to each step, bound once: data parallel's ``no_sync`` for gradient accumulation (the
    callable ``model``'s), sequence parallel's one all-reduce of the norms' partial gradients before the optimizer
    (and, under any tensor parallel, one of the per-head q/k norms' gradients), and loss parallel's context for the
    loss and its backward."""
    shared = head_shared_params(parts) if dims.tp_enabled else []
    group = dims.mesh("tp").get_group() if shared else None

    def reduce() -> int:
        summed = reduce_head_shared_grads(shared, group) if shared else 0
        if dims.sequence_parallel:
            summed += reduce_partial_grads(p for part in parts for p in part.parameters())
        return summed

    return {"no_sync": _no_sync(model), "after_backward": reduce if dims.sequence_parallel or shared else None,
            "loss_parallel": loss_parallel if dims.loss_parallel else None}


def _no_sync(model: nn.Module | None) -> Callable[[], AbstractContextManager[None]] | None:
    if isinstance(model, DistributedDataParallel):
        return model.no_sync
    if not isinstance(model, FSDPModule):
        return None
    fsdp = model

    @contextlib.contextmanager
    def fsdp_no_sync() -> Iterator[None]:
        fsdp.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            fsdp.set_requires_gradient_sync(True)

    return fsdp_no_sync
