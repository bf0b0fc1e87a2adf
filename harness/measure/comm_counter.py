"""Communication counted, not assumed: a dispatch-level counter of collective calls and bytes.

Every collective in PyTorch 2.x reaches the dispatcher as a ``c10d::*`` op (eager
``torch.distributed`` calls, DDP's reducer, FSDP2) or a ``_c10d_functional::*`` op (DTensor
and functional collectives), so a ``TorchDispatchMode`` sees all of them, including those
issued from C++ (torch's own ``CommDebugMode`` works the same way).

Bytes follow the nccl-tests convention, per call on one rank:

* all_reduce, broadcast, send, recv: the tensor's size;
* all_gather: the gathered (output) size; reduce_scatter: the unsharded (input) size;
* all_to_all: the input size.

Calls issued inside ``harness.comm_scope.comm_label(name)`` are also filed under that label
(:meth:`CommCounter.per_step_labelled`): context parallel's K/V gathers, told apart from FSDP's.

Bus-bandwidth factors (nccl-tests PERFORMANCE.md): all_reduce ``2(n-1)/n``; all_gather,
reduce_scatter, all_to_all ``(n-1)/n``; broadcast, reduce, send/recv (and the ring send_recv) ``1``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.comm_scope import current_label

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "send_recv": lambda n: 1.0,  # nccl-tests sendrecv: each rank sends S and receives S at once
}

# op name (without namespace/overload) -> (collective, which argument's bytes count)
_C10D: dict[str, tuple[str, int | Literal["out"]]] = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
}
_FUNCOL: dict[str, tuple[str, int | Literal["out"]]] = {
    "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_out": ("all_gather", "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
    "broadcast_": ("broadcast", 0),
}


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


class CommCounter(TorchDispatchMode):
    """Counts collective calls and bytes while active. ``counts[name] = [calls, bytes]``, and
    ``labelled[label][name]`` for the calls made under a :func:`harness.comm_scope.comm_label`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.labelled: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self.enabled = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.enabled:
            ns = func.namespace
            name = func._schema.name.split("::", 1)[-1]
            table = _C10D if ns == "c10d" else _FUNCOL if ns == "_c10d_functional" else None
            if table is not None and name in table:
                coll, which = table[name]
                nbytes = _nbytes(out) if which == "out" else _nbytes(args[which]) if len(args) > which else 0
                label = current_label()
                for c in (self.counts[coll],) + ((self.labelled[label][coll],) if label else ()):
                    c[0] += 1
                    c[1] += nbytes
        return out

    def reset(self) -> None:
        self.counts.clear()
        self.labelled.clear()

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        """``{collective: {calls_per_step, bytes_per_step}}`` averaged over ``steps``."""
        return _per_step(self.counts, steps)

    def per_step_labelled(self, label: str, steps: int) -> dict[str, dict[str, float]]:
        """:meth:`per_step` of the calls made under ``label`` only (empty when there were none)."""
        return _per_step(self.labelled.get(label, {}), steps)


def _per_step(counts: dict[str, list[int]], steps: int) -> dict[str, dict[str, float]]:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return {k: {"calls_per_step": v[0] / steps, "bytes_per_step": v[1] / steps} for k, v in sorted(counts.items())}
