"""A cell's compute on a GPU, op by op: the kernels each pipeline rank runs for one microbatch (traced,
:mod:`harness.model.op_trace`), split as tensor parallel splits them, fused under compile, with fp8's casts, priced
on the device (:mod:`harness.model.op_cost`).

* **Blocks**: one trace per kind of block the rank holds (dense or MoE; checkpointed whole or not under ``layerN``),
  at the rank's microbatch rows and local sequence (context parallel: ``seq / cp`` queries over the gathered keys),
  its experts (expert parallel: ``E / ep`` experts over the rows routed to them), its policy.
* **Ends**: the embedding on the first stage; the final norm, the LM head and the loss on the last; eager under
  compile too (only the blocks are compiled: :func:`harness.parallel.levers.apply_compile`, as torchtitan does).
* **FSDP's copies**, per microbatch: the all-gathered parameters copied out of the gather buffer in the forward and
  again in the backward (``2 x 2`` bytes of the parameter dtype per parameter: read and write), and each gradient
  copied into the reduce-scatter buffer in fp32 (read in the parameter dtype, written in fp32).
* **fp8** (torchao's float8 linears, tensorwise): traced as torchao runs them where torchao is installed; without
  it, each GEMM of a converted linear (:func:`fp8_linear_names`) runs in float8 (its operands at 1 byte), and each
  of its two operands is cast first: an amax (a read) and a scaled cast (a read and a write at 1 byte). Compiled,
  either way, the amax ends a kernel (no element is cast before it has seen them all) and the cast fuses with what
  follows: two passes over the operand.
* **A split backward** (the zero-bubble schedules) runs a checkpointed block's recomputation once per autograd pass
  that unpacks it: ``1 + s G`` times, G its weight groups inside the region and s the share of the stage's backwards
  the schedule splits, and once on the first stage (:mod:`harness.model.split_backward`).
* **The optimizer**: AdamW's bytes per parameter traced (:func:`harness.model.op_trace.optimizer_bytes_per_param`)
  over the parameters the rank holds, at the device's bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from harness.model.block_ops import fp8_linears
from harness.model.inventory import held_shape, param_specs, rank_layer_ids, rank_params, stage_of, stages_of_rank
from harness.model.op_cost import Device, PassCost, fuse, price, split_for_tp
from harness.model.op_record import GEMM, MEMORY, RECOMPUTE, Op
from harness.model.op_trace import TraceSpec, optimizer_bytes_per_param, trace_block, trace_ends
from harness.model.shape import LOW_BYTES, CellShape
from harness.model.split_backward import block_recomputes, split_share
from harness.parallel.activation_checkpoint import checkpointed_layer
from harness.parallel.schedules import ZERO_BUBBLE_SCHEDULES


def trace_spec(c: CellShape, fused_norm: bool = True, fp8_recipe: str = "tensorwise") -> TraceSpec:
    """What a rank's microbatch is traced at (``fused_norm``: torch's fused RMSNorm kernel, torch 2.8 onwards)."""
    low = c.precision in ("bf16", "fp16", "fp8")
    return TraceSpec(rows=c.microbatch_rows, seq=c.local_seq, precision="fp32" if c.precision == "tf32" else
                     c.precision, low_params=c.fsdp and low, recompute=c.recompute, fused_norm=fused_norm,
                     cp=c.dims.cp, ep=c.dims.ep, fp8_recipe=fp8_recipe)


def fp8_linear_names(c: CellShape, layer: int) -> frozenset[str]:
    """The converted linears of block ``layer``, named under the block (``attn.q``)."""
    prefix = f"blocks.{layer}."
    return frozenset(n.removeprefix(prefix) for n in fp8_linears(c.size) if n.startswith(prefix))


def _with_fp8(ops: list[Op], converted: frozenset[str]) -> list[Op]:
    """fp8's GEMMs and casts (the module docstring): each converted GEMM at 1 byte an operand, after the casts of
    its two operands, each an amax (the whole operand to a scalar) and a scaled cast, with the tensors each reads
    and writes so that compile's fusion follows them (:func:`harness.model.op_cost.fuse`: the amax ends a kernel)."""
    out: list[Op] = []
    fresh = -1  # storages the casts make: negative ids, apart from the trace's own
    for op in ops:
        if op.kind != GEMM or op.module not in converted:
            out.append(op)
            continue
        batch, m, n, k = op.gemm
        operands = list(op.reads[:2]) + [(None, 0)] * (2 - len(op.reads[:2]))
        fp8_reads = []
        for (sid, _), (rows, cols) in zip(operands, ((m, k), (k, n)), strict=True):
            elems = batch * rows * cols
            src = sid if sid is not None else fresh
            scale, cast, fresh = fresh - 1, fresh - 2, fresh - 3
            out.append(replace(op, name="amax", kind=MEMORY, flops=0.0, read=2 * elems, written=4, dtype="",
                               reads=((src, 2 * elems),), writes=((scale, 4),)))
            out.append(replace(op, name="cast_to_fp8", kind=MEMORY, flops=0.0, read=2 * elems + 4, written=elems,
                               dtype="", reads=((src, 2 * elems), (scale, 4)), writes=((cast, elems),)))
            fp8_reads.append((cast, elems))
        out.append(replace(op, dtype="fp8", read=op.read // 2, written=op.written,
                           reads=tuple(fp8_reads) + op.reads[2:]))
    return out


