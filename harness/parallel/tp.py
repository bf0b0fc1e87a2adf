"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) with DTensor plans, optional sequence parallel.

Per block: q/k/v and the MLP's input linears are column-parallel (:data:`COLUMN_LINEARS`), the
attention output and MLP proj are row-parallel, so each
block costs one all-reduce in forward and one in backward per sub-layer (attention, MLP).
With sequence parallel (Korthikanti et al. 2022), the residual stream and LayerNorms are
sharded along the sequence: the all-reduces become all-gather + reduce-scatter pairs and
activation memory outside the matmuls drops by ``tp``.

Embeddings stay replicated (lookups, small at CPU sizes); the LM head is column-parallel. Its logits are
gathered whole, or, under loss parallel (which goes with sequence parallel, as torchtitan pairs them), kept
sharded over the vocabulary for torch's vocabulary-parallel cross-entropy
(:func:`torch.distributed.tensor.parallel.loss_parallel`): each rank holds ``V / tp`` of every token's logits.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from harness.parallel.tp_plan import COLUMN_LINEARS, HEAD_SHARED, ROW_LINEARS
from workloads.layers import ProjNorm
from workloads.model import Decoder, LatentAttention
from workloads.moe import MoE
from workloads.own_model import OwnModule


def _float8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"  # torchao's, converted by harness.precision (an optional extra)


