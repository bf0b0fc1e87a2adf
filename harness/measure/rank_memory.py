"""Memory per rank: allocator peaks on GPU, peak RSS on CPU, and model-state bytes."""

from __future__ import annotations

import resource

import torch
from torch import nn

from harness.units import GIB


def reset_peak(device_kind: str) -> None:
    if device_kind == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device_kind: str) -> dict:
    """``peak_mem_gib`` and its kind: CUDA allocated (+ reserved), or the process's peak RSS."""
    if device_kind == "cuda":
        return {
            "peak_mem_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_mem_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
            "peak_mem_kind": "cuda_allocated",
            "mem_capacity_gib": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB,
        }
    # ru_maxrss is in KiB on Linux.
    return {"peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, "peak_mem_kind": "rss"}


def _local_nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def model_state_bytes(parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict:
    """Parameters + gradients + optimizer state this rank actually holds (local shards only)."""
    params = grads = 0
    seen: set[int] = set()
    for part in parts:
        for p in part.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            params += _local_nbytes(p)
            if p.grad is not None:
                grads += _local_nbytes(p.grad)
    opt = sum(_local_nbytes(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}
