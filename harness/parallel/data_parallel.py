"""Data parallel: DDP (all-reduce), FSDP2 ``fully_shard`` (ZeRO-3 / ZeRO-2-like), HSDP."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from workloads.model import Decoder
from workloads.own_model import OwnModule


def apply_ddp(model: nn.Module, dp_mesh, device_kind: str, comm_hook=None, comm_state=None) -> nn.Module:
    """Wrap in DistributedDataParallel over the replicate group; grads are averaged in backward.

    ``comm_hook``/``comm_state`` optionally replace the all-reduce hook (used to read the
    local gradient before reduction for the gradient noise scale).
    """
    device_ids = [torch.cuda.current_device()] if device_kind == "cuda" else None
    ddp = DDP(model, process_group=dp_mesh.get_group(), device_ids=device_ids, broadcast_buffers=False)
    if comm_hook is not None:
        ddp.register_comm_hook(comm_state, comm_hook)
    return ddp


def apply_fsdp(model: Decoder | OwnModule, dp_mesh, reshard_after_forward: bool, mp_policy) -> nn.Module:
    """FSDP2: shard each block, then the root (embeddings, final norm, head; a module of your own: the rest).

    ``dp_mesh`` is 1-D for FSDP and 2-D (replicate, shard) for HSDP. Per-block wrapping lets
    the all-gather of block i+1 overlap the compute of block i. ``reshard_after_forward=False``
    keeps gathered parameters until backward: ZeRO-2-like (no second all-gather, more memory).
    """
    for _, block in model.block_items():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    # The root's parameters are needed again at the start of backward (the head); keeping them
    # avoids an immediate re-gather, as torchtitan does.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)
    return model