def _block_ops(c: CellShape, layer: int, compile: bool, fused_norm: bool, fp8_recipe: str,
               reduction_share: float) -> list[Op]:
    """Block ``layer``'s kernels for one microbatch (its recomputation once)."""
    size = c.size
    traced = trace_block(size, same_kind(c, layer), trace_spec(c, fused_norm, fp8_recipe))
    ops = [split_for_tp(o, c.dims.tp, c.dims.sequence_parallel, size.is_moe_layer(layer)) for o in traced]
    if c.precision == "fp8" and not any(o.dtype == "fp8" for o in ops):  # torchao absent: the stated rule
        ops = _with_fp8(ops, fp8_linear_names(c, layer))
    if c.precision == "tf32":
        ops = [replace(o, dtype="tf32") if o.kind == GEMM else o for o in ops]
    if compile:
        ops = fuse(ops, reduction_share)
    return ops


def block_runs(c: CellShape) -> dict[int, float]:
    """:func:`recomputes` of every block, one trace per kind of block (its recomputation and weight groups are its
    kind's)."""
    size, spec = c.size, trace_spec(c)
    if not (c.dims.pp_enabled and c.pp_schedule in ZERO_BUBBLE_SCHEDULES):
        return dict.fromkeys(range(size.n_layers), 1.0)
    return {layer: recomputes(c, layer, trace_block(size, same_kind(c, layer), spec)) for layer in range(size.n_layers)}


def same_kind(c: CellShape, layer: int) -> int:
    """The first block of ``layer``'s kind (dense or MoE, checkpointed whole or not): one trace stands for them."""
    size = c.size
    kind = (size.is_moe_layer(layer), checkpointed_layer(c.recompute, layer))
    return next(i for i in range(size.n_layers) if (size.is_moe_layer(i), checkpointed_layer(c.recompute, i)) == kind)


def recomputes(c: CellShape, layer: int, traced: Iterable[Op]) -> float:
    """How many times per microbatch block ``layer`` runs its recomputation: once, or under a zero-bubble schedule's
    split backward once per autograd pass that unpacks it (:mod:`harness.model.split_backward`)."""
    if not (c.dims.pp_enabled and c.pp_schedule in ZERO_BUBBLE_SCHEDULES):
        return 1.0
    params = [p for p in param_specs(c.size) if p.layer == layer]
    stage = stage_of(params[0], c.dims.pp * c.virtual, c.size.n_layers)
    prefix = f"blocks.{layer}."
    return block_recomputes(traced, [p.name.removeprefix(prefix) for p in params], first_stage=stage == 0,
                            share=split_share(c.pp_schedule, c.dims.pp, c.microbatches, stage))


def _end_ops(c: CellShape, first: bool, last: bool, fused_norm: bool) -> list[Op]:
    ops = []
    for o in trace_ends(c.size, trace_spec(c, fused_norm)):
        if (o.module.startswith("embed") and first) or (not o.module.startswith("embed") and last):
            ops.append(split_for_tp(o, c.dims.tp, c.dims.sequence_parallel))
    if c.precision == "tf32":
        ops = [replace(o, dtype="tf32") if o.kind == GEMM else o for o in ops]
    return ops


def _fsdp_copy_bytes(c: CellShape, params: int) -> int:
    """FSDP's copies per microbatch (the module docstring) over the ``params`` a rank's stages gather."""
    if not c.fsdp:
        return 0
    pb = LOW_BYTES[c.precision] if c.precision != "tf32" else 4
    gathers = 2 if c.reshard_after_forward else 1
    return params * (gathers * 2 * pb + pb + 4)


def rank_passes(c: CellShape, dev: Device, compile: bool = False, fused_norm: bool = True,
                fp8_recipe: str = "tensorwise", reduction_share: float = 1.0) -> list[PassCost]:
    """Per pipeline rank: one microbatch's forward and backward (and recomputation), priced op by op; ``fused_norm``
    False prices RMSNorm as the separate kernels torch ran before its fused kernel (torch 2.8, pytorch#153666);
    ``reduction_share``: what compile's fused reduction kernels reach of the bandwidth (:func:`fuse`)."""
    n_stages = c.dims.pp * c.virtual
    bw = dev.hbm_gbps * 1e9 * dev.rates.bandwidth_efficiency
    out = []
    runs = block_runs(c)
    for pp_rank in range(c.dims.pp):
        stages = stages_of_rank(pp_rank, c.dims.pp, c.virtual, c.v_shape)
        ops: list[Op] = []
        again: list[tuple[list[Op], float]] = []  # a split backward's further recomputations
        for layer in rank_layer_ids(c.size.n_layers, c.dims.pp, c.virtual, pp_rank, c.v_shape):
            block = _block_ops(c, layer, compile, fused_norm, fp8_recipe, reduction_share)
            ops += block
            if runs[layer] > 1:
                again.append(([op for op in block if op.phase == RECOMPUTE], runs[layer] - 1))
        ops += _end_ops(c, first=0 in stages, last=n_stages - 1 in stages, fused_norm=fused_norm)
        cost = price(ops, dev)
        for recomputation, times in again:
            cost.add(price(recomputation, dev), times)
        gathered = sum(math.prod(held_shape(p, c.dims)) for p in rank_params(c.size, c.dims, c.virtual, pp_rank,
                                                                             c.v_shape))
        copies = _fsdp_copy_bytes(c, gathered) / bw
        cost.seconds[MEMORY] += copies
        cost.total_s += copies
        out.append(cost)
    return out


def optimizer_s_per_param(c: CellShape, dev: Device) -> float:
    """AdamW's step per parameter a rank holds: its traced bytes at the device's bandwidth."""
    kind = c.optimizer if c.optimizer in ("adamw", "adamw-fused") else "adamw"
    return optimizer_bytes_per_param(kind) / (dev.hbm_gbps * 1e9 * dev.rates.bandwidth_efficiency)
