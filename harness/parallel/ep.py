"""Expert parallel: each MoE layer's experts split over ``ep`` ranks, tokens sent to them by all-to-all.

The ``ep`` ranks are borrowed from the FSDP shards (``dp_shard = efsdp x ep``, Megatron's EP within
DP; :class:`harness.parallel.dims.ParallelDims`): they hold different tokens, as data-parallel ranks
do, and each holds ``E / ep`` of every layer's experts, the stacked weights a DTensor ``Shard(0)`` on
the ``ep`` mesh. Under tensor parallel (``fsdp+tp+ep``, Megatron's EP x TP with the experts'
tensor-parallel size equal to tp) each expert's width is split too: ``gate`` and ``up`` column-wise
(``Shard(1)``), ``proj`` row-wise (``Shard(2)``) on the (ep, tp) mesh. The tp ranks of one expert-parallel
rank hold the same tokens and route them alike; each exchanges them with its own ep group, computes
its slice of the experts' width, and the partial outputs are summed over tp before they go back
(:class:`_ReduceFromTP`; backward, the rows' partial gradients are summed: :class:`_CopyToTP`).

Every other parameter is FSDP-sharded over all of dp_shard as before; the experts over ``efsdp`` only
(:func:`shard_experts`). An expert's gradient sums the tokens of its ``ep`` peers
(the all-to-all's backward brings them), and FSDP sums those over ``efsdp``: divided by
``efsdp x ep`` it is the data-parallel mean, as for every other parameter.

:class:`AllToAllDispatch`, per MoE layer and micro-batch:

1. the per-expert counts are exchanged (``all_to_all_single`` of ``E`` int64s), so each rank knows
   how many rows it receives from each peer for each of its experts;
2. the rows, grouped by expert and so by destination rank, go out by a variable-split
   ``all_to_all_single`` (:class:`_AllToAll`: its backward is the reverse exchange) and are regrouped
   by local expert;
3. after the experts, the reverse regrouping and exchange bring each row back to its token.

Every exchange, forward and backward, runs under ``comm_label("ep")``, so the comm counter files the
all-to-alls apart. The dispatcher also counts the rows it routed, how many left this rank and how many it received, for
the record (:meth:`harness.parallel.expert_load.ExpertLoad.ep_rows`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from harness.comm_scope import comm_label
from workloads.moe import WIDTH_DIM, MoE, even_split

EP_LABEL = "ep"


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with comm_label(EP_LABEL):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """A variable-split all-to-all whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits  # the forward's, swapped
        return _exchange(grad, out_splits, in_splits, ctx.group), None, None, None


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tp group (each rank saw a slice of the width)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Sums the experts' partial outputs over the tp group; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class AllToAllDispatch:
    """The dispatch and combine of one MoE layer over the ``ep`` group (see the module docstring), the
    experts' width split over ``tp_group`` when given."""

    def __init__(self, group, ep: int, n_experts: int, tp_group=None) -> None:
        self.group, self.ep, self.n_local = group, ep, n_experts // ep
        self.tp_group = tp_group
        self.rank = dist.get_rank(group)
        self.routed = 0
        """Rows (token x expert slots) this rank routed since :meth:`take_counts`."""
        self.left = 0
        """Of those, the rows sent to another rank's experts."""
        self.received = 0
        """Rows this rank's experts received (its own included)."""

    def _splits(self, grouped: torch.Tensor, counts: torch.Tensor, even: bool) -> tuple[list[int], list[list[int]]]:
        """Rows sent to each peer, and ``recv[r][j]``: rows from peer r for local expert j."""
        if even:  # no values to read (fake tensors): every rank splits the same row count alike
            send = even_split(grouped.shape[0], self.ep)
            return send, [even_split(send[self.rank], self.n_local) for _ in range(self.ep)]
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        send = counts.view(self.ep, self.n_local).sum(dim=1).tolist()
        return send, recv.view(self.ep, self.n_local).tolist()

    def dispatch(self, grouped: torch.Tensor, counts: torch.Tensor, even: bool):
        with comm_label(EP_LABEL):
            send, recv = self._splits(grouped, counts, even)
            from_peer = [sum(row) for row in recv]
        rows = _AllToAll.apply(grouped, from_peer, send, self.group)
        self.routed += grouped.shape[0]
        self.left += grouped.shape[0] - send[self.rank]
        self.received += sum(from_peer)
        # received by (peer, local expert); the experts want them by (local expert, peer)
        chunks = rows.split([n for row in recv for n in row])
        by_expert = [chunks[r * self.n_local + j] for j in range(self.n_local) for r in range(self.ep)]
        local_counts = [sum(recv[r][j] for r in range(self.ep)) for j in range(self.n_local)]
        rows = torch.cat(by_expert)
        if self.tp_group is not None:
            rows = _CopyToTP.apply(rows, self.tp_group)
        return rows, local_counts, (send, recv, from_peer)

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        send, recv, from_peer = state
        if self.tp_group is not None:
            y = _ReduceFromTP.apply(y, self.tp_group)
        chunks = y.split([recv[r][j] for j in range(self.n_local) for r in range(self.ep)])
        by_peer = torch.cat([chunks[j * self.ep + r] for r in range(self.ep) for j in range(self.n_local)])
        return _AllToAll.apply(by_peer, send, from_peer, self.group)

    def take_counts(self) -> tuple[int, int, int]:
        """``(routed, left, received)`` since the last call; all restart."""
        out = (self.routed, self.left, self.received)
        self.routed = self.left = self.received = 0
        return out


def _moe_layers(part: nn.Module) -> list[MoE]:
    return [m for m in part.modules() if isinstance(m, MoE)]


def apply_ep(part: nn.Module, dims) -> None:
    """Shard every MoE layer's experts over the ep mesh (dim 0), and their width over tp when it is enabled
    (DTensors), and give each layer the all-to-all dispatcher."""
    if dims.tp_enabled:
        mesh, tp_group = dims.mesh("ep", "tp"), dims.mesh("tp").get_group()
    else:
        mesh, tp_group = dims.mesh("ep"), None
    for layer in _moe_layers(part):
        experts = layer.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            placements = [Shard(0), Shard(WIDTH_DIM[name])] if tp_group is not None else [Shard(0)]
            experts.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, placements)))
        layer.dispatcher = AllToAllDispatch(dims.mesh("ep").get_group(), dims.ep, layer.spec.n_experts, tp_group)


def shard_experts(part: nn.Module, efsdp_mesh, dp_ranks: int, reshard_after_forward: bool, mp_policy) -> None:
    """FSDP over ``efsdp`` for the expert-parallel experts (before their blocks are sharded, so the blocks'
    FSDP leaves them out); their gradients divided by all ``dp_ranks`` (efsdp x ep), the data-parallel mean."""
    # a factor other than the group's size is NCCL's PREMUL_SUM, which gloo lacks: there, divide then sum
    # (not on a 1-rank group, which reduces nothing and divides by the factor itself)
    force_sum = dist.get_backend(efsdp_mesh.get_group()) == "gloo" and efsdp_mesh.size() > 1
    for layer in _moe_layers(part):
        experts = fully_shard(layer.experts, mesh=efsdp_mesh, reshard_after_forward=reshard_after_forward,
                              mp_policy=mp_policy)  # the same module, now an FSDPModule
        experts.set_gradient_divide_factor(float(dp_ranks))
        experts.set_force_sum_reduction_for_comms(force_sum)
