"""Context parallel on plain ``torch.distributed``: each sequence split over ``cp`` ranks, causal
attention over the gathered keys and values. Runs on gloo CPU ranks as on NCCL.

torch's own ``context_parallel()`` intercepts CUDA attention kernels only (and its math path fails
for causal attention, pytorch issue #147793), so the harness shards and attends itself:

* **Head-tail layout** (causal load balance, as torchtitan and Megatron): the sequence is cut into
  ``2 cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``. Under a causal mask a
  query at position ``p`` attends ``p + 1`` keys, so an early chunk is cheap and a late one dear;
  pairing chunk ``r`` with its mirror gives every rank ``(2 cp + 1) c`` key rows per query row pair
  (``c`` the chunk length): the same work (:func:`causal_work`).
* **All-gather K/V** over the CP group in the forward (one call for k and v together), and in the
  backward the matching **reduce-scatter** (sum) of their gradients: each rank's keys are used by every
  rank's queries. Both are ``c10d`` calls the comm counter sees, labelled ``cp``.
* Each local query chunk attends the gathered keys up to its own chunk's end, with the causal mask
  inside that last chunk: a prefix, never the masked future, so the work is what the layout promises. On a GPU
  the mask is flash attention's own lower-right causal one (:func:`chunk_attention`), so the kernel is flash and
  no mask tensor is made: what the what-if prices (flash attention over the gathered keys).
* Positions: each rank's tokens keep their global positions (:meth:`SequenceShard.positions`), for
  RoPE's angles (llama3) and the learned position table (gpt2).

The model calls an attached :class:`SequenceShard` through two hooks (``workloads.model``:
``Attention.seq_shard``, ``Embeddings.seq_shard``), so the workloads import nothing of the harness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from harness.comm_scope import comm_label
from workloads.layers import alibi_bias

# torch 2.13 renamed the tensor collectives (the old names warn); the GPU image's older torch has only those.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

CP_LABEL = "cp"
"""The comm counter's label for context parallel's collectives (``metrics.comm_cp``)."""
CP_TRACE_NAME = "cp_kv"
"""Profiler annotation around them: the step composition gives their exposed time its own share."""


def head_tail_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2 cp``) rank ``rank`` holds: ``r`` and its mirror ``2 cp - 1 - r``."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} outside 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def causal_work(rank: int, cp: int, chunk: int) -> int:
    """Query-key pairs rank ``rank``'s queries attend under the causal mask (``chunk`` tokens per chunk)."""
    return sum(sum(range(j * chunk + 1, (j + 1) * chunk + 1)) for j in head_tail_chunks(rank, cp))


def shard_indices(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions of rank ``rank``'s tokens, in its local order (head chunk, then tail chunk), made on
    ``device`` (no host-to-device copy in the step)."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len ({seq_len}) must be divisible by 2 x cp ({2 * cp})")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in head_tail_chunks(rank, cp)])


def shard_sequence(t: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """This rank's tokens of ``t`` (B, T, ...) along dim 1."""
    return t[:, shard_indices(t.shape[1], rank, cp, t.device)]


def natural_order(gathered: torch.Tensor, dim: int) -> torch.Tensor:
    """The ``2 cp`` chunks along ``dim`` of a rank-major gather (rank r's head chunk ``r``, then its tail chunk
    ``2 cp - 1 - r``) in sequence order: the heads in gathered order, then the tails reversed. Slices and one
    flip, no index tensor (which would be a host-to-device copy in every layer)."""
    pairs = gathered.unflatten(dim, (-1, 2))  # (..., rank, head|tail, ...)
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1).flip(dim)), dim)


