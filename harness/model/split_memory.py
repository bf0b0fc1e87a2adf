"""What a zero-bubble schedule's split backward holds, counted by running torch's own split at the rank's shapes.

torch's pipelining splits a stage's backward in two (``torch.distributed.pipelining._backward``):
``stage_backward_input`` takes the input gradient with ``retain_graph=True`` and keeps, for each parameter group,
the gradient at the nodes where its path meets the input's; ``stage_backward_weight`` then runs one
``torch.autograd.grad`` per group. Under non-reentrant checkpointing each of those passes that unpacks a tensor the
region saved runs the region's forward again (:mod:`harness.model.split_backward`), and the recomputation stores a
copy of every tensor the region saves whose holder is still alive, keyed by that pass. A group's pass unpacks only
its own: the copies the others would need stay, held by nodes the input pass already ran (``retain_graph``), until
the stage's graph is freed after its last group. So a checkpointed block's weight pass holds up to its groups' count
of copies of what it saves, where the plain backward holds one: a Llama 3 8B block at 8,192 tokens in fp32 leaves
1.4 GiB for its weight pass, which then holds 19.5 GiB above that (0.1 GiB uncheckpointed).

No formula here: the stage's blocks run under ``FakeTensorMode`` (no memory, no arithmetic, every tensor at its real
shape) through torch's ``stage_backward_input`` and ``stage_backward_weight`` with
:class:`harness.measure.tensor_bytes.TensorBytes` counting, the same code the schedules call. What the weight pass
holds grows by a constant for each block before the last (linear at 1 to 4 blocks of gpt2, llama3 and moe tiny under
every policy: tests/unit/test_split_memory.py), so runs of one and of two blocks of each kind price a stage of any
depth: the last block as one block, each block before it as what a second block adds.

Not counted: tensor parallel divides the bytes by ``tp`` (every tensor is sharded under sequence parallel; without it
the norms' and residual's are whole); the first stage runs one plain backward in its weight step (nothing split).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.measure.tensor_bytes import TensorBytes
from harness.model.op_record import Recorder
from harness.model.op_trace import TraceSpec, fake_block, residual_dtype, trace_autocast
from harness.parallel.activation_checkpoint import apply_ac
from workloads.architecture import ModelSize


class Stage(nn.Module):
    """Blocks as :func:`harness.parallel.activation_checkpoint.apply_ac` takes a model: each by its index in the
    whole (a layer may repeat: two blocks of one kind)."""

    def __init__(self, blocks: list[tuple[int, nn.Module]]) -> None:
        super().__init__()
        self.layers = [layer for layer, _ in blocks]
        self.blocks = nn.ModuleList(b for _, b in blocks)

    def block_items(self) -> list[tuple[str, nn.Module]]:
        return [(str(layer), b) for layer, b in zip(self.layers, self.blocks, strict=True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def count_split(stage: Stage, x: torch.Tensor, autocast: contextlib.AbstractContextManager) -> tuple[int, int]:
    """(held, weight) of one microbatch ``x`` through ``stage`` (its policy applied) and torch's split backward:
    the bytes ``stage_backward_input`` leaves beyond the forward's (the input's gradient, sent on, not counted), and
    the most ``stage_backward_weight`` holds beyond that. Fake tensors or real, counted alike."""
    # torch's pipelining pulls in the distributed runtime; the CLI's planning paths import this module without it
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight  # noqa: PLC0415

    params = list(stage.parameters())
    with TensorBytes() as tb:
        tb.hold([x])  # as the stage holds its received input: counted from the start, like the output it makes
        with autocast:
            out = stage(x)
        grad = torch.empty_like(out)
        forward_end = tb.live_bytes
        groups = stage_backward_input([out], [grad], [x], iter(params))[1]
        x.grad = None  # sent on: the previous stage's receive buffer counts it
        held = tb.live_bytes - forward_end
        tb.reset_peak()
        stage_backward_weight(iter(params), groups)
        return held, tb.peak_bytes - forward_end - held


@functools.lru_cache(maxsize=256)
def split_pass_bytes(size: ModelSize, layers: tuple[int, ...], spec: TraceSpec) -> tuple[int, int]:
    """:func:`count_split` for a stage of blocks ``layers``, one microbatch at ``spec``, under ``FakeTensorMode``."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        stage = Stage([(layer, fake_block(size, layer, spec, Recorder())) for layer in layers])
        apply_ac(stage, spec.recompute)  # type: ignore[arg-type]
        x = torch.empty(spec.rows, spec.seq, size.d_model, dtype=residual_dtype(spec), requires_grad=True)
        return count_split(stage, x, trace_autocast(spec))


def stage_split_bytes(size: ModelSize, layers: list[int], kind_of: dict[int, int], spec: TraceSpec,
                      tp: int) -> tuple[int, int]:
    """(held, weight) of :func:`split_pass_bytes` for a stage of any depth, from runs of one and two blocks of each
    kind (``kind_of[layer]``: the layer whose block stands for it): the last block's one-block figures, and for each
    block before it what a second block adds (the module docstring), over ``tp``."""
    held = total = 0
    for i, layer in enumerate(layers):
        kind = kind_of[layer]
        one = split_pass_bytes(size, (kind,), spec)
        if i == len(layers) - 1:
            held, total = held + one[0], total + sum(one)
        else:
            two = split_pass_bytes(size, (kind, kind), spec)
            held, total = held + two[0] - one[0], total + sum(two) - sum(one)
    return held // tp, (total - held) // tp
