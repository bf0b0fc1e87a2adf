"""What a step ran, counted at the dispatcher: the evidence a record's claims are checked against.

One untimed step (the comm counter's) runs under :class:`OpTally`, a ``TorchDispatchMode`` that counts

* the **matmuls** (``mm``, ``addmm``, ``bmm``: the ops the ``op`` checkpointing policy counts) inside a backward
  (autograd's graph task: the backward's own matmuls and a checkpoint's recomputation) and outside one (the
  forward). Every matmul of a forward has two in its backward (the input's and the weight's gradient), so what a
  backward ran beyond twice the forward is what it recomputed;
* per transformer block (forward hooks on each block, its attention and the attention's output projection), the
  matmuls each forward call ran, and how many of them the ``op`` policy recomputes (the 2nd, 4th, ...): a
  policy's recomputation is then worked out from what the blocks ran, not from what a model says they run;
* the ops that say which optimizer kernel ran (``_fused_adamw_``).

A selective-checkpoint region replays the ops it saved without dispatching them again, so a cached matmul is
not counted twice. Ops a compiled region runs are not seen by any dispatch mode under inductor; under a Python
dispatch mode torch runs compiled code eagerly (:data:`harness.measure.compile_stats.COUNTED_STEPS_EAGER`), so
the counted step is the eager step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

WATCHED_OPS = {torch.ops.aten._fused_adamw_.default: "fused_adamw", torch.ops.aten._fused_adamw_.tensor_lr: "fused_adamw"}
"""Ops whose dispatch is a claim's evidence, by the name the record gives them."""


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpoint's recomputation included): the same
    test ``torch.utils.checkpoint`` makes."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class BlockCount:
    """One block's forward calls on the counted step (a pipeline stage runs one per microbatch)."""

    calls: int = 0
    matmuls: int = 0
    """Matmuls its forward calls ran."""
    every_other: int = 0
    """Of those, the 2nd, 4th, ... of each call: what the ``op`` policy recomputes."""
    attn_core: int = 0
    """Matmuls in its attention but not the output projection: what the ``attn`` policy recomputes."""


@dataclass
class Tally:
    """The counted step's evidence on one rank (JSON: :meth:`to_json`)."""

    forward_matmuls: int = 0
    backward_matmuls: int = 0
    blocks: dict[str, BlockCount] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class OpTally(TorchDispatchMode):
    """Counts a step's matmuls and watched ops, and each block's forward calls (hooks on while the mode is on)."""

    def __init__(self, matmuls: frozenset, parts: list[nn.Module]) -> None:
        """``matmuls``: the ops counted as matmuls (:data:`harness.parallel.activation_checkpoint.MATMULS`, the
        ``op`` policy's own set, so both count alike); ``parts``: the modules whose blocks (``block_items``, named
        by their layer) are counted one by one while the mode is on."""
        super().__init__()
        self.matmuls = matmuls
        self.parts = parts
        self.tally = Tally()
        self._ops: Counter[str] = Counter()
        self._open: list[tuple[str, str, list[int]]] = []  # (block, region, [matmuls in this call])
        self._handles: list[Any] = []

    def __enter__(self):
        for part in self.parts:
            for name, block in getattr(part, "block_items", list)():
                self._hook(block, name, "block")
                attn = getattr(block, "attn", None)
                out = getattr(attn, "out", None)
                if isinstance(attn, nn.Module) and isinstance(out, nn.Module):
                    self._hook(attn, name, "attn")
                    self._hook(out, name, "out")
        return super().__enter__()

    def _hook(self, module: nn.Module, name: str, region: str) -> None:
        def pre(_m, _args):
            if not in_backward():  # a recomputation calls the forward function, not the module: no hooks
                self._open.append((name, region, [0]))

        def post(_m, _args, _out):
            if self._open and self._open[-1][:2] == (name, region):
                self._close(*self._open.pop())

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _close(self, name: str, region: str, n: list[int]) -> None:
        b = self.tally.blocks.setdefault(name, BlockCount())
        if region == "block":
            b.calls += 1
            b.matmuls += n[0]
            b.every_other += n[0] // 2
        elif region == "attn":
            b.attn_core += n[0]
        else:
            b.attn_core -= n[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.matmuls:
            if in_backward():
                self.tally.backward_matmuls += 1
            else:
                self.tally.forward_matmuls += 1
                for _, _, n in self._open:
                    n[0] += 1
        name = WATCHED_OPS.get(func)
        if name is not None:
            self._ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.tally.ops = dict(self._ops)
        return super().__exit__(*exc)