def causal_bias(c: int, end: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask (0 or -inf) of ``c`` queries at the last ``c`` of ``end`` key positions, with its rows in
    reverse order, as a ``(c, end)`` view of one ``c + end - 1`` vector: row ``i`` (query ``end - 1 - i``)
    sees keys ``k <= end - 1 - i``, i.e. ``t[i + k] = 0`` iff ``i + k <= end - 1``.

    A boolean ``(c, end)`` mask would be materialised by SDPA as a float one and kept for backward, per chunk
    and layer (``c x end x 4`` bytes): at long sequences more than the K/V it masks. This view costs a vector.
    """
    t = torch.zeros(c + end - 1, dtype=dtype, device=device)
    t[end:] = float("-inf")
    return t.as_strided((c, end), (1, 1))


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool, *, lower_right: bool) -> torch.Tensor:
    """Causal attention of ``c`` queries (B, H, c, E), the last ``c`` of the ``end`` key positions of ``k`` and ``v``.

    * ``lower_right`` (CUDA): torch's lower-right causal bias (``causal_lower_right``), which SDPA runs as flash
      attention's own causal mask with no mask tensor. An additive bias would send SDPA to its memory-efficient
      kernel, which copies a bias whose row stride is not a multiple of 8 into a padded ``(c, end)`` tensor
      (aten's ``preprocess_mask``/``pad_bias``) kept for the backward: ``c x end x 2`` bytes per chunk and layer,
      9 GB a layer at 256k tokens over cp 8, where the kernel it runs is slower than flash too (and where a
      torch's memory-efficient kernel does not take grouped-query heads, SDPA falls to its math path, which
      keeps the whole score matrix). scripts/cp_chunk_attention.py measures both ways on a GPU.
    * otherwise (CPU, meta): :func:`causal_bias`'s zero-copy view, whose rows are reversed (a view needs a positive
      row stride), so the queries are too. SDPA on the CPU takes it as it is; ``causal_lower_right`` there would
      materialise a boolean ``(c, end)`` mask."""
    c, end = q.shape[2], k.shape[2]
    if lower_right:
        # here, not at the top: torch.nn.attention.bias imports torch._dynamo, which a CPU rank never needs
        from torch.nn.attention.bias import causal_lower_right  # noqa: PLC0415

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(c, end), enable_gqa=gqa)
    y = F.scaled_dot_product_attention(q.flip(2), k, v, attn_mask=causal_bias(c, end, q.dtype, q.device),
                                       enable_gqa=gqa)
    return y.flip(2)


class _GatherKV(torch.autograd.Function):
    """All-gather along dim 0 in the forward; reduce-scatter (sum) of the gradient in the backward."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        out = local.new_empty((n * local.shape[0], *local.shape[1:]))
        with comm_label(CP_LABEL), record_function(f"{CP_TRACE_NAME}_all_gather"):
            _ALL_GATHER(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // n, *grad.shape[1:]))
        with comm_label(CP_LABEL), record_function(f"{CP_TRACE_NAME}_reduce_scatter"):
            _REDUCE_SCATTER(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


@dataclass(frozen=True)
class SequenceShard:
    """One rank's place in the context-parallel group: which tokens it holds and how it attends."""

    rank: int
    size: int
    group: object = None
    """The CP process group (None only in single-process tests of the layout)."""

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions of the ``local_len`` tokens this rank holds."""
        return shard_indices(local_len * self.size, self.rank, self.size, device)

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's k (B, H, 2c, E) and v (B, H, 2c, Ev), in natural sequence order (B, H, T, E) and (B, H, T, Ev):
        one all-gather of both, side by side along the head width (their widths differ under MLA)."""
        n, c = self.size, k.shape[2] // 2
        e = k.shape[3]
        both = _GatherKV.apply(torch.cat((k, v), dim=-1).unsqueeze(0), self.group)  # (n, B, H, 2c, E + Ev)
        b, h, w = k.shape[0], k.shape[1], both.shape[-1]
        chunks = both.view(n, b, h, 2, c, w).permute(1, 2, 0, 3, 4, 5).reshape(b, h, 2 * n, c, w)
        full = natural_order(chunks, 2).reshape(b, h, 2 * n * c, w)
        return full[..., :e], full[..., e:]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slopes: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries (B, Hq, 2c, E) over the whole sequence's keys; with ALiBi's
        ``slopes`` (Hq,) of the heads this rank holds, each score biased by ``slope x (key - query)``."""
        kf, vf = self.gather(k, v)
        c = q.shape[2] // 2
        gqa = k.shape[1] != q.shape[1]
        outs = []
        for j, chunk in enumerate(head_tail_chunks(self.rank, self.size)):
            end = (chunk + 1) * c  # keys up to this chunk's last position; the bias masks the chunk's own future
            if slopes is not None:  # ALiBi: a per-head bias over the chunk's global positions (causal inside it)
                mask = alibi_bias(slopes, torch.arange(chunk * c, end, device=q.device),
                                  torch.arange(end, device=q.device), q.dtype)
                outs.append(F.scaled_dot_product_attention(q[:, :, j * c:(j + 1) * c], kf[:, :, :end], vf[:, :, :end],
                                                           attn_mask=mask, enable_gqa=gqa))
                continue
            outs.append(chunk_attention(q[:, :, j * c:(j + 1) * c], kf[:, :, :end], vf[:, :, :end], gqa,
                                        lower_right=q.device.type == "cuda"))
        return torch.cat(outs, dim=2)


def apply_cp(model: nn.Module, mesh) -> SequenceShard:
    """Attach this rank's :class:`SequenceShard` to every attention and embedding of ``model``."""
    shard = SequenceShard(rank=mesh.get_local_rank(), size=mesh.size(), group=mesh.get_group())
    for module in model.modules():
        if hasattr(module, "seq_shard"):
            cast(Any, module).seq_shard = shard  # Embeddings' and Attention's (and MoE's) attribute
    return shard
