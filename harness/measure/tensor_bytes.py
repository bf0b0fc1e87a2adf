"""Peak bytes of live tensor storages: a device-independent memory measure for CPU ranks.

On a CPU rank, peak RSS counts the Python interpreter, torch's libraries, the allocator's
free lists and the pages a freed tensor leaves mapped, so it cannot tell a 1/64 shard from a
1/32 one. This counts what the CUDA allocator's ``max_memory_allocated`` counts: the bytes of
every tensor storage alive at once. A ``TorchDispatchMode`` sees each op's outputs (factory
functions, collectives' output buffers and autograd's gradients included); each new storage is
counted once (views share it; torch keeps one Python object per storage, so it is the key) until
it is freed (a weak-reference callback) and at its current size: FSDP2 frees and re-allocates
its unsharded parameters by resizing their storages in place (``UntypedStorage.resize_``, no
op a dispatch mode sees), so while tracking, a resize of a counted storage is counted too.

Storages that exist before tracking starts are registered with :meth:`TensorBytes.hold`
(parameters, gradients, optimizer state) or, when no tensor can be reached (DDP's gradient
buckets, which its C++ reducer owns), counted ahead in bytes with :meth:`TensorBytes.hold_unseen`:
a pre-existing storage an op later writes into is tracked against that count, so it is never
counted twice and its free is seen. A DTensor counts as its local shard; the
temporaries of DTensor's own redistributions run inside its dispatch and are not seen.
Allocations a backend makes in C++ without a tensor (gloo's scratch buffers) are not seen, on
either side of a comparison. Under ``FakeTensorMode`` (entered before this mode) the same
bookkeeping counts the bytes fake tensors would hold.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the storage this rank holds), the tensor a functional collective wrote for the
    ``AsyncCollectiveTensor`` that wraps it (a wrapper reports the wrapped size as a storage of its own, which holds
    no memory: counted, it doubled a collective's output), or the tensor itself."""
    if type(t).__name__ == "AsyncCollectiveTensor":
        return cast(torch.Tensor, cast(Any, t).elem)
    return t.to_local() if hasattr(t, "to_local") else t


class TensorBytes(TorchDispatchMode):
    """``with TensorBytes() as tb: ...`` then ``tb.peak_bytes``; ``tb.reset_peak()`` restarts the peak."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        """id() of each tracked storage -> its bytes (an entry leaves when the storage is freed)."""
        self._unseen = 0
        """Bytes counted ahead for pre-existing storages no tensor reached (:meth:`hold_unseen`)."""
        self._own_resize = None
        """What ``UntypedStorage`` itself defined as ``resize_`` before :meth:`__enter__`, restored on
        exit (None as shipped: it inherits torch's C method)."""
        self.live_bytes = 0
        self.peak_bytes = 0

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count storages that already exist (parameters, their gradients, optimizer state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t)

    def hold_unseen(self, nbytes: int) -> None:
        """Count ``nbytes`` of storages that exist but that no tensor here reaches (DDP's gradient
        buckets: :func:`ddp_bucket_bytes`).

        They are counted now; a pre-existing storage an op later writes into (DDP's reducer
        copying a gradient into its bucket) is then tracked against this count, not on top of it.
        """
        if nbytes < 0:
            raise ValueError(f"hold_unseen needs nbytes >= 0, got {nbytes}")
        self._unseen += nbytes
        self._add(nbytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _track(self, t: torch.Tensor, inputs: tuple = ()) -> None:
        """Count ``t``'s storage if it is new; ``inputs``: the op's arguments (an output that
        aliases one of them existed before the op, so it may be a storage held unseen)."""
        t = _local(t)
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key, nbytes = id(storage), storage.nbytes()
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = nbytes
        weakref.finalize(storage, self._free, key)
        claimed = 0
        if self._unseen and any(_local(a).untyped_storage() is storage for a in inputs):
            claimed = min(nbytes, self._unseen)  # it existed before the op: counted ahead by hold_unseen
            self._unseen -= claimed
        self._add(nbytes - claimed)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    def _resized(self, storage) -> None:
        key = id(storage)
        if key in self._live:
            nbytes = storage.nbytes()
            self.live_bytes += nbytes - self._live[key]
            self._live[key] = nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __enter__(self):
        """Track, and count resizes of tracked storages (``UntypedStorage.resize_`` wrapped until exit)."""
        self._own_resize = torch.UntypedStorage.__dict__.get("resize_")
        resize = torch.UntypedStorage.resize_

        def counted_resize_(storage, size):
            out = resize(storage, size)
            self._resized(storage)
            return out

        # the ignore: torch types resize_ as a method; patching the class until __exit__ restores it is the point
        torch.UntypedStorage.resize_ = counted_resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        if self._own_resize is None:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = self._own_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs: tuple[torch.Tensor, ...] = ()
        if self._unseen:
            inputs = tuple(a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def ddp_bucket_bytes(module: torch.nn.Module) -> int:
    """Bytes of a DDP module's gradient buckets (allocated by its C++ reducer, so no tensor here
    reaches them), from DDP's own logging data; 0 for any other module. The logging data keeps
    the first iteration's bucket sizes; a rebuild re-partitions the same bytes."""
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
        tracker.hold_unseen(ddp_bucket_bytes(wrapped))
    return tracker
