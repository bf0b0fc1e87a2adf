"""Activation checkpointing as a policy: which of a block's activations are kept for backward, which recomputed.

Each policy is applied per transformer block by :func:`harness.parallel.parallelize.parallelize` (after tensor
parallel, before compile and FSDP: torchtitan's order). It replaces a block's ``forward`` on the instance,
never the module tree, so parameter names (and every record, probe and parity check keyed by them) are the
same with a policy on or off. The memory model counts what each keeps (:mod:`harness.model.memory`), the
comm and compute models what each runs again (:func:`reruns_forward`).

* ``ac full``: every block checkpointed (non-reentrant ``torch.utils.checkpoint``): only the
  block's input is kept, the block is recomputed in backward.
* ``ac layerN``: every N-th block checkpointed whole (``layer2``: blocks 2, 4, 6, ... counted from 1 over
  the whole model), the others keep everything: torchtitan's layer-frequency selective mode.
* ``ac op``: per-op selective checkpointing of every block with torch's selective-checkpoint API
  (:class:`EveryOtherMatmul`): the attention's outputs, the sequence-parallel reduce-scatters and every other
  matmul's output are kept, the rest recomputed. torchtitan's default ("selective op").
* ``ac attn`` (called ``selective`` before ``op`` existed): the attention core of every block (q/k/v
  projections, SDPA and the reshape, :meth:`workloads.model.Attention.core`) is recomputed; norms, the
  output projection and the MLP keep their activations. This is Korthikanti et al.'s (2022) selective
  recompute, which the memory model prices as dropping q, k, v and the attention output.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from harness.errors import UsageError
from workloads.model import Attention, Decoder
from workloads.own_model import OwnModule

AC_POLICIES = ("none", "attn", "op", "layer2", "full")
"""Activation checkpointing policies (the module docstring); ``layerN`` for any N >= 2 checkpoints every N-th
block (``layer2`` is the one listed)."""
AC_ALIASES = {"selective": "attn"}
"""Names a policy had: ``selective`` was the attention core's (records before ``op`` existed say so)."""


def ac_policy(value: str) -> str:
    """A policy by name (``selective`` -> ``attn``); UsageError naming the choices for anything else."""
    value = AC_ALIASES.get(value, value)
    if value in AC_POLICIES or layer_interval(value) is not None:
        return value
    raise UsageError(f"unknown activation checkpointing {value!r}; choose from {', '.join(AC_POLICIES)} "
                     f"(layerN: every N-th block, N >= 2)")


def layer_interval(policy: str) -> int | None:
    """N of ``layerN`` (N >= 2), else None."""
    n = policy.removeprefix("layer")
    return int(n) if policy.startswith("layer") and n.isdigit() and int(n) >= 2 and str(int(n)) == n else None


def checkpointed_layer(policy: str, layer: int) -> bool:
    """Whether block ``layer`` (its index in the whole model) is checkpointed whole: every block under ``full``,
    under ``layerN`` the N-th, 2N-th, ... (1-based, so a pipeline stage checkpoints the same blocks as one
    device does)."""
    n = layer_interval(policy)
    return policy == "full" or (n is not None and (layer + 1) % n == 0)


MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default})
"""The matmuls of a block as autograd dispatches them (``nn.Linear`` on a 3-D input is ``mm`` without a bias,
``addmm`` with one)."""
ALWAYS_SAVED = frozenset({
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
})
"""Outputs the ``op`` policy always keeps: attention (the most expensive op to redo) and the sequence-parallel
reduce-scatter (a collective not worth repeating)."""


class EveryOtherMatmul:
    """The ``op`` policy for :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`: keep the
    attention's outputs and the reduce-scatters, keep the 1st, 3rd, 5th, ... matmul of the block, recompute
    the 2nd, 4th, ... and every cheap op (norms, activations, rotations, casts). A llama3 block keeps q, v,
    SwiGLU's gate and the MLP's output and recomputes k, the attention's output projection and up: about
    half the matmul FLOPs saved for a fraction of the block's activations (torchtitan's default policy,
    written here from its description). One instance per checkpointed call: forward and recompute count
    their matmuls apart, so both take the same decisions."""

    def __init__(self) -> None:
        self.matmuls = {False: 0, True: 0}

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMULS:
            self.matmuls[ctx.is_recompute] += 1
            keep = self.matmuls[ctx.is_recompute] % 2 == 1
        else:
            keep = func in ALWAYS_SAVED
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


PROFILER_OPS = (torch.ops.profiler._record_function_enter_new.default,
                torch.ops.profiler._record_function_exit._RecordFunction)
"""Annotations, not computation. FSDP2 brackets a sharded module's forward hooks in ``record_function``; for a
module FSDP-sharded inside a block (an MoE's experts under expert parallel) its recompute runs more of them than
its forward did, which selective checkpointing's replay takes for a different computation and refuses
("invocation index 2 encountered during backward but not found in storage"). torch leaves such ops out of the
replay (``SAC_IGNORED_OPS``); these join them."""
torch.utils.checkpoint.SAC_IGNORED_OPS.update(PROFILER_OPS)


def _op_contexts():
    return create_selective_checkpoint_contexts(EveryOtherMatmul())


def _checkpointed(fn, context_fn=None):
    extra = {"context_fn": context_fn} if context_fn is not None else {}

    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)

    return run


def apply_ac(part: Decoder | OwnModule, mode: str) -> None:
    """Activation checkpointing on the blocks of ``part`` (see the module docstring): a pipeline stage's by their
    index in the whole model, a module of your own's in its order (``full`` and ``layerN`` only)."""
    mode = ac_policy(mode)
    if mode == "none":
        return
    for i, (name, block) in enumerate(part.block_items()):
        if checkpointed_layer(mode, int(name) if name.isdigit() else i):
            block.forward = _checkpointed(block.forward)
        elif mode == "op":
            block.forward = _checkpointed(block.forward, _op_contexts)
        elif mode == "attn":
            attn = cast(Attention, block.attn)
            core = _checkpointed(attn.core)
            # the instance's forward over the class's method, as for the blocks (nn.Module types it as an attribute)
            cast(nn.Module, attn).forward = lambda x, attn=attn, core=core: attn.out(core(x))


def policies_arg(label: str, text: str) -> tuple[str, ...]:
    """``--ac none,op,layer2``: each a policy (:func:`ac_policy`; the error names the flag)."""
    out = tuple(x.strip() for x in str(text).split(",") if x.strip())
    if not out:
        raise UsageError(f"{label} is empty; choose from {', '.join(AC_POLICIES)} (layerN: every N-th block)")
    try:
        return tuple(ac_policy(x) for x in out)
    except UsageError as e:
        raise UsageError(f"{label}: {e}") from None


def policy_order(policy: str) -> tuple[int, int]:
    """Sort key: from keeping everything to keeping the least (none, attn, op, layerN by N, full)."""
    n = layer_interval(policy)
    if n is not None:
        return (AC_POLICIES.index("layer2"), n)
    return (AC_POLICIES.index(policy), 0)


def reruns_forward(policy: str, layer: int) -> bool:
    """Whether backward runs block ``layer``'s forward again (the ops it did not keep, collectives included, up
    to the last tensor the backward needs: torch's checkpoint stops there): every block under ``op``, the
    checkpointed ones under ``full`` and ``layerN``. ``attn`` reruns the attention core only."""
    return policy == "op" or checkpointed_layer(policy, layer)
