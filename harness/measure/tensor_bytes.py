"""Peak bytes of live tensor storages: a device-independent memory measure for CPU ranks.

On a CPU rank, peak RSS counts the Python interpreter, torch's libraries, the allocator's
free lists and the pages a freed tensor leaves mapped, so it cannot tell a 1/64 shard from a
1/32 one. This counts what the CUDA allocator's ``max_memory_allocated`` counts: the bytes of
every tensor storage alive at once. A ``TorchDispatchMode`` sees each op's outputs (factory
functions, collectives' output buffers and autograd's gradients included); each new storage is
counted once (views share it; torch keeps one Python object per storage, so it is the key) until
it is freed (a weak-reference callback). A DTensor counts as its local shard; the temporaries of
DTensor's own redistributions run inside its dispatch and are not seen. Storages that
exist before tracking starts (parameters, gradients, optimizer state) are registered with
:meth:`TensorBytes.hold`. Allocations a backend makes in C++ without a tensor (gloo's scratch
buffers) are not seen, on either side of a comparison. Under ``FakeTensorMode`` (entered before
this mode) the same bookkeeping counts the bytes fake tensors would hold.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the storage this rank holds), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class TensorBytes(TorchDispatchMode):
    """``with TensorBytes() as tb: ...`` then ``tb.peak_bytes``; ``tb.reset_peak()`` restarts the peak."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        """id() of each tracked storage -> its bytes (an entry leaves when the storage is freed)."""
        self.live_bytes = 0
        self.peak_bytes = 0

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count storages that already exist (parameters, their gradients, optimizer state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t)

    def hold_bytes(self, nbytes: int) -> None:
        """Count bytes a backend allocated in C++ where no dispatch sees them and that stay for the
        step (DDP's gradient buckets: :func:`ddp_bucket_bytes`)."""
        if nbytes < 0:
            raise ValueError(f"hold_bytes needs nbytes >= 0, got {nbytes}")
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _track(self, t: torch.Tensor) -> None:
        t = _local(t)
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key, nbytes = id(storage), storage.nbytes()
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def ddp_bucket_bytes(module: torch.nn.Module) -> int:
    """Bytes of a DDP module's gradient buckets (allocated by its C++ reducer, so invisible to a
    dispatch mode), from DDP's own logging data; 0 for any other module."""
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return 0
    sizes = str(module._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(b) for b in sizes.split(",") if b.strip())


def holding_tracker(parts: list[torch.nn.Module], wrapped: torch.nn.Module | None,
                    optimizer: torch.optim.Optimizer | None = None) -> TensorBytes:
    """A tracker that already counts what exists before a step: the parts' parameters, their
    gradients and buffers, the optimizer's state, and the buckets of a DDP-``wrapped`` model."""
    params = [p for part in parts for p in part.parameters()]
    tracker = TensorBytes()
    tracker.hold(params + [p.grad for p in params if p.grad is not None] + [b for part in parts for b in part.buffers()]
                 + (optimizer_tensors(optimizer) if optimizer is not None else []))
    if wrapped is not None:
        tracker.hold_bytes(ddp_bucket_bytes(wrapped))  # allocated by DDP's C++ reducer, unseen by dispatch
    return tracker