def _styles(float8: bool):
    """Column, row and input-preparing styles: torch's, or torchao's float8 ones (tensorwise scaling), which cast
    to float8 before the all-gather so that sequence parallel gathers float8 activations once per sub-layer."""
    if not float8:
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (  # noqa: PLC0415 (optional extra)
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def apply_tp(model: Decoder | OwnModule, tp_mesh, sequence_parallel: bool, loss_parallel: bool = False,
             float8: bool = False) -> None:
    """Shard ``model`` (a :class:`workloads.model.Decoder` or a pipeline stage of one) over ``tp_mesh``; with
    ``loss_parallel`` the LM head's logits stay sharded over the vocabulary (a DTensor, for
    :func:`torch.distributed.tensor.parallel.loss_parallel`'s cross-entropy). ``float8``: the linears torchao
    converted take its float8 styles (the others, the LM head among them, torch's)."""
    if isinstance(model, OwnModule):  # a module of your own: its factory's plan, as given (the planner checked it)
        parallelize_module(model.inner, tp_mesh, model.tp_plan)
        return
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    top: dict = {}
    if model.embed is not None and sp:
        # Replicated embedding output -> sequence shards (a local slice, no communication).
        top["embed"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        )
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.head is not None:
        top["head"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                      use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)
    if sp and model.embed is None:
        # A pipeline stage that receives plain sequence-sharded activations from the previous stage.
        parallelize_module(
            model,
            tp_mesh,
            PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=False),
        )
    if sp and model.head is None:
        # A pipeline stage that sends its sequence shard on as a plain tensor: the schedule's send and receive
        # move tensors, and a DTensor's metadata names a mesh the next stage's ranks do not hold.
        parallelize_module(
            model,
            tp_mesh,
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(1), use_local_output=True),
        )
    for block in model.blocks.values():
        present = dict(block.named_modules())
        moe = isinstance(block.mlp, MoE)
        _place_attention_extras(cast(nn.Module, block.attn), tp_mesh)
        styles = {name: _styles(float8 and _float8(present[name])) for name in COLUMN_LINEARS + ROW_LINEARS
                  if name in present}
        plan: dict[str, ParallelStyle] = {name: styles[name][0]() for name in COLUMN_LINEARS if name in present}
        plan.update({name: styles[name][1](output_layouts=residual, use_local_output=not sp)
                     for name in ROW_LINEARS if name in present})
        if moe and "mlp.shared.proj" in present:  # inside the MoE, on its plain (tokens, d) rows
            plan["mlp.shared.proj"] = styles["mlp.shared.proj"][1](output_layouts=Replicate(), use_local_output=True)
        if sp:
            gather = {sub: _styles(float8 and all(_float8(present[n]) for n in COLUMN_LINEARS
                                                  if n.startswith(sub + ".") and n in present))[2]
                      for sub in ("attn", "mlp")}
            plan.update(
                {
                    "ln1": SequenceParallel(),
                    "ln2": SequenceParallel(),
                    # MLA's low-rank down-projections are plain linears on every rank: they take a plain tensor
                    "attn": gather["attn"](input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                           use_local_output=isinstance(block.attn, LatentAttention)),
                    "mlp": _moe_sp() if moe else gather["mlp"](input_layouts=(Shard(1),),
                                                              desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(block, tp_mesh, plan)


def _place_attention_extras(attn: nn.Module, tp_mesh) -> None:
    """What an attention holds besides its linears, placed for this rank's heads: ALiBi's slopes (the rank's index
    picks its heads'), MLA's shared rotary key (its gradient summed over tp), q/k norms over the whole projection (their weights sharded with the projection's columns,
    their squares summed over tp: :class:`workloads.layers.ProjNorm`)."""
    if getattr(attn, "alibi", None) is not None:
        cast(Any, attn).tp_rank = tp_mesh.get_local_rank()
    if isinstance(attn, LatentAttention):  # the shared rotary key's gradient, summed over the heads of every rank
        attn.tp_group = tp_mesh.get_group()
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name, None)
        if isinstance(norm, ProjNorm):
            norm.weight = nn.Parameter(distribute_tensor(norm.weight.data, tp_mesh, [Shard(0)]))
            norm.group = tp_mesh.get_group()


def head_shared_params(parts: list[nn.Module]) -> list[nn.Parameter]:
    """The per-head norm weights of ``parts`` (a model whose q/k norms span the whole projection has none)."""
    return [p for part in parts for name, p in part.named_parameters()
            if name.endswith(HEAD_SHARED) and not isinstance(part.get_submodule(name.rsplit(".", 1)[0]), ProjNorm)]


def reduce_head_shared_grads(params: list[nn.Parameter], group) -> int:
    """Sum the per-head norm weights' gradients over the tp group in one all-reduce before the optimizer (each rank's
    holds its heads' share; under FSDP each rank's shard of it, the same elements on every tp rank). Returns the
    tensors reduced."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in local:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(grads)


def _moe_sp() -> PrepareModuleInputOutput:
    """An MoE layer under sequence parallel: it routes the all-gathered sequence as plain tensors (every tp
    rank the same tokens, as without sequence parallel: :mod:`harness.parallel.ep`) and returns them summed
    over tp, of which each rank keeps its sequence shard (a slice; the gradient is all-gathered back)."""
    return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_input=True, output_layouts=(Replicate(),),
                                    desired_output_layouts=(Shard(1),), use_local_output=False)


def partial_grad_params(params) -> list[nn.Parameter]:
    """The parameters whose gradients are ``Partial`` DTensors: replicated weights that saw only
    this rank's shard of the input (the LayerNorms under sequence parallelism)."""
    return [p for p in params if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)]


def reduce_partial_grads(params) -> int:
    """Sum the ``Partial`` gradients over their group in one all-reduce, before the optimizer.

    Under sequence parallelism the LayerNorm weights are replicated but see only their rank's
    sequence shard, so their gradients are ``Partial``. Left so, AdamW's foreach ops redistribute
    each one at every use: three all-reduces per tensor (measured on ``tiny``, tp-sp over 2 ranks:
    54 calls for its 18 LayerNorm tensors), issued inside DTensor's op dispatch, where a dispatch
    mode above it (:class:`harness.measure.comm_counter.CommCounter`) cannot see them. Megatron-LM
    all-reduces these sequence-parallel gradients in one coalesced call before the optimizer;
    this does the same, and the collective is counted. Returns the tensors reduced.
    """
    partial = partial_grad_params(params)
    if not partial:
        return 0
    grads = [cast(DTensor, p.grad) for p in partial]  # DTensors: partial_grad_params checked
    mesh = grads[0].device_mesh
    if mesh.ndim != 1 or any(g.device_mesh != mesh for g in grads):
        raise ValueError(f"partial gradients over a {mesh.ndim}-D mesh or several meshes; "
                         f"only sequence parallelism over one tp mesh makes them")
    local = [g.to_local() for g in grads]
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=mesh.get_group())
    offset = 0
    for p, g in zip(partial, local, strict=True):
        n = g.numel()
        p.grad = DTensor.from_local(flat[offset:offset + n].view_as(g), mesh, [Replicate()], run_check=False)
        offset += n
    return len(partial)
