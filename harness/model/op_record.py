"""The recorder an op trace runs under (:mod:`harness.model.op_trace`): every aten op with a kernel, below autograd
and autocast, as an :class:`Op` with its FLOPs, bytes, kind, phase and the module that ran it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GEMM, ATTENTION, MEMORY, HOST, SYNC = "gemm", "attention", "memory", "host", "sync"


FORWARD, BACKWARD, RECOMPUTE = "forward", "backward", "recompute"


GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})


NO_KERNEL = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "lift_fresh",
                       "detach", "alias", "_unsafe_view", "_local_scalar_dense", "set_", "resize_"})
"""Ops that allocate or re-describe memory without a kernel."""


GATHERS = frozenset({"embedding", "index_select", "index", "gather"})
"""Ops that read only the rows they pick: their bytes read are their output's (and the indices)."""


WRITE_ONLY = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_"})
"""In-place ops that do not read the tensor they write."""


DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8",
          torch.float8_e5m2: "fp8"}


@dataclass(frozen=True)
class Op:
    """One kernel of a traced pass."""

    name: str
    """The aten op (``mm``, ``add``, ``_to_copy``), or ``attention`` / ``rms_norm`` for a stand-in."""
    kind: str
    """:data:`GEMM`, :data:`ATTENTION`, :data:`MEMORY` (every other kernel: bound by the bytes it moves),
    :data:`HOST` (an op dispatched without a kernel: a view, an allocation: host time only) or :data:`SYNC` (the
    host waits for the GPU: an MoE layer reads its routed counts)."""
    phase: str
    """:data:`FORWARD`, :data:`BACKWARD` or :data:`RECOMPUTE` (a checkpointing policy's forward again)."""
    module: str
    """The module that ran it, by its name under the traced root (``attn.q``; ``""``: the root itself)."""
    flops: float
    read: int
    written: int
    dtype: str = ""
    """A GEMM's or attention's operand dtype (``bf16``, ``fp32``, ...)."""
    gemm: tuple[int, int, int, int] = (0, 0, 0, 0)
    """A GEMM's (batch, m, n, k)."""
    attn: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    """Attention's (batch x heads, queries, keys, qk head width, v head width)."""
    features: tuple[int, int] = (0, 0)
    """A GEMM of an ``nn.Linear``: its (in, out) features (which of m, n, k tensor parallel splits)."""
    reads: tuple[tuple[int, int], ...] = ()
    """(storage, bytes) of each tensor read, storages by trace-local id: what compile's fusion rule follows."""
    writes: tuple[tuple[int, int], ...] = ()
    bandwidth_share: float = 1.0
    """The share of the device's achievable bandwidth a memory-bound kernel reaches: 1 but for a compiled kernel
    with a reduction under an Inductor that ran them slower (:func:`harness.model.op_cost.fuse`)."""

    @property
    def bytes(self) -> int:
        return self.read + self.written


def dtype_name(t: torch.Tensor) -> str:
    return DTYPES.get(t.dtype, str(t.dtype).removeprefix("torch."))


def storage_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Recorder(TorchDispatchMode):
    """Records every aten op with a kernel (see the module docstring); ``phase`` and ``module`` say where."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.phase = FORWARD
        self.modules: list[str] = []
        """The forward's module stack (hooks push and pop)."""
        self.inputs: list[set] = []
        """Beside it, the autograd nodes of each running module's inputs (where its own nodes end)."""
        self.node_module: dict = {}
        """Autograd node -> the module whose forward made it (the backward's attribution)."""
        self.linears: dict[str, tuple[int, int]] = {}
        """Each ``nn.Linear``'s (in, out) features, by module name."""
        self.quiet = 0
        self._ids: dict[int, int] = {}
        self._keep: list = []
        """Every storage seen, held so that an id is never reused within one trace (fake: they hold nothing)."""

    @contextlib.contextmanager
    def silent(self) -> Iterator[None]:
        """Ops inside run unrecorded (a stand-in's own allocations)."""
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    def module(self) -> str:
        if self.phase == BACKWARD:
            return self.node_module.get(torch._C._current_autograd_node(), "")
        return self.modules[-1] if self.modules else ""

    def sid(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        key = id(storage)
        if key not in self._ids:
            self._ids[key] = len(self._ids)
            self._keep.append(storage)
        return self._ids[key]

    def add(self, name: str, kind: str, flops: float, read: int, written: int, ins: list[torch.Tensor],
            outs: list[torch.Tensor], **shape: Any) -> None:
        module = self.module()
        if kind == GEMM:
            shape.setdefault("features", self.linears.get(module, (0, 0)))
        self.ops.append(Op(name=name, kind=kind, phase=self.phase, module=module, flops=flops, read=read,
                           written=written, reads=tuple((self.sid(t), storage_bytes(t)) for t in ins),
                           writes=tuple((self.sid(t), storage_bytes(t)) for t in outs), **shape))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.quiet and func.namespace == "aten":
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_KERNEL:
            self.add(name, HOST, 0.0, 0, 0, [], [])
            return
        ins = unique_tensors([a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)])
        outs = unique_tensors([t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        if name in GEMMS:
            self._gemm(name, args, ins, outs)
            return
        written = sum(storage_bytes(t) for t in outs)
        if func._schema.is_mutable:  # in-place and foreach ops: what they write is their mutated arguments
            mutated = unique_tensors([t for a, v in zip(func._schema.arguments, args, strict=False)
                               if a.alias_info is not None and a.alias_info.is_write
                               for t in tree_leaves(v) if isinstance(t, torch.Tensor)])
            outs = unique_tensors(outs + mutated)
            written = sum(storage_bytes(t) for t in outs)
        if name in GATHERS:
            read = written + sum(storage_bytes(t) for t in ins if not t.is_floating_point())
        else:
            skip = args[0] if name in WRITE_ONLY and args else None
            read = sum(min(storage_bytes(t), t.untyped_storage().nbytes()) for t in ins if t is not skip)
        self.add(name, MEMORY, 0.0, read, written, ins, outs)

    def _gemm(self, name: str, args: tuple, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
        batch = a.shape[0] if a.dim() == 3 else 1
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        fp8 = is_float8(a) or is_float8(b)  # torchao's float8 tensors: the matmul is a float8 one at a byte an operand
        read = sum(t.numel() if is_float8(t) else storage_bytes(t) for t in ins)
        self.add(name, GEMM, 2.0 * batch * m * n * k, read, sum(storage_bytes(t) for t in outs), ins, outs,
                 dtype="fp8" if fp8 else dtype_name(a), gemm=(batch, m, n, k))


def is_float8(t: torch.Tensor) -> bool:
    """Whether ``t`` is torchao's float8 training tensor (a subclass holding float8 data and its scale)."""
    return "Float8" in type(t).__name__


def unique_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage (an op reading two views of one storage reads it once)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        key = id(t.untyped_storage())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out
